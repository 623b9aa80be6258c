"""Log-probabilities out: of sampled tokens (``SamplingParams.logprobs``) and of prompt tokens
(``SamplingParams.prompt_logprobs``), from the float32 logits a step already computes.

Both are the model's own distribution: the log-softmax of the raw logits, before penalties,
bias or temperature (vLLM's default, ``raw_logprobs``). A token's rank counts the tokens at
least as likely as it (1: the most likely). Prompt logprobs need the logits of every prompt
position, which a step computes only for the chunks of requests that ask for them
(:func:`prompt_positions`): the model runner keeps those rows after the sampling rows, and
:func:`record_prompt_logprobs` turns them into entries once the step has succeeded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paged_attention.engine.request import Logprob, Request, TokenLogprobs


def token_logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """One entry per row of ``logprobs`` (``[rows, vocab]`` log-softmax): ``tokens[i]``'s
    log-probability and rank, then row ``i``'s ``num_top[i]`` most likely tokens (ranks 1, 2,
    ...; a token already there keeps its entry)."""
    chosen = logprobs.gather(-1, tokens[:, None])
    ranks = (logprobs >= chosen).sum(-1)
    most = max(num_top, default=0)
    top_values, top_ids = (
        logprobs.topk(most, -1) if most else (chosen[:, :0], tokens[:, None][:, :0])
    )
    entries = []
    rows = zip(
        tokens.tolist(),
        chosen[:, 0].tolist(),
        ranks.tolist(),
        top_values.tolist(),
        top_ids.tolist(),
    )
    for (token, value, rank, values, ids), count in zip(rows, num_top):
        entry = {token: Logprob(value, rank)}
        for place in range(count):
            entry.setdefault(ids[place], Logprob(values[place], place + 1))
        entries.append(entry)
    return entries


def prompt_positions(request: Request, start: int, end: int) -> range:
    """The positions of a chunk computing tokens ``start .. end - 1`` of ``request``'s first
    sequence whose logits give a prompt logprob not recorded yet (the logits at position ``p``
    score prompt token ``p + 1``); empty unless the request asks for prompt logprobs."""
    if request.params.prompt_logprobs is None:
        return range(0)
    recorded = len(request.prompt_logprobs)  # entries for prompt tokens 0 .. recorded - 1
    return range(max(start, recorded - 1), min(end, len(request.prompt) - 1))


def record_prompt_logprobs(chunks: Sequence, logits: torch.Tensor) -> None:
    """Appends to each request the prompt logprobs of this step's ``chunks`` (scheduler chunks,
    in the order the model runner packed them), from the rows of ``logits`` after the sampling
    rows, which the runner kept for :func:`prompt_positions`. Called once the step succeeded."""
    spans = [
        (chunk.request, prompt_positions(chunk.request, chunk.start, chunk.end)) for chunk in chunks
    ]
    spans = [(request, positions) for request, positions in spans if positions]
    if not spans:
        return
    first_row = sum(chunk.num_sample_rows for chunk in chunks)
    targets = [
        t
        for request, positions in spans
        for t in request.prompt[positions.start + 1 : positions.stop + 1]
    ]
    num_top = [request.params.prompt_logprobs for request, positions in spans for _ in positions]
    rows = logits[first_row : first_row + len(targets)].log_softmax(-1)
    entries = token_logprobs(rows, torch.tensor(targets, device=logits.device), num_top)
    for request, positions in spans:
        request.prompt_logprobs += entries[: len(positions)]
        entries = entries[len(positions) :]


def output_logprobs(request: Request, entries: Sequence, new_tokens: list[list[int]]) -> dict:
    """The logprob fields of a :class:`~paged_attention.engine.request.RequestOutput` of
    ``request`` for its sequences ``entries`` (``new_tokens`` per entry)."""
    fields = {}
    if request.params.logprobs is not None:
        lists = [request.logprobs.get(seq.seq_id, []) for seq in entries]
        fields["logprobs"] = [list(values) for values in lists]
        fields["new_logprobs"] = [
            values[len(values) - len(new) :] for values, new in zip(lists, new_tokens)
        ]
    if request.params.prompt_logprobs is not None:
        fields["prompt_logprobs"] = request.prompt_logprobs
    return fields
