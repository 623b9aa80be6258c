"""Turning a request's logits into tokens: sampling (greedy, temperature, top-p) and the beam
search rule. Pure functions of float32 CPU logits and the request's own generator, so a
request's tokens depend only on its own logits and seed, never on the batch around it."""

from __future__ import annotations

from collections.abc import Collection

import torch

from paged_attention.engine.request import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> list[int]:
    """One token per row of ``logits``."""
    if params.temperature == 0:
        return logits.argmax(-1).tolist()
    probs = (logits / params.temperature).softmax(-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always the most likely token).
        outside = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs[outside] = 0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[:, 0].tolist()


def beam_candidates(
    logits: torch.Tensor, scores: list[float], width: int, end_tokens: Collection[int]
) -> tuple[list[tuple[int, int, float]], list[tuple[int, int, float]]]:
    """The next step of beam search over beams with cumulative log-probabilities ``scores``
    (one row of ``logits`` each): of the ``2 * width`` best continuations, those ending in an
    end token that rank among the best ``width`` become finished hypotheses, and the best
    ``width`` others continue. Returns ``(continuing, finished)`` as ``(beam index, token,
    score)`` triples, best first."""
    total = torch.tensor(scores)[:, None] + logits.log_softmax(-1)
    top_scores, top = total.flatten().topk(min(2 * width, total.numel()))
    vocab = logits.shape[-1]
    continuing, finished = [], []
    for rank, (score, index) in enumerate(zip(top_scores.tolist(), top.tolist())):
        beam, token = divmod(index, vocab)
        if token in end_tokens:
            if rank < width:
                finished.append((beam, token, score))
        elif len(continuing) < width:
            continuing.append((beam, token, score))
    return continuing, finished
