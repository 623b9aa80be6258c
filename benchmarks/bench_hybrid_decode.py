"""Decode speed of a hybrid model in the Engine: a step's decodes in one batched pass against
one pass per sequence (what the hybrid runner did before it batched them), in one run.

Tiny random hybrid models built from transformers' own config classes (the sizes of
tests/test_model_zoo.py: two layers of width 128, one of them full attention), eight requests at
once (prompts of 9 to 30 tokens, 48 greedy new tokens each), float32 on the CPU. Decode tokens
per second: the tokens of the steps in which every request decodes, over those steps' time.
The two modes alternate, ``--rounds`` times each, and must give the same tokens.

    python benchmarks/bench_hybrid_decode.py [--models lfm2,qwen3_next,granitemoehybrid]
        [--requests 8] [--new-tokens 48] [--rounds 3] [--threads 1] [--json PATH]

``--json`` also writes every round's speeds, the settings and the machine's load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from paged_attention.engine import Engine, SamplingParams
from paged_attention.engine.hybrid_runner import HybridRunner

TINY = dict(
    vocab_size=128,
    hidden_size=128,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    initializer_range=0.1,
)
FAMILY = {
    "lfm2": dict(full_attn_idxs=[1]),
    "qwen3_next": dict(
        num_experts=4, num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"]
    ),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
}


def build(model_type: str) -> torch.nn.Module:
    default = AutoConfig.for_model(model_type)
    known = {*default.to_dict(), *getattr(default, "attribute_map", {})}
    common = {key: value for key, value in TINY.items() if key in known}
    config = AutoConfig.for_model(model_type, **common, **FAMILY[model_type])
    torch.manual_seed(0)
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config).eval()


def one_pass_per_sequence(self: HybridRunner, chunks, inputs):
    """:meth:`HybridRunner._decode_pass` as one batch-1 pass per decoding sequence, the
    states of the passes left in the batch as the batched pass leaves them."""
    logits, states = [], []
    for index, chunk in enumerate(chunks):
        self.states.clear()
        self.states.load([self.slots.slot(chunk.seq.seq_id)])
        rows = type(inputs)(
            inputs.query_lens[index : index + 1],
            inputs.seq_lens[index : index + 1],
            inputs.block_tables[index : index + 1],
            inputs.slot_mapping[index : index + 1],
            inputs.sliding_window,
            inputs.attention_chunk_size,
        )
        logits.append(self._forward_rows([chunk.fed_tokens()], [[chunk.start]], rows)[:, -1])
        states.append(dict(self.states.tensors))
    self.states.clear()
    for key in states[0]:
        self.states.tensors[key] = torch.cat([s[key] for s in states])
    return torch.cat(logits)


def decode_speed(model, requests: int, new_tokens: int) -> tuple[float, list]:
    """Decode tokens per second of one engine run, and its tokens."""
    gen = torch.Generator().manual_seed(0)
    engine = Engine(
        model,
        num_blocks=requests * 16,
        block_size=8,
        max_num_seqs=requests,
        enable_prefix_caching=False,
    )
    ids = []
    for i in range(requests):
        prompt = torch.randint(3, 128, (9 + 3 * i,), generator=gen).tolist()
        ids.append(engine.add_request(prompt, SamplingParams(new_tokens, ignore_eos=True)))
    seconds, tokens, outputs = 0.0, 0, {}
    while engine.has_unfinished():
        decoding = all(r.is_decoding for r in engine.core.requests.values())
        before = engine.core.stats.generated_tokens
        start = time.perf_counter()
        for output in engine.step():
            outputs[output.request_id] = output.outputs
        if decoding and len(engine.core.requests) == requests:
            seconds += time.perf_counter() - start
            tokens += engine.core.stats.generated_tokens - before
    return tokens / seconds, [outputs[i] for i in ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="lfm2,qwen3_next,granitemoehybrid")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()
    record = {"settings": vars(args), "machine": platform.processor() or platform.machine()}
    record["load_before"] = os.getloadavg()
    torch.set_num_threads(args.threads)
    batched = HybridRunner._decode_pass
    for model_type in args.models.split(","):
        model = build(model_type)
        speeds: dict[str, list[float]] = {"per sequence": [], "batched": []}
        tokens = {}
        for _ in range(args.rounds):
            for mode, method in (("per sequence", one_pass_per_sequence), ("batched", batched)):
                HybridRunner._decode_pass = method
                try:
                    speed, tokens[mode] = decode_speed(model, args.requests, args.new_tokens)
                finally:
                    HybridRunner._decode_pass = batched
                speeds[mode].append(speed)
        if tokens["per sequence"] != tokens["batched"]:
            raise SystemExit(f"{model_type}: the two modes gave different tokens")
        per, both = (statistics.median(speeds[m]) for m in ("per sequence", "batched"))
        record[model_type] = speeds
        print(
            f"{model_type}: {args.requests} requests, decode {per:.0f} tok/s one pass per "
            f"sequence, {both:.0f} tok/s batched ({both / per:.2f}x; median of {args.rounds})"
        )
    record["load_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as file:
            json.dump(record, file, indent=1)


if __name__ == "__main__":
    main()
