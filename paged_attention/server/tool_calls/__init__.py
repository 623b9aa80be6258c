"""Tool calls: the grammar that forces them, and reading them out of a model's answer.

* :mod:`~paged_attention.server.tool_calls.formats` — how models write calls (Hermes,
  Llama 3 JSON, Mistral) and the registry ``serve --tool-call-parser`` picks from;
* :mod:`~paged_attention.server.tool_calls.reader` — an answer's content and calls, whole or
  as they stream, in OpenAI's delta shape;
* :mod:`~paged_attention.server.tool_calls.call_object` and
  :mod:`~paged_attention.server.tool_calls.json_scan` — one call's JSON object, read a
  character at a time;
* :mod:`~paged_attention.server.tool_calls.grammar` — the structural tag that makes a model
  write calls of the given tools in a format (``tool_choice`` ``required`` or a named
  function).
"""

from paged_attention.server.tool_calls.formats import (
    DEFAULT_PARSER,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    PARSER_NAMES,
    CallFormat,
    call_format,
)
from paged_attention.server.tool_calls.grammar import call_schema, tool_call_grammar
from paged_attention.server.tool_calls.reader import ToolCallReader, stream_deltas

__all__ = [
    "DEFAULT_PARSER",
    "HERMES",
    "LLAMA3_JSON",
    "MISTRAL",
    "PARSER_NAMES",
    "CallFormat",
    "ToolCallReader",
    "call_format",
    "call_schema",
    "stream_deltas",
    "tool_call_grammar",
]
