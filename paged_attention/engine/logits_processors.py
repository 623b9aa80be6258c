"""The sampling controls of one step as tensors, applied to all its rows of float32 logits at
once (vLLM's order and meaning):

1. before any choice, greedy ones included: ``min_tokens`` masks the end tokens, then
   ``logit_bias`` is added, then the repetition, frequency and presence penalties apply;
2. for sampled rows: temperature, then ``min_p``, ``top_k``, and ``top_p`` on the resulting
   probabilities.

:class:`StepControls` gathers, once per step, the parameters of every row that uses a control
into per-row tensors (and the token counts the penalties need), so that each control is a few
tensor operations over the whole batch, never a Python loop over the vocabulary.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from paged_attention.engine.request import SamplingParams

NEG_INF = float("-inf")


class RowState:
    """What one row of logits is sampled for: its request's parameters, prompt and the tokens
    its sequence generated so far."""

    __slots__ = ("params", "prompt", "output")

    def __init__(self, params: SamplingParams, prompt: list[int], output: list[int]) -> None:
        self.params = params
        self.prompt = prompt
        self.output = output


def _scatter_index(
    token_lists: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row, token)`` index tensors of every token of ``token_lists[row]``."""
    rows = [row for row, tokens in enumerate(token_lists) for _ in tokens]
    tokens = [token for tokens in token_lists for token in tokens]
    return (
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(tokens, dtype=torch.long, device=device),
    )


def apply_min_tokens(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
    """Masks ``logits[rows[i], tokens[i]]`` (in place)."""
    logits.index_put_((rows, tokens), torch.tensor(NEG_INF, device=logits.device))


def apply_logit_bias(
    logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, bias: torch.Tensor
) -> None:
    """Adds ``bias[i]`` to ``logits[rows[i], tokens[i]]`` (in place)."""
    logits.index_put_((rows, tokens), bias, accumulate=True)


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """The penalized ``logits`` (rows of ``[R, vocab]``): a token of the prompt
    (``prompt_mask``) or of the output (``output_counts > 0``) has a positive logit divided by
    ``repetition``, a negative one multiplied by it; then ``frequency`` times its count in the
    output and ``presence`` once if it occurs there are subtracted (per-row ``[R]`` tensors)."""
    in_output = output_counts > 0
    penalty = repetition[:, None]
    repeated = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = torch.where(prompt_mask | in_output, repeated, logits)
    return logits - frequency[:, None] * output_counts - presence[:, None] * in_output


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Masks (in place) the tokens of each row less likely than ``min_p`` times its most
    likely one."""
    probs = logits.softmax(-1)
    threshold = probs.amax(-1, keepdim=True) * min_p[:, None]
    logits.masked_fill_(probs < threshold, NEG_INF)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> None:
    """Masks (in place) every token of a row below its ``top_k``-th largest logit (ties with it
    stay); ``top_k`` per row, between 1 and the vocabulary size."""
    largest = logits.topk(int(top_k.max()), -1).values
    kth = largest.gather(-1, (top_k - 1)[:, None])
    logits.masked_fill_(logits < kth, NEG_INF)


def apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, keeps the smallest set of most likely tokens whose probability reaches
    ``top_p`` (always the most likely one: a ``top_p`` that rounds to 0 in float32 would
    otherwise mask every token); the others get probability 0."""
    sorted_probs, order = probs.sort(-1, descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p[:, None]
    outside[:, 0] = False
    sorted_probs[outside] = 0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


class StepControls:
    """The controls of one step's rows (``states[i]`` describes row ``i`` of the logits) as
    tensors on ``device``; a control no row uses costs nothing. ``end_tokens``: the engine's
    end-of-sequence ids, which ``min_tokens`` masks unless a request ignores them."""

    def __init__(
        self,
        states: Sequence[RowState],
        end_tokens: Collection[int],
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.min_tokens = self._min_tokens(states, end_tokens)
        biased = [(i, s.params.logit_bias) for i, s in enumerate(states) if s.params.logit_bias]
        self.logit_bias = None
        if biased:
            rows, tokens = _scatter_index([list(b) for _, b in biased], device)
            rows = torch.tensor([i for i, _ in biased], device=device)[rows]
            values = [v for _, b in biased for v in b.values()]
            self.logit_bias = rows, tokens, torch.tensor(values, device=device)
        self.penalties = self._penalties(states)

    def _min_tokens(self, states, end_tokens) -> tuple[torch.Tensor, torch.Tensor] | None:
        masked_rows, masked = [], []
        for i, state in enumerate(states):
            params = state.params
            if len(state.output) < params.min_tokens:
                ends = set(params.stop_token_ids)
                if not params.ignore_eos:
                    ends |= set(end_tokens)
                masked_rows.append(i)
                masked.append(sorted(t for t in ends if t < self.vocab_size))
        if not masked_rows:
            return None
        rows, tokens = _scatter_index(masked, self.device)
        return torch.tensor(masked_rows, device=self.device)[rows], tokens

    def _penalties(self, states) -> tuple | None:
        rows = [i for i, s in enumerate(states) if s.params.has_penalties]
        if not rows:
            return None
        device, shape = self.device, (len(rows), self.vocab_size)
        prompt_mask = torch.zeros(shape, dtype=torch.bool, device=device)
        prompt_mask[_scatter_index([states[i].prompt for i in rows], device)] = True
        counts = torch.zeros(shape, dtype=torch.float32, device=device)
        index = _scatter_index([states[i].output for i in rows], device)
        counts.index_put_(index, torch.ones(len(index[0]), device=device), accumulate=True)

        def per_row(name: str) -> torch.Tensor:
            values = [getattr(states[i].params, name) for i in rows]
            return torch.tensor(values, dtype=torch.float32, device=device)

        return (
            torch.tensor(rows, device=device),
            prompt_mask,
            counts,
            per_row("presence_penalty"),
            per_row("frequency_penalty"),
            per_row("repetition_penalty"),
        )

    @property
    def active(self) -> bool:
        """Whether any row uses a control that changes its logits before the choice."""
        return any(c is not None for c in (self.min_tokens, self.logit_bias, self.penalties))

    def apply(self, logits: torch.Tensor) -> None:
        """The controls that apply to every row, greedy or sampled, in place: ``min_tokens``,
        ``logit_bias``, then the penalties."""
        if self.min_tokens is not None:
            apply_min_tokens(logits, *self.min_tokens)
        if self.logit_bias is not None:
            apply_logit_bias(logits, *self.logit_bias)
        if self.penalties is not None:
            rows, *penalties = self.penalties
            logits[rows] = apply_penalties(logits[rows], *penalties)


def sampling_probabilities(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distributions the sampled rows draw from (``params[i]`` for row ``i`` of
    ``logits``): temperature, then ``min_p`` and ``top_k`` on the logits, then softmax and
    ``top_p``. ``logits`` is not modified."""
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], device=device)
    # Overflow (a large logit divided by a small temperature) must not become NaN in softmax.
    largest = torch.finfo(logits.dtype).max
    scaled = (logits / temperature[:, None]).nan_to_num_(posinf=largest, neginf=NEG_INF)

    def rows_where(test) -> list[int]:
        return [i for i, p in enumerate(params) if test(p)]

    def restrict(rows, apply, values) -> None:
        if rows:
            index = torch.tensor(rows, device=device)
            part = scaled[index]
            apply(part, torch.tensor(values, device=device))
            scaled[index] = part

    with_min_p = rows_where(lambda p: p.min_p > 0)
    restrict(with_min_p, apply_min_p, [params[i].min_p for i in with_min_p])
    with_top_k = rows_where(lambda p: 0 < p.top_k < vocab)
    restrict(with_top_k, apply_top_k, [params[i].top_k for i in with_top_k])
    probs = scaled.softmax(-1)
    with_top_p = rows_where(lambda p: p.top_p < 1)
    if with_top_p:
        index = torch.tensor(with_top_p, device=device)
        top_p = torch.tensor([params[i].top_p for i in with_top_p], device=device)
        probs[index] = apply_top_p(probs[index], top_p)
    return probs
