"""The grammar of forced tool calls (``tool_choice`` ``required`` or a named function), in the
call format the server reads (:mod:`~paged_attention.server.tool_calls.formats`):

.. code-block:: text

    hermes       <tool_call>
                 {"name": "get_weather", "arguments": {"city": "Paris"}}
                 </tool_call>
                 <tool_call>
                 {"name": "get_time", "arguments": {"zone": "CET"}}
                 </tool_call>
    llama3_json  {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}
    mistral      [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]

:func:`tool_call_grammar` is the xgrammar structural tag that makes a model write one or more
such calls of the given tools (only one unless parallel), each with arguments that follow its
tool's parameter schema, and nothing else.
"""

from __future__ import annotations

from paged_attention.server.tool_calls.formats import HERMES, LLAMA3_JSON, MISTRAL, CallFormat

# Between the parts of a call's JSON: at most this much whitespace (a model may otherwise fill
# its budget with blanks; one-line JSON needs one space).
MAX_WHITESPACE = 1

# What separates two calls in each format (each format's reader also takes other blanks).
SEPARATORS = {HERMES.name: "\n", LLAMA3_JSON.name: "; ", MISTRAL.name: ", "}


def call_schema(name: str, parameters: dict | None, arguments_key: str = "arguments") -> dict:
    """The JSON schema of one call of the function ``name``: its name, then its arguments
    (``parameters``; None: any JSON object) under ``arguments_key``."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": name},
            arguments_key: parameters if parameters is not None else {"type": "object"},
        },
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _call_json(name: str, parameters: dict | None, arguments_key: str) -> dict:
    return {
        "type": "json_schema",
        "json_schema": call_schema(name, parameters, arguments_key),
        "max_whitespace_cnt": MAX_WHITESPACE,
    }


def _hermes(functions: list[tuple[str, dict | None]], parallel: bool) -> dict:
    """Each call in its own tags, the tags separated by newlines."""
    tags = [
        {
            "type": "tag",
            "begin": f"{HERMES.markers[0]}\n",
            "content": _call_json(name, parameters, "arguments"),
            "end": f"\n{HERMES.closing}",
        }
        for name, parameters in functions
    ]
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": SEPARATORS[HERMES.name],
        "at_least_one": True,
        "stop_after_first": not parallel,
    }


def _call_list(
    functions: list[tuple[str, dict | None]], parallel: bool, arguments_key: str, separator: str
) -> dict:
    """One call of any of ``functions``, then (when ``parallel``) any number more, each after
    ``separator``."""
    calls = [_call_json(name, parameters, arguments_key) for name, parameters in functions]
    call = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    if not parallel:
        return call
    more = {"type": "sequence", "elements": [{"type": "const_string", "value": separator}, call]}
    return {"type": "sequence", "elements": [call, {"type": "star", "content": more}]}


def _llama3_json(functions: list[tuple[str, dict | None]], parallel: bool) -> dict:
    """The calls' objects opening the answer, separated by ``; ``."""
    return _call_list(functions, parallel, "parameters", SEPARATORS[LLAMA3_JSON.name])


def _mistral(functions: list[tuple[str, dict | None]], parallel: bool) -> dict:
    """The marker, then one JSON list of the calls."""
    calls = _call_list(functions, parallel, "arguments", SEPARATORS[MISTRAL.name])
    parts = [MISTRAL.markers[0] + MISTRAL.opening, calls, MISTRAL.closing]
    elements = [{"type": "const_string", "value": p} if isinstance(p, str) else p for p in parts]
    return {"type": "sequence", "elements": elements}


_BUILDERS = {HERMES.name: _hermes, LLAMA3_JSON.name: _llama3_json, MISTRAL.name: _mistral}


def tool_call_grammar(
    functions: list[tuple[str, dict | None]], parallel: bool, call_format: CallFormat = HERMES
) -> dict:
    """An xgrammar structural tag: one or more calls (only one unless ``parallel``) of the
    ``(name, parameters schema)`` functions written in ``call_format``, and nothing else; a
    ValueError naming ``call_format`` for a format that is not in the registry."""
    if not functions:
        raise ValueError("functions must hold at least one function to call")
    builder = _BUILDERS.get(call_format.name)
    if builder is None:
        names = ", ".join(_BUILDERS)
        raise ValueError(f"call_format must be one of {names}, got {call_format.name!r}")
    return {"type": "structural_tag", "format": builder(functions, parallel)}
