"""The grammar of forced tool calls, in the Hermes format (Qwen2.5's, Hermes' and many other
chat templates'):

.. code-block:: text

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

:func:`tool_call_grammar` is the structural tag that makes a model write one or more such calls
of the given tools, with arguments that follow each tool's parameter schema (``tool_choice``
``required`` or a named function). Forced calls are always written, and read, in this format.
"""

from __future__ import annotations

from paged_attention.server.tool_calls.formats import HERMES

BEGIN = HERMES.markers[0]
END = HERMES.closing
# Between the parts of a call's JSON: at most this much whitespace (a model may otherwise fill
# its budget with blanks; one-line JSON needs one space).
MAX_WHITESPACE = 1


def call_schema(name: str, parameters: dict | None) -> dict:
    """The JSON schema of one call of the function ``name``: its name, then its arguments
    (``parameters``; None: any JSON object)."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": name},
            "arguments": parameters if parameters is not None else {"type": "object"},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_call_grammar(functions: list[tuple[str, dict | None]], parallel: bool) -> dict:
    """An xgrammar structural tag: one or more Hermes calls (only one unless ``parallel``) of
    the ``(name, parameters schema)`` functions, separated by newlines, and nothing else."""
    tags = [
        {
            "type": "tag",
            "begin": f"{BEGIN}\n",
            "content": {
                "type": "json_schema",
                "json_schema": call_schema(name, parameters),
                "max_whitespace_cnt": MAX_WHITESPACE,
            },
            "end": f"\n{END}",
        }
        for name, parameters in functions
    ]
    return {
        "type": "structural_tag",
        "format": {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": not parallel,
        },
    }
