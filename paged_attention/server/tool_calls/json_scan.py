"""A JSON value checked one character at a time, as a model writes it.

:class:`JsonValueScanner` tells, for each character, whether it continues a valid JSON value,
completes it, or cannot belong to it; a top-level string's decoded text comes out as its
characters arrive. The tool-call readers build on it to know which characters of a model's
text surely belong to a call's arguments before the call is complete.
"""

from __future__ import annotations

import enum

WHITESPACE = " \t\n\r"
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_HEX = frozenset("0123456789abcdefABCDEF")
REPLACEMENT = "\ufffd"  # a lone UTF-16 surrogate escape decodes to this (it has no UTF-8)


class Step(enum.Enum):
    """What one character did to the value."""

    MORE = "more"  # taken; the value goes on
    END = "end"  # taken; it completed the value
    END_BEFORE = "end before"  # not taken: the value (a number) was complete before it
    BAD = "bad"  # not taken: no valid JSON value goes on with it


# The states of a number (RFC 8259): those in _NUMBER_ENDS may be its last character.
_NUMBER_MOVES = {
    ("minus", "0"): "zero",
    ("minus", "1"): "int",
    ("zero", "."): "dot",
    ("zero", "e"): "exp",
    ("int", "1"): "int",
    ("int", "0"): "int",
    ("int", "."): "dot",
    ("int", "e"): "exp",
    ("dot", "0"): "frac",
    ("dot", "1"): "frac",
    ("frac", "0"): "frac",
    ("frac", "1"): "frac",
    ("frac", "e"): "exp",
    ("exp", "+"): "sign",
    ("exp", "0"): "digits",
    ("exp", "1"): "digits",
    ("sign", "0"): "digits",
    ("sign", "1"): "digits",
    ("digits", "0"): "digits",
    ("digits", "1"): "digits",
}
_NUMBER_ENDS = frozenset({"zero", "int", "frac", "digits"})


def _number_class(ch: str) -> str:
    """The class of ``ch`` in :data:`_NUMBER_MOVES`: ``0``, ``1`` (any other digit), ``e``,
    ``+`` (either sign) or itself."""
    if ch == "0":
        return "0"
    if "1" <= ch <= "9":
        return "1"
    if ch in "eE":
        return "e"
    if ch in "+-":
        return "+"
    return ch


class JsonValueScanner:
    """One JSON value (RFC 8259, strict: no raw control characters in strings), fed a
    character at a time with :meth:`feed`. Whitespace before the value is taken; the value
    ends at its last character (a number at the first character after it, which is not
    taken). A top-level string's decoded characters are handed out by :meth:`take_decoded`."""

    def __init__(self) -> None:
        # each open container: "{" expecting a key or "}", "k" a key, ":" the colon,
        # "v" a member's value, "," a comma or "}"; "[" a value or "]", "a" a value,
        # "]" a comma or "]"
        self._stack: list[str] = []
        self._token: str | None = None  # "string", "escape", "unicode", "literal", "number"
        self._pending = ""  # a literal's remaining characters, or a unicode escape's hex
        self._number = ""  # the number's state
        self._high_surrogate: int | None = None  # a decoded escape waiting for its pair
        self.first = ""  # the value's first character (its kind), once it has begun
        self.done = False
        self._decoded: list[str] = []

    def take_decoded(self) -> str:
        """The decoded characters of a top-level string since the last call."""
        text = "".join(self._decoded)
        self._decoded.clear()
        return text

    @property
    def top_level(self) -> bool:
        return not self._stack

    def feed(self, ch: str) -> Step:
        if self.done:
            return Step.BAD
        token = self._token
        if token in ("string", "escape", "unicode"):
            return self._string(ch)
        if token == "literal":
            if ch != self._pending[0]:
                return Step.BAD
            self._pending = self._pending[1:]
            if not self._pending:
                self._token = None
                return self._value_done()
            return Step.MORE
        if token == "number":
            state = _NUMBER_MOVES.get((self._number, _number_class(ch)))
            if state is not None:
                self._number = state
                return Step.MORE
            if self._number not in _NUMBER_ENDS:
                return Step.BAD
            self._token = None
            if self._value_done() is Step.END:
                return Step.END_BEFORE
        return self._structure(ch)

    def complete_at_end(self) -> bool:
        """Whether the value is complete if no character follows (a number may end so)."""
        if self.done:
            return True
        return self._token == "number" and not self._stack and self._number in _NUMBER_ENDS

    # ------------------------------------------------------------------ structure

    def _structure(self, ch: str) -> Step:
        if ch in WHITESPACE:
            return Step.MORE
        expecting = self._stack[-1] if self._stack else None
        if expecting is None or expecting in ("v", "[", "a"):
            if expecting == "[" and ch == "]":
                self._stack.pop()
                return self._value_done()
            return self._value_start(ch)
        if expecting in ("{", "k"):
            if ch == '"':
                self._token = "string"
                return Step.MORE
            if ch == "}" and expecting == "{":
                self._stack.pop()
                return self._value_done()
            return Step.BAD
        if expecting == ":":
            return self._expect(ch == ":", "v")
        if expecting == ",":
            if ch == "}":
                self._stack.pop()
                return self._value_done()
            return self._expect(ch == ",", "k")
        # expecting == "]": after an array's element
        if ch == "]":
            self._stack.pop()
            return self._value_done()
        return self._expect(ch == ",", "a")

    def _expect(self, ok: bool, then: str) -> Step:
        if not ok:
            return Step.BAD
        self._stack[-1] = then
        return Step.MORE

    def _value_start(self, ch: str) -> Step:
        if ch == "{":
            self._stack.append("{")
        elif ch == "[":
            self._stack.append("[")
        elif ch == '"':
            self._token = "string"
        elif ch == "-" or "0" <= ch <= "9":
            self._token = "number"
            self._number = "minus" if ch == "-" else ("zero" if ch == "0" else "int")
        elif ch in _LITERALS:
            self._token, self._pending = "literal", _LITERALS[ch][1:]
        else:
            return Step.BAD
        if not self.first:
            self.first = ch
        return Step.MORE

    def _value_done(self) -> Step:
        """A value (or key) just ended: the container moves on, or the whole value is done."""
        if not self._stack:
            self.done = True
            return Step.END
        expecting = self._stack[-1]
        self._stack[-1] = {"{": ":", "k": ":", "v": ",", "[": "]", "a": "]"}[expecting]
        return Step.MORE

    # ------------------------------------------------------------------ strings

    def _string(self, ch: str) -> Step:
        if self._token == "escape":
            if ch == "u":
                self._token, self._pending = "unicode", ""
                return Step.MORE
            if ch not in _ESCAPES:
                return Step.BAD
            self._token = "string"
            self._decode(_ESCAPES[ch])
            return Step.MORE
        if self._token == "unicode":
            if ch not in _HEX:
                return Step.BAD
            self._pending += ch
            if len(self._pending) == 4:
                self._token = "string"
                self._decode_unit(int(self._pending, 16))
            return Step.MORE
        if ch == '"':
            self._token = None
            self._flush_surrogate()
            return self._value_done()
        if ch == "\\":
            self._token = "escape"
            return Step.MORE
        if ch < " ":
            return Step.BAD
        self._decode(ch)
        return Step.MORE

    def _decode(self, text: str) -> None:
        self._flush_surrogate()
        if not self._stack:
            self._decoded.append(text)

    def _decode_unit(self, unit: int) -> None:
        """A ``\\uXXXX`` escape: a surrogate pair makes one character; a lone half, U+FFFD."""
        if 0xDC00 <= unit <= 0xDFFF and self._high_surrogate is not None:
            high, self._high_surrogate = self._high_surrogate, None
            self._decode(chr(0x10000 + ((high - 0xD800) << 10) + (unit - 0xDC00)))
        elif 0xD800 <= unit <= 0xDBFF:
            self._flush_surrogate()
            self._high_surrogate = unit
        elif 0xDC00 <= unit <= 0xDFFF:
            self._decode(REPLACEMENT)
        else:
            self._decode(chr(unit))

    def _flush_surrogate(self) -> None:
        if self._high_surrogate is not None:
            self._high_surrogate = None
            if not self._stack:
                self._decoded.append(REPLACEMENT)
