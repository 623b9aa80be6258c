"""What the engine serves: sampling parameters, requests and their sequences, and the outputs a
step reports."""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from paged_attention.engine.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from paged_attention.engine.structured_output import RequestGrammar, StructuredOutputParams


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


def _check_real(name: str, value, argument: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value!r}", argument or name)


# A temperature below this samples as greedy decoding: dividing float32 logits by it would
# overflow them (vLLM's sampler uses the same threshold).
GREEDY_TEMPERATURE = 1e-5
# torch.Generator.manual_seed takes a seed that fits in 64 bits, signed or unsigned.
SEED_RANGE = (-(2**63), 2**64 - 1)


# The most alternatives ``logprobs`` and ``prompt_logprobs`` may ask for (vLLM's default cap).
MAX_LOGPROBS = 20
# The values at which each sampling control is off (the controls beam search refuses).
_CONTROLS_OFF = {
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": None,
    "ignore_eos": False,
    "min_tokens": 0,
    "logprobs": None,
}


def _logit_bias(bias) -> dict[int, float] | None:
    """``bias`` checked and copied: a mapping of token ids to biases in [-100, 100], or None."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise RequestError(
            f"logit_bias must be a dict of token ids to biases, got {type(bias).__name__}",
            "logit_bias",
        )
    checked = {}
    for token, value in bias.items():
        _check_int("logit_bias token ids", token, 0, "logit_bias")
        _check_real("logit_bias values", value, "logit_bias")
        if not -100 <= value <= 100:
            raise RequestError(
                f"logit_bias values must be in [-100, 100], got {value}", "logit_bias"
            )
        checked[int(token)] = float(value)
    return checked or None


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

    Sampling controls (vLLM's names and meaning; docs/engine.md, "Sampling controls"): ``top_k``
    keeps the ``k`` most likely tokens (0 or -1: all); ``min_p`` drops tokens less likely than
    ``min_p`` times the most likely one; ``presence_penalty`` and ``frequency_penalty`` (each in
    [-2, 2]) subtract from the logit of every token generated so far, once and per occurrence;
    ``repetition_penalty`` (> 0, 1 is off) divides the positive logits, and multiplies the
    negative ones, of every token of the prompt and the output; ``logit_bias`` adds ``{token id:
    bias in [-100, 100]}`` to the logits (ids checked against the vocabulary when the request is
    added); ``ignore_eos`` keeps generating past the engine's end-of-sequence tokens;
    ``min_tokens`` (at most ``max_new_tokens``) masks those tokens and ``stop_token_ids``, and
    ignores ``stop`` strings, until that many tokens are generated. Penalties, bias and
    ``min_tokens`` apply to greedy requests too; none of the controls applies to beam search.

    ``logprobs`` (``None`` or 0 to 20): each generated token's log-probability and rank, plus the
    ``logprobs`` most likely alternatives; ``prompt_logprobs`` (``None`` or 0 to 20): the same for
    every prompt token after the first (such a request computes its whole prompt: the prefix
    cache is not read for it). Both come from the model's float32 log-softmax, before any control
    or temperature (vLLM's ``raw_logprobs``). ``logprobs`` is refused with beam search.

    ``structured_output`` (:class:`~paged_attention.engine.structured_output.
    StructuredOutputParams`: a JSON schema, any JSON object, an EBNF grammar, a regex or a
    structural tag) masks, at every step, the tokens its grammar does not allow next (after
    the raw logprobs, before every other control); the sequence ends as ``"eos"`` once the
    grammar is complete. Compiled when the request is added (an engine with a tokenizer; a
    grammar that does not compile is refused there); refused with beam search, ``min_tokens``
    and ``ignore_eos``.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    n: int = 1
    beam_width: int = 1
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: StructuredOutputParams | None = None

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
        self._check_controls()
        self._check_logprobs()
        self._check_structured_output()

    def _check_controls(self) -> None:
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise RequestError(
                f"top_k must be -1, 0 (off) or at least 1, got {self.top_k}", "top_k"
            )
        for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            _check_real(name, getattr(self, name))
        if not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise RequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if self.repetition_penalty <= 0:
            raise RequestError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
                "repetition_penalty",
            )
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(
                f"ignore_eos must be True or False, got {self.ignore_eos!r}", "ignore_eos"
            )
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_new_tokens:
            raise RequestError(
                f"min_tokens ({self.min_tokens}) must be at most max_new_tokens "
                f"({self.max_new_tokens})",
                "min_tokens",
            )
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.beam_width > 1:
            used = [name for name, off in _CONTROLS_OFF.items() if getattr(self, name) != off]
            if used:
                raise RequestError(
                    f"{used[0]} is not supported with beam search (beam_width > 1)", used[0]
                )

    def _check_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0)
                if value > MAX_LOGPROBS:
                    raise RequestError(
                        f"{name} must be None or at most {MAX_LOGPROBS}, got {value}", name
                    )
                object.__setattr__(self, name, int(value))

    def _check_structured_output(self) -> None:
        from paged_attention.engine.structured_output import StructuredOutputParams

        if self.structured_output is None:
            return
        if not isinstance(self.structured_output, StructuredOutputParams):
            raise RequestError(
                "structured_output must be StructuredOutputParams, got "
                f"{type(self.structured_output).__name__}",
                "structured_output",
            )
        # A grammar whose end allows only the end-of-sequence tokens conflicts with both.
        for name, off in (("beam_width", 1), ("min_tokens", 0), ("ignore_eos", False)):
            if getattr(self, name) != off:
                raise RequestError(
                    f"{name} is not supported with structured_output (the grammar decides "
                    "where the output ends)",
                    name,
                )

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raises RequestError if a ``logit_bias`` token id is outside ``[0, vocab_size)``."""
        outside = [t for t in self.logit_bias or () if t >= vocab_size]
        if outside:
            raise RequestError(
                f"logit_bias token {outside[0]} is outside the model's vocabulary [0, "
                f"{vocab_size})",
                "logit_bias",
            )

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether the request may skip prompt tokens the prefix cache holds (not with
        ``prompt_logprobs``, which needs the logits of every prompt position)."""
        return self.prompt_logprobs is None

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

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


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability under the model (float32 log-softmax of its raw logits) and
    its rank among the vocabulary (1: the most likely; tokens as likely as it count ahead of
    it, as in vLLM)."""

    logprob: float
    rank: int


TokenLogprobs = dict[int, Logprob]


@dataclass
class Drawn:
    """A request's tokens of one step, one per live sequence (per sample at its first step),
    and with ``SamplingParams.logprobs`` one entry of log-probabilities per token."""

    tokens: list[int]
    logprobs: list[TokenLogprobs] | None = None


"""The log-probabilities at one position: the chosen (or prompt) token first, then the
requested most likely alternatives, by token id."""


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

    With ``SamplingParams.logprobs``: ``logprobs`` holds, per entry of ``outputs``, one
    :data:`TokenLogprobs` per token, and ``new_logprobs`` those of ``new_tokens`` (each token's
    log-probabilities are in exactly one output's ``new_logprobs`` of a stream). With
    ``SamplingParams.prompt_logprobs``: ``prompt_logprobs`` holds one per prompt token, ``None``
    for the first (it is complete from the first output that has tokens). Otherwise these are
    ``None``.
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
    logprobs: list[list[TokenLogprobs]] | None = None
    new_logprobs: list[list[TokenLogprobs]] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

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
    # With SamplingParams.logprobs: seq_id -> one entry per generated token.
    logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    # With SamplingParams.prompt_logprobs: the entries recorded so far (None for the first token).
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=lambda: [None])
    # With SamplingParams.structured_output: the compiled grammar and its sequences' matchers.
    grammar: RequestGrammar | None = None

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
