"""Tool calls in the Hermes format (Qwen2.5's, Hermes' and many other chat templates'):

.. code-block:: text

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

:func:`tool_call_grammar` is the structural tag that makes a model write one or more such calls
of the given tools, with arguments that follow each tool's parameter schema (``tool_choice``
``required`` or a named function); :class:`ToolCallParser` reads the calls out of a model's
text, whole or as it streams, into OpenAI's ``tool_calls`` (the text before the first call is
the message's content).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

BEGIN = "<tool_call>"
END = "</tool_call>"
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


def _call(body: str) -> dict | None:
    """The OpenAI tool call written as ``body`` (the JSON between the tags), or None if it is
    not one."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {
            "name": call["name"],
            "arguments": json.dumps(arguments, ensure_ascii=False),
        },
    }


_BLOCK = re.compile(re.escape(BEGIN) + r"(.*?)" + re.escape(END), re.DOTALL)


class ToolCallParser:
    """Reads one choice's tool calls as its text arrives: :meth:`feed` takes each new piece of
        text (``final`` with the last) and returns the content and the calls it completes. The
        content is the text before the first ``<tool_call>`` (trailing whitespace dropped; a
        possible beginning of the tag held back until it is told apart); complete calls are
        returned as they close (a call left unclosed at the end, as at a length limit, counts if its
    JSON is whole);
        malformed calls are dropped; a text with no call at all is content as it is. Fed the whole
        text at once or in pieces, the content and calls add up to the same. ``parallel``: False
        keeps only the first call."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.text = ""
        self.calls: list[dict] = []
        self._emitted = 0  # characters of content handed out
        self._scanned = 0  # where the next call may begin

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += piece
        first = self.text.find(BEGIN)
        content_end = len(self.text) if first < 0 else first
        if first < 0 and not final:
            content_end -= _partial(self.text, BEGIN)
        new_calls = self._new_calls(first, final) if first >= 0 else []
        if final and not self.calls:
            content_end = len(self.text)  # no call: everything is content
        elif not final or self.calls:
            content_end = len(self.text[:content_end].rstrip())
        content = self.text[self._emitted : content_end] if content_end > self._emitted else ""
        self._emitted = max(self._emitted, content_end)
        return content, new_calls

    def _new_calls(self, first: int, final: bool) -> list[dict]:
        found = []
        self._scanned = max(self._scanned, first)
        while True:
            match = _BLOCK.search(self.text, self._scanned)
            if match is None:
                break
            self._scanned = match.end()
            call = _call(match.group(1))
            if call is not None:
                found.append(call)
        if final:
            rest = self.text.find(BEGIN, self._scanned)
            if rest >= 0:
                body = self.text[rest + len(BEGIN) :].rstrip()
                call = _call(body[: len(body) - _partial(body, END)])
                if call is not None:
                    found.append(call)
                self._scanned = len(self.text)
        if not self.parallel:
            found = found[: max(0, 1 - len(self.calls))]
        self.calls += found
        return found

    @property
    def content(self) -> str | None:
        """The content handed out so far; None when it is empty and there are calls."""
        text = self.text[: self._emitted]
        return None if not text and self.calls else text


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def stream_delta(calls: list[dict], first_index: int) -> list[dict[str, Any]]:
    """``calls`` as the ``tool_calls`` of a streamed delta, numbered from ``first_index``."""
    return [{"index": first_index + i, **call} for i, call in enumerate(calls)]
