"""Text out: the text of each generated sequence, built token by token, and its stop strings.

The ids become text through the tokenizer library's own streaming decoder
(``tokenizers.decoders.DecodeStream``), which waits for the tokens that complete a multi-byte
character and yields each piece once: the text of a sequence is always the decoding of its ids
(special tokens skipped), never re-decoded from the start.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


def backend_of(tokenizer):
    """The ``tokenizers.Tokenizer`` behind a transformers tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            "tokenizer must be a transformers tokenizer backed by the tokenizers library (what "
            f"AutoTokenizer gives), got {type(tokenizer).__name__}"
        )
    return backend


class IncrementalDetokenizer:
    """One sequence's text. ``append(token)`` adds a token and says whether one of ``stop``
    completed (the text then ends just before it); ``append(token, match_stop=False)`` (a token
    before a request's ``min_tokens`` are generated) adds its text without looking for stop
    strings, so a later match can begin in that text but not end in it. ``take_new(final)``
    returns the text not handed out yet, holding back the last characters that could still be
    the start of a stop string unless ``final``. A final call also hands out what the streaming
    decoder still holds (bytes of an unfinished character, which a whole decode renders as
    U+FFFD), so that a finished sequence's text is the decoding of its ids, cut before a stop
    string that the U+FFFD completes."""

    def __init__(self, backend, stop: tuple[str, ...] = ()) -> None:
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = stop
        # A stop string can begin at most this many characters before the newest piece.
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._ids: list[int] = []
        self._handed_out = 0
        self.stopped = False

    def append(self, token: int, match_stop: bool = True) -> bool:
        if self.stopped:
            raise ValueError("the sequence already ended at a stop string")
        self._ids.append(token)
        piece = self._stream.step(self._backend, token)
        if not piece:
            return False
        search_from = max(0, len(self.text) - self._hold)
        self.text += piece
        if not match_stop:
            return False
        return self._cut_at_stop(search_from)

    def _cut_at_stop(self, search_from: int) -> bool:
        """End the text before the first stop string found from ``search_from``."""
        found = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.stopped = True
        return self.stopped

    def take_new(self, final: bool) -> str:
        if final and not self.stopped:
            whole = self._backend.decode(self._ids, skip_special_tokens=True)
            if whole.startswith(self.text):
                # The decoder's held bytes now show as U+FFFD, which a stop string may hold:
                # it never survives into a finished text (``stopped`` then says so).
                search_from = max(0, len(self.text) - self._hold)
                self.text = whole
                self._cut_at_stop(search_from)
        end = len(self.text) if final or self.stopped else max(0, len(self.text) - self._hold)
        end = max(end, self._handed_out)
        new, self._handed_out = self.text[self._handed_out : end], end
        return new

    @property
    def handed_out(self) -> str:
        return self.text[: self._handed_out]
