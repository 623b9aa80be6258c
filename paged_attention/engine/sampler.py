"""Turning a step's logits into tokens: sampling (greedy, temperature, top-k/top-p/min-p, the
penalties and biases of :mod:`~paged_attention.engine.logits_processors`, the grammars of
:mod:`~paged_attention.engine.structured_output`) and the beam search rule. Pure functions of
float32 logits (on the model's device) and each request's own generator: every control is row
by row, so a request's tokens depend only on its own logits, tokens and seed, never on the
batch around it."""

from __future__ import annotations

from collections.abc import Collection

import torch

from paged_attention.engine.logits_processors import RowState, StepControls, sampling_probabilities
from paged_attention.engine.logprobs import token_logprobs
from paged_attention.engine.request import Drawn, Request
from paged_attention.engine.structured_output import apply_grammars


def draw(
    logits: torch.Tensor,
    groups: list[tuple[Request, list[int]]],
    end_tokens: Collection[int] = frozenset(),
) -> list[Drawn]:
    """The next token of every live sequence of each ``(request, its rows of logits)`` (no beam
    search): a request's first step has one prompt row, from which its ``n`` samples all draw.
    A row whose request has a grammar (``structured_output``) is first masked to the tokens
    its sequence's matcher allows (one bitmask for the step). The controls apply to all rows
    at once; greedy rows are decided by one ``argmax``, sampled
    ones per request with its own generator. ``end_tokens``: the engine's end-of-sequence ids
    (``min_tokens`` masks them). Only token ids (and requested logprobs) leave the device."""
    rows: list[int] = []
    states: list[RowState] = []
    spans: list[range] = []  # each group's rows of ``rows``
    grammar_rows: list[tuple[int, object]] = []  # (row, its sequence's grammar matcher)
    for request, request_rows in groups:
        first = len(request.seqs) == 1 and not request.seqs[0].tokens
        seqs = request.seqs
        if first and request.params.n > 1:
            request_rows, seqs = request_rows * request.params.n, seqs * request.params.n
        spans.append(range(len(rows), len(rows) + len(request_rows)))
        rows += request_rows
        if request.grammar is not None:
            grammar_rows += [
                (len(states) + i, request.grammar.matcher(seq.seq_id, seq.tokens, end_tokens))
                for i, seq in enumerate(seqs)
            ]
        states += [RowState(request.params, request.prompt, seq.tokens) for seq in seqs]
    controls = StepControls(states, end_tokens, logits.shape[-1], logits.device)
    # A copy where the controls or grammars change the logits in place (or rows repeat or
    # reorder).
    whole = not controls.active and not grammar_rows and rows == list(range(len(logits)))
    selected = logits if whole else logits[rows]
    want_logprobs = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    raw = _rows(selected, want_logprobs).log_softmax(-1) if want_logprobs else None
    if grammar_rows:
        apply_grammars(selected, grammar_rows)
    controls.apply(selected)
    tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    greedy = [i for i, s in enumerate(states) if s.params.is_greedy]
    if greedy:
        tokens[greedy] = _rows(selected, greedy).argmax(-1)
    sampled = [i for i, s in enumerate(states) if not s.params.is_greedy]
    if sampled:
        sampled_params = [states[i].params for i in sampled]
        probs = sampling_probabilities(_rows(selected, sampled), sampled_params)
        place = {row: i for i, row in enumerate(sampled)}
        for (request, _), span in zip(groups, spans):
            if not request.params.is_greedy:
                mine = [place[row] for row in span]
                drawn = torch.multinomial(probs[mine], 1, generator=request.generator)
                tokens[list(span)] = drawn[:, 0]
    entries = None
    if raw is not None:
        counts = [states[i].params.logprobs for i in want_logprobs]
        listed = token_logprobs(raw, tokens[want_logprobs], counts)
        entries = dict(zip(want_logprobs, listed))
    chosen = tokens.tolist()
    return [
        Drawn(
            [chosen[i] for i in span],
            None if request.params.logprobs is None else [entries[i] for i in span],
        )
        for (request, _), span in zip(groups, spans)
    ]


def _rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``tensor[rows]``, without a copy when ``rows`` are all its rows in order."""
    return tensor if rows == list(range(len(tensor))) else tensor[rows]


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
