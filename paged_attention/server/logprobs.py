"""The engine's log-probabilities in OpenAI's shapes: chat's ``logprobs.content[]`` entries
(``token``, ``logprob``, ``bytes``, ``top_logprobs``) and the legacy completions' ``logprobs``
(``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``).

A token is shown as its own decoded text (``tokenizer.decode([id])``, as vLLM does: a piece of a
multi-byte character shows as U+FFFD); ``bytes`` are the token's raw bytes for a byte-level BPE
tokenizer (GPT-2's byte alphabet undone), else the UTF-8 of that text. JSON has no infinity: a
log-probability of ``-inf`` is sent as -9999.0 (OpenAI's and vLLM's floor).
"""

from __future__ import annotations

from collections.abc import Sequence

from paged_attention.engine.request import TokenLogprobs

LOGPROB_FLOOR = -9999.0


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the character that stands for each byte -> the
    byte (printable bytes stand for themselves, the others for 256 + their order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            alphabet[chr(256 + shifted)] = b
            shifted += 1
    return alphabet


class TokenPieces:
    """Each token's text and bytes for ``tokenizer``, decoded once and kept."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._alphabet = _byte_alphabet() if _is_byte_level(tokenizer) else None

    def text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token])
        return text

    def bytes(self, token: int) -> list[int]:
        raw = self._bytes.get(token)
        if raw is None:
            raw = self._bytes[token] = self._raw_bytes(token)
        return raw

    def _raw_bytes(self, token: int) -> list[int]:
        if self._alphabet is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token)
            if piece is not None and all(c in self._alphabet for c in piece):
                return [self._alphabet[c] for c in piece]
        return list(self.text(token).encode("utf-8"))


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


def _value(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def _by_rank(entry: TokenLogprobs) -> list[tuple[int, float, int]]:
    """``(token, logprob, rank)`` of an entry's tokens, the most likely first."""
    items = [(token, lp.logprob, lp.rank) for token, lp in entry.items()]
    return sorted(items, key=lambda item: (item[2], -item[1]))


def chat_content(
    pieces: TokenPieces, tokens: Sequence[int], entries: Sequence[TokenLogprobs], top: int
) -> list[dict]:
    """Chat's ``logprobs.content`` for ``tokens`` (one engine entry each): every token with
    its ``top`` most likely alternatives (it is among them when it ranks)."""
    content = []
    for token, entry in zip(tokens, entries):
        alternatives = [
            {"token": pieces.text(t), "logprob": _value(lp), "bytes": pieces.bytes(t)}
            for t, lp, rank in _by_rank(entry)
            if rank <= top
        ][:top]
        content.append(
            {
                "token": pieces.text(token),
                "logprob": _value(entry[token].logprob),
                "bytes": pieces.bytes(token),
                "top_logprobs": alternatives,
            }
        )
    return content


class CompletionLogprobs:
    """One completion choice's legacy ``logprobs``, built piece by piece (a stream sends each
    piece in its chunk): ``text_offset`` counts the characters of the choice's text before
    each token, from the start of the choice (the echoed prompt included)."""

    def __init__(self, pieces: TokenPieces) -> None:
        self.pieces = pieces
        self.offset = 0

    def piece(
        self, tokens: Sequence[int], entries: Sequence[TokenLogprobs | None]
    ) -> dict[str, list]:
        """``tokens`` with their entries (None: no logprob, the prompt's first token): the
        token's logprob, and the token with the most likely alternatives as
        ``{text: logprob}`` (two tokens of the same text: the likelier one)."""
        shown: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for token, entry in zip(tokens, entries):
            text = self.pieces.text(token)
            shown["tokens"].append(text)
            shown["text_offset"].append(self.offset)
            self.offset += len(text)
            if entry is None:
                shown["token_logprobs"].append(None)
                shown["top_logprobs"].append(None)
                continue
            shown["token_logprobs"].append(_value(entry[token].logprob))
            top: dict[str, float] = {}
            for t, lp, _rank in _by_rank(entry):
                top.setdefault(self.pieces.text(t), _value(lp))
            shown["top_logprobs"].append(top)
        return shown


def joined(parts: Sequence[dict[str, list]]) -> dict[str, list]:
    """Pieces of one choice's legacy logprobs as one."""
    return {key: [v for part in parts for v in part[key]] for key in parts[0]}
