"""The ways models write tool calls, and the registry behind ``serve --tool-call-parser``.

* ``hermes`` (Qwen2.5's, Hermes', and the server's own description of tools): each call in
  its own tags, ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, anywhere in the
  answer;
* ``llama3_json`` (Llama 3.1 to 3.3): ``{"name": "f", "parameters": {...}}`` opening the
  answer, or anywhere after ``<|python_tag|>``; several calls separated by ``;``;
* ``mistral``: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``, anywhere;
* ``auto``: the one the model's chat template writes (``hermes`` when it names none).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CallFormat:
    """How one family of models writes its calls: each call is a JSON object
    (:mod:`~paged_attention.server.tool_calls.call_object`) in a group opened by one of
    ``markers`` (or, with ``bare_start``, by the object itself at the very start of the
    answer), then ``opening``; the group's calls are separated by ``separator`` and the group
    ends with ``closing`` (each "" when the format has none; blanks allowed around each)."""

    name: str
    markers: tuple[str, ...]
    opening: str = ""
    separator: str = ""
    closing: str = ""
    bare_start: bool = False


HERMES = CallFormat("hermes", markers=("<tool_call>",), closing="</tool_call>")
LLAMA3_JSON = CallFormat("llama3_json", markers=("<|python_tag|>",), separator=";", bare_start=True)
MISTRAL = CallFormat("mistral", markers=("[TOOL_CALLS]",), opening="[", separator=",", closing="]")

FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}
PARSER_NAMES = (*FORMATS, "auto")
DEFAULT_PARSER = "hermes"

# What in a chat template tells its call format, most telling first.
_TEMPLATE_SIGNS = (
    ("[TOOL_CALLS]", MISTRAL),
    ("<|python_tag|>", LLAMA3_JSON),
    ("<tool_call>", HERMES),
)


def template_format(chat_template) -> CallFormat:
    """The call format ``chat_template`` (a Jinja string, a dict of named ones, or None)
    writes; Hermes, which the server describes tools in, when it shows none."""
    if isinstance(chat_template, dict):
        chat_template = "\n".join(str(t) for t in chat_template.values())
    text = chat_template if isinstance(chat_template, str) else ""
    for sign, call_format in _TEMPLATE_SIGNS:
        if sign in text:
            return call_format
    return HERMES


def call_format(parser: str, chat_template=None) -> CallFormat:
    """The format ``parser`` names (``auto``: the chat template's); a ValueError naming
    ``tool_call_parser`` for a name that is none of :data:`PARSER_NAMES`."""
    if parser == "auto":
        return template_format(chat_template)
    if parser not in FORMATS:
        raise ValueError(
            f"tool_call_parser must be one of {', '.join(PARSER_NAMES)}, got {parser!r}"
        )
    return FORMATS[parser]
