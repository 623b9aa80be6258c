"""What the engine serves: sampling parameters, requests and their sequences, and the outputs a
step reports."""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field

import torch

from paged_attention.engine.detokenizer import IncrementalDetokenizer


class RequestError(ValueError):
    """A request the engine refuses. ``argument`` names what is at fault: ``"prompt"``,
    ``"params"``, or a :class:`SamplingParams` field; ``limit`` is ``"context"`` when the request
    needs more positions than the model's context, ``"kv_cache"`` when more KV blocks than the
    whole pool, else ``None``."""

    def __init__(self, message: str, argument: str, limit: str | None = None) -> None:
        super().__init__(message)
        self.argument = argument
        self.limit = limit


def _check_int(name: str, value, minimum: int | None = None, argument: str | None = None) -> None:
    argument = argument or name
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise RequestError(f"{name} must be an integer, got {value!r}", argument)
    if minimum is not None and value < minimum:
        raise RequestError(f"{name} must be >= {minimum}, got {value}", argument)


def _check_real(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value!r}", name)


# A temperature below this samples as greedy decoding: dividing float32 logits by it would
# overflow them (vLLM's sampler uses the same threshold).
GREEDY_TEMPERATURE = 1e-5
# torch.Generator.manual_seed takes a seed that fits in 64 bits, signed or unsigned.
SEED_RANGE = (-(2**63), 2**64 - 1)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    ``temperature`` 0 is greedy (so is any temperature below 1e-5); ``top_p`` keeps the smallest
    set of most likely tokens whose probability reaches it (always at least the most likely
    one); ``n`` parallel samples share the prompt's blocks; ``beam_width > 1`` is beam search
    (deterministic: ``n = 1`` and ``temperature = 0``); ``seed`` (64 bits, signed or unsigned)
    seeds the request's own generator. A sequence ends at an end-of-sequence token of the engine
    (``"eos"``), at one of ``stop_token_ids`` (``"stop"``; the token is kept, as the EOS token
    is), at one of the ``stop`` strings (``"stop"``; needs an engine with a tokenizer; the text
    ends before the string, the token ids keep the token that completed it), or after
    ``max_new_tokens`` (``"length"``).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    n: int = 1
    beam_width: int = 1
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, 1)
        _check_int("n", self.n, 1)
        _check_int("beam_width", self.beam_width, 1)
        _check_int("seed", self.seed)
        if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise RequestError(
                f"seed must fit in 64 bits (between -2**63 and 2**64 - 1), got {self.seed}", "seed"
            )
        _check_real("temperature", self.temperature)
        _check_real("top_p", self.top_p)
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.beam_width > 1 and (self.n > 1 or self.temperature > 0):
            raise RequestError(
                "beam search (beam_width > 1) needs n = 1 and temperature = 0", "beam_width"
            )
        stop = tuple(self.stop_token_ids)
        for token in stop:
            _check_int("stop_token_ids entries", token, 0, "stop_token_ids")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))
        strings = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        for string in strings:
            if not isinstance(string, str) or not string:
                raise RequestError(
                    f"stop entries must be non-empty strings, got {string!r}", "stop"
                )
        if strings and self.beam_width > 1:
            raise RequestError(
                "stop strings are not supported with beam search (beam_width > 1)", "stop"
            )
        object.__setattr__(self, "stop", strings)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def num_seqs(self) -> int:
        """Sequences the request runs at once."""
        return max(self.n, self.beam_width)

    @property
    def is_beam_search(self) -> bool:
        return self.beam_width > 1


@dataclass
class RequestMetrics:
    """Timestamps (``time.perf_counter()`` seconds) and step numbers of one request."""

    arrival_time: float
    first_scheduled_step: int | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per step that added tokens
    finished_time: float | None = None
    finished_step: int | None = None
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache
    num_computed_prompt_tokens: int = 0  # prompt tokens fed to the model (recomputation included)

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        """Seconds between consecutive steps that gave this request tokens."""
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:])]


@dataclass
class RequestOutput:
    """A request's state after a step (``Engine.step``/``stream``) or at its end (``generate``).

    ``outputs`` holds every token so far per sample (in sample order) or per beam (best first:
    for beam search, beams are reordered as they compete, so a stream reader should read
    ``outputs``); ``new_tokens`` the tokens added by this step, per entry of ``outputs``.
    ``finish_reasons`` per entry: ``"eos"``, ``"stop"``, ``"length"``, ``"abort"``, or ``None``
    while it runs. ``rejected`` says why a request was not served (its outputs stay empty).

    With an engine that has a tokenizer, ``texts`` holds each entry's text so far and
    ``new_texts`` what this output adds to it (the pieces of a stream add up to the final text);
    while a stop string could still be forming, its first characters are held back. ``text``
    is the first entry's text.
    """

    request_id: int
    prompt: list[int]
    outputs: list[list[int]]
    finish_reasons: list[str | None]
    new_tokens: list[list[int]] = field(default_factory=list)
    finished: bool = False
    rejected: str | None = None
    metrics: RequestMetrics | None = None
    texts: list[str] | None = None
    new_texts: list[str] | None = None

    @property
    def text(self) -> str | None:
        return self.texts[0] if self.texts else None


class RequestStatus(enum.Enum):
    WAITING = enum.auto()  # not admitted yet, or preempted to be recomputed
    RUNNING = enum.auto()
    SWAPPED = enum.auto()  # preempted to host memory
    FINISHED = enum.auto()


@dataclass
class Sequence:
    """One sample or beam: the tokens it generated and how many of its tokens (prompt, then
    generated) the KV cache holds. The last generated token is fed by the next step."""

    seq_id: int
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    score: float = 0.0  # beam search: sum of log-probabilities
    finish_reason: str | None = None


@dataclass
class Request:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    metrics: RequestMetrics
    status: RequestStatus = RequestStatus.WAITING
    seqs: list[Sequence] = field(default_factory=list)  # live sequences
    done: list[Sequence] = field(default_factory=list)  # finished samples or beam hypotheses
    new_tokens: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> this step's
    # seq_id -> the sample's text (with a tokenizer; beams decode their tokens whole instead)
    detokenizers: dict[int, IncrementalDetokenizer] = field(default_factory=dict)

    def num_tokens(self, seq: Sequence) -> int:
        """Prompt and generated tokens of ``seq``."""
        return len(self.prompt) + len(seq.tokens)

    def token_slice(self, seq: Sequence, start: int, stop: int) -> list[int]:
        """Tokens ``start .. stop - 1`` of ``seq``'s prompt-then-generated sequence."""
        prompt = len(self.prompt)
        if stop <= prompt:
            return self.prompt[start:stop]
        if start >= prompt:
            return seq.tokens[start - prompt : stop - prompt]
        return self.prompt[start:] + seq.tokens[: stop - prompt]

    def prefill_target(self, seq: Sequence) -> int:
        """How many tokens of ``seq`` a prefill computes. A lone sequence computes them all and
        samples from the last one in the same step; the sequences of a recomputed request with
        several stop one short, so that all of them sample together in a decode step (a
        request's random draws happen together, in sequence order)."""
        total = self.num_tokens(seq)
        return total if len(self.seqs) == 1 else total - 1

    @property
    def seats(self) -> int:
        """Sequences the request runs at once: all its samples or beams from the start (they
        fork from the prompt once it is computed), its live ones later."""
        return len(self.seqs) if any(s.tokens for s in self.seqs) else self.params.num_seqs

    @property
    def is_decoding(self) -> bool:
        """Every live sequence has exactly its last token left to compute."""
        return bool(self.seqs) and all(
            self.num_tokens(s) - s.num_computed == 1 and s.tokens for s in self.seqs
        )
