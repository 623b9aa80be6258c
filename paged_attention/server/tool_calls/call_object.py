"""One tool call's JSON object, ``{"name": "f", "arguments": {...}}``, read a character at a
time: the name once its string is complete, the arguments' characters as soon as they surely
belong to them.

The arguments are the object's ``"arguments"`` member (or ``"parameters"``, Llama's
spelling; the first of them counts) exactly as the model wrote it, from its ``{`` to its
``}``; written as a JSON string instead, they are the string's decoded text. Members of other
names are read over; a member's value of another kind (a number, a list, ``null``) gives no
arguments.
"""

from __future__ import annotations

import enum

from paged_attention.server.tool_calls.json_scan import WHITESPACE, JsonValueScanner, Step

ARGUMENT_KEYS = ("arguments", "parameters")


class Read(enum.Enum):
    """What one character did to the call's object."""

    MORE = "more"  # taken; the object goes on
    END = "end"  # taken; it closed the object
    BAD = "bad"  # not taken: it cannot continue the object


class CallObject:
    """Reads one call's object with :meth:`feed`: :attr:`name` is set once the name's string is
    complete (the first ``"name"`` member; a name that is not a non-empty string makes the
    object bad), :meth:`take_arguments` hands out the arguments' characters taken since the
    last call."""

    def __init__(self) -> None:
        # "open": whitespace, then "{"; "key": a key or (first member only) "}"; "colon";
        # "value": whitespace, then a value; "next": "," or "}"
        self._expect = "open"
        self._first_member = True
        self._scanner: JsonValueScanner | None = None  # the key or value being read
        self._member = ""  # the key of the member whose value is read
        self._arguments: list[str] = []
        self._arguments_kind = ""  # "{": written as an object, '"': as a string
        self.name: str | None = None

    def take_arguments(self) -> str:
        text = "".join(self._arguments)
        self._arguments.clear()
        return text

    def feed(self, ch: str) -> Read:
        if self._scanner is not None:
            return self._in_scanner(ch)
        if ch in WHITESPACE:
            return Read.MORE
        expect = self._expect
        if expect == "open":
            return self._then(ch == "{", "key")
        if expect == "key":
            if ch == "}" and self._first_member:
                return Read.END
            if ch != '"':
                return Read.BAD
            self._scanner = JsonValueScanner()
            self._scanner.feed(ch)
            return Read.MORE
        if expect == "colon":
            return self._then(ch == ":", "value")
        if expect == "value":
            return self._value_start(ch)
        # expect == "next"
        if ch == "}":
            return Read.END
        self._first_member = False
        return self._then(ch == ",", "key")

    def _then(self, ok: bool, expect: str) -> Read:
        if not ok:
            return Read.BAD
        self._expect = expect
        return Read.MORE

    def _value_start(self, ch: str) -> Read:
        if self._member == "name" and (ch != '"' or self.name is not None):
            if self.name is None:
                return Read.BAD  # a name must be a string
            self._member = ""  # a second name is read over
        self._scanner = JsonValueScanner()
        if self._member in ARGUMENT_KEYS:
            if self._arguments_kind or ch not in '{"':
                self._member = ""  # a second spelling, or arguments of no usable kind
            else:
                self._arguments_kind = ch
        return self._in_scanner(ch)

    def _in_scanner(self, ch: str) -> Read:
        scanner = self._scanner
        step = scanner.feed(ch)
        if step is Step.BAD:
            return Read.BAD
        if self._expect == "key":
            if step is Step.END:
                self._member = scanner.take_decoded()
                self._scanner = None
                self._expect = "colon"
            return Read.MORE
        if self._member in ARGUMENT_KEYS:
            self._keep_arguments(ch, step, scanner)
        if step is Step.MORE:
            return Read.MORE
        if self._member == "name":
            name = scanner.take_decoded()
            if not name:
                return Read.BAD
            self.name = name
        self._scanner, self._member, self._expect = None, "", "next"
        if step is Step.END_BEFORE:  # a number ended: the character is the object's
            return self.feed(ch)
        return Read.MORE

    def _keep_arguments(self, ch: str, step: Step, scanner: JsonValueScanner) -> None:
        if self._arguments_kind == "{":
            if step is not Step.END_BEFORE:
                self._arguments.append(ch)
        else:
            self._arguments.append(scanner.take_decoded())
