"""Turning a request's logits into tokens: sampling (greedy, temperature, top-p) and the beam
search rule. Pure functions of float32 logits (on the model's device) and the request's own
generator, so a request's tokens depend only on its own logits and seed, never on the batch
around it."""

from __future__ import annotations

from collections.abc import Collection

import torch

from paged_attention.engine.request import Request, SamplingParams


def draw(logits: torch.Tensor, groups: list[tuple[Request, list[int]]]) -> list[list[int]]:
    """The next token of every live sequence of each ``(request, its rows of logits)`` (no beam
    search): a request's first step has one prompt row, from which its ``n`` samples all draw.
    Greedy rows of every request are decided by one ``argmax``; sampled ones per request, with
    its own generator. Only token ids leave the device."""
    expanded = []
    for request, rows in groups:
        n = request.params.n
        first = len(request.seqs) == 1 and not request.seqs[0].tokens
        expanded.append(rows * n if first and n > 1 else rows)
    greedy = [i for i, (request, _) in enumerate(groups) if request.params.is_greedy]
    tokens: list[list[int] | None] = [None] * len(groups)
    if greedy:
        flat = logits[[row for i in greedy for row in expanded[i]]].argmax(-1).tolist()
        for i in greedy:
            tokens[i], flat = flat[: len(expanded[i])], flat[len(expanded[i]) :]
    for i, (request, _) in enumerate(groups):
        if tokens[i] is None:
            tokens[i] = sample(logits[expanded[i]], request.params, request.generator)
    return tokens


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> list[int]:
    """One token per row of ``logits``."""
    if params.is_greedy:
        return logits.argmax(-1).tolist()
    probs = (logits / params.temperature).softmax(-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p, and always the most likely token
        # (a top_p that rounds to 0 in float32 would otherwise mask every token).
        outside = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        outside[..., 0] = False
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
    total = torch.tensor(scores, device=logits.device)[:, None] + logits.log_softmax(-1)
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
