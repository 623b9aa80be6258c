"""Reading one answer's tool calls out of its text as it streams, in OpenAI's delta shape.

:class:`ToolCallReader` is fed the answer's text in pieces (the last one ``final``) and hands
out, for each piece, what it surely knows: content, the start of a call (its index, id and
name, as soon as the name is complete) and pieces of a call's arguments (as soon as they
surely belong to them). Fed the whole text at once, or cut anywhere, it hands out the same
content and calls (the ids aside, which are drawn afresh).

What counts (one rule for every format, :mod:`~paged_attention.server.tool_calls.formats`):

* a call is a call once its name is read; its arguments are then what the model wrote of them,
  up to where its JSON ends or breaks (``"{}"`` when it wrote none);
* everything else is content, exactly as written, malformed calls included: a group of calls
  whose first object breaks (or closes) before its name is read goes back to the content
  whole, and the reading goes on after its marker;
* the blanks between the content and a call are dropped (those before the first call and
  after the last one included); the blanks at the end of a text with no call are kept;
* with ``parallel=False``, the calls after the first are read over (neither calls nor content).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Union

from paged_attention.server.tool_calls.call_object import CallObject, Read
from paged_attention.server.tool_calls.formats import CallFormat
from paged_attention.server.tool_calls.json_scan import WHITESPACE


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class Arguments:
    index: int
    text: str


Event = Union[Content, CallStart, Arguments]


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallReader:
    """One answer's content and calls in ``call_format``, read with :meth:`feed`: whole
    (:attr:`content`, :attr:`calls` in OpenAI's shape) and as events in order."""

    def __init__(self, call_format: CallFormat, parallel: bool = True) -> None:
        self.format = call_format
        self.limit = None if parallel else 1
        self._plain = re.compile(
            "[" + re.escape(WHITESPACE + "".join(m[0] for m in call_format.markers)) + "]"
        )
        self._state = "text"  # "text", "open" (a group's start), "call", "after" (a call)
        self._held_ws = ""  # blanks that may come before a call
        self._partial = ""  # what may begin a marker ("text") or the closing ("after")
        self._candidate = ""  # the text of a group not yet known to hold a call
        self._need_opening = False
        self._after_call = False  # the held blanks follow a call
        self._at_start = True  # nothing but blanks read yet
        self._object: CallObject | None = None
        self._committed = False  # the object's call was started
        self._count = 0  # calls started, read-over ones included
        self._argument_chars = 0  # of the current call
        self._content: list[str] = []
        self._events: list[Event] = []
        self.calls: list[dict] = []

    @property
    def content(self) -> str | None:
        """The content handed out so far; None when it is empty and there are calls."""
        text = "".join(self._content)
        return None if not text and self.calls else text

    def feed(self, piece: str, final: bool = False) -> list[Event]:
        """The events ``piece`` (the next text of the answer; ``final``: its end) settles."""
        self._events = []
        text, i = piece, 0
        while i < len(text):
            if self._state == "text" and not self._partial and not self._at_start:
                match = self._plain.search(text, i)
                stop = match.start() if match else len(text)
                if stop > i:
                    self._emit_text(text[i:stop])
                    i = stop
                    continue
            replay = self._step(text[i])
            if replay is None:
                i += 1
            else:  # characters to read again, in the new state
                text, i = replay + text[i + 1 :], 0
        if final:
            self._finish()
        return _merged(self._events)

    # ------------------------------------------------------------------ states

    def _step(self, ch: str) -> str | None:
        """Reads ``ch``; returns the text to read again (``ch`` included when it was not
        taken), or None."""
        if self._state == "text":
            return self._text(ch)
        if self._state == "open":
            return self._open(ch)
        if self._state == "call":
            return self._call(ch)
        return self._after(ch)

    def _text(self, ch: str) -> str | None:
        markers = self.format.markers
        if self._partial:
            candidate = self._partial + ch
            if candidate in markers:
                self._partial = ""
                self._begin_group(candidate, self.format.opening)
            elif any(m.startswith(candidate) for m in markers):
                self._partial = candidate
            else:  # not a marker: its first character is content
                first, rest = self._partial[0], self._partial[1:]
                self._partial = ""
                self._emit_text(first)
                return rest + ch
            return None
        if ch in WHITESPACE:
            self._held_ws += ch
        elif ch == "{" and self._at_start and self.format.bare_start:
            self._begin_group("", "")
            return ch
        elif any(m.startswith(ch) for m in markers):
            self._partial = ch
        else:
            self._emit_text(ch)
        return None

    def _begin_group(self, marker: str, opening: str) -> None:
        self._state, self._candidate = "open", marker
        self._need_opening = bool(opening)
        self._at_start = False

    def _open(self, ch: str) -> str | None:
        """After a marker (then the opening) or a separator: blanks, then a call's object."""
        if ch in WHITESPACE:
            self._candidate += ch
        elif self._need_opening and ch == self.format.opening:
            self._candidate += ch
            self._need_opening = False
        elif not self._need_opening and ch == "{":
            self._state, self._object = "call", CallObject()
            return ch
        else:
            return self._give_back(ch)
        return None

    def _call(self, ch: str) -> str | None:
        read = self._object.feed(ch)
        if read is Read.BAD:
            if not self._committed:
                return self._give_back(ch)
            self._end_call()
            return ch
        if not self._committed:
            self._candidate += ch
            if self._object.name is not None:
                self._start_call(self._object.name)
        if self._committed:
            self._emit_arguments(self._object.take_arguments())
        if read is Read.END:
            if self._committed:
                self._end_call()
            else:  # an object with no name: text
                self._give_back("")
        return None

    def _after(self, ch: str) -> str | None:
        """After a call: blanks (dropped), then the separator, the closing, or text."""
        closing = self.format.closing
        if self._partial or (closing and ch == closing[0]):
            candidate = self._partial + ch
            if candidate == closing:
                self._partial, self._state, self._after_call = "", "text", True
            elif closing.startswith(candidate):
                self._partial = candidate
            else:
                self._state, self._after_call = "text", True
                replay, self._partial = candidate, ""
                return replay
        elif ch in WHITESPACE:
            pass
        elif ch == self.format.separator:
            self._begin_group(ch, "")
        else:
            self._state, self._after_call = "text", True
            return ch
        return None

    # ------------------------------------------------------------------ outcomes

    def _give_back(self, replay: str) -> str:
        """The group read so far holds no call: it is content; ``replay`` is read again."""
        self._state, self._object = "text", None
        candidate, self._candidate = self._candidate, ""
        text = candidate.rstrip(WHITESPACE)
        if text:
            self._emit_text(text)
        self._held_ws += candidate[len(text) :]  # they may come before a call
        return replay

    def _emit_text(self, text: str) -> None:
        held, self._held_ws = self._held_ws, ""
        if not self._after_call:
            text = held + text
        self._after_call, self._at_start = False, False
        self._content.append(text)
        self._events.append(Content(text))

    def _start_call(self, name: str) -> None:
        self._committed, self._candidate, self._held_ws = True, "", ""
        self._argument_chars = 0
        index = self._count
        self._count += 1
        if self.limit is None or index < self.limit:
            identifier = call_id()
            call = {"id": identifier, "type": "function", "function": {"name": name}}
            call["function"]["arguments"] = ""
            self.calls.append(call)
            self._events.append(CallStart(index, identifier, name))

    def _emit_arguments(self, text: str) -> None:
        if not text:
            return
        self._argument_chars += len(text)
        index = self._count - 1
        if self.limit is None or index < self.limit:
            self.calls[index]["function"]["arguments"] += text
            self._events.append(Arguments(index, text))

    def _end_call(self) -> None:
        if not self._argument_chars:
            self._emit_arguments("{}")
        self._committed, self._object, self._state = False, None, "after"

    def _finish(self) -> None:
        """The end of the answer: what was held is settled."""
        if self._state == "call" and self._committed:
            self._end_call()
        elif self._state in ("open", "call"):
            self._give_back("")
        elif self._state == "text" and self._partial:
            partial, self._partial = self._partial, ""
            self._emit_text(partial)
        self._partial = ""  # the start of a closing after the last call is the call's
        if self._held_ws and not self._after_call:
            self._emit_text("")
        self._held_ws = ""


def _merged(events: list[Event]) -> list[Event]:
    """``events`` with neighbouring content, and neighbouring arguments of one call, joined."""
    merged: list[Event] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, Content) and isinstance(last, Content):
            merged[-1] = Content(last.text + event.text)
        elif isinstance(event, Arguments) and isinstance(last, Arguments):
            if last.index == event.index:
                merged[-1] = Arguments(event.index, last.text + event.text)
                continue
            merged.append(event)
        elif not (isinstance(event, Content) and not event.text):
            merged.append(event)
    return merged


def stream_deltas(events: list[Event]) -> list[dict]:
    """``events`` as the ``delta`` of chat completion chunks, in OpenAI's shape: a call's
    first delta carries its index, id, type, name and empty arguments; the following ones,
    the index and the next piece of the arguments."""
    deltas = []
    for event in events:
        if isinstance(event, Content):
            deltas.append({"content": event.text})
        elif isinstance(event, CallStart):
            function = {"name": event.name, "arguments": ""}
            call = {"index": event.index, "id": event.id, "type": "function", "function": function}
            deltas.append({"tool_calls": [call]})
        else:
            call = {"index": event.index, "function": {"arguments": event.text}}
            deltas.append({"tool_calls": [call]})
    return deltas
