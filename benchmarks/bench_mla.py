"""Multi-head latent attention: the latent cache against the expanded one.

Two measurements:

* KV bytes per token per layer of each form (``mla="expanded"``: every query head's key of
  ``qk_nope_head_dim + qk_rope_head_dim`` dims and value of ``v_head_dim``; ``mla="latent"``:
  ``kv_lora_rank + qk_rope_head_dim`` dims once), for DeepSeek-V3 and LongCat-Flash at the
  dimensions of their transformers config classes' defaults, in bfloat16: read from the
  ``PagedKVCache`` the code allocates for a one-layer model of those dimensions (built on the meta
  device, its cache one block on the CPU).
* Decode time per step, both forms side by side, of a small random DeepSeek-V3-like model
  (float32, the real head structure: 16 heads of 128 + 64 query/key dims and 128 value dims over a
  512-dim latent) through ``generate()``'s ``PagedCache``: for each batch size and context
  length, both caches are filled with the same prompts, then timed in rounds latent, expanded,
  latent, expanded, ... of ``--steps`` decode steps each (the best round of each form is
  reported; each round appends its steps to the context, a few tokens against hundreds).

Usage:
    python benchmarks/bench_mla.py [--json docs/results/bench_mla.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from paged_attention.cli.machine import describe_machine, machine_info
from paged_attention.integrations.transformers import (
    ATTN_IMPLEMENTATION,
    PagedCache,
    cache_argument_name,
)
from paged_attention.modeling.geometry import ModelGeometry

FORMS = ("latent", "expanded")
BLOCK_SIZE = 16
# The decode model: DeepSeek-V3's attention shape at 16 heads, two dense layers.
DECODE_MODEL = dict(
    vocab_size=1024,
    hidden_size=1024,
    intermediate_size=1024,
    num_hidden_layers=2,
    first_k_dense_replace=2,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=384,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    max_position_embeddings=8192,
    initializer_range=0.02,
)
# Real models, at their config classes' defaults but one layer (dense, to build fast).
REAL_MODELS = {
    "deepseek_v3": dict(num_hidden_layers=1, first_k_dense_replace=1),
    "longcat_flash": dict(num_layers=1),
}


def build(model_type: str, device: str = "cpu", **settings) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(0)
    with torch.device(device):
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config).eval()


def kv_bytes_per_token(model_type: str, overrides: dict | None = None) -> dict:
    """Bytes each form's cache holds per token and layer, in bfloat16, from a cache of one
    block allocated on the CPU for ``model_type`` at its config class's defaults."""
    model = build(model_type, "meta", **{**REAL_MODELS[model_type], **(overrides or {})})
    row = {"model": model_type}
    for form in FORMS:
        geometry = ModelGeometry.of(model, mla=form)
        geometry = dataclasses.replace(geometry, dtype=torch.bfloat16, device=torch.device("cpu"))
        kv = geometry.kv_cache(BLOCK_SIZE, 1, None)
        held = sum(t.numel() * t.element_size() for t in (*kv.key_caches, *kv.value_caches))
        row[form] = {
            "key_cache_shape": list(kv.key_caches[0].shape),
            "value_cache_shape": list(kv.value_caches[0].shape),
            "bytes_per_token_per_layer": held // (BLOCK_SIZE * kv.num_layers),
        }
    row["ratio"] = (
        row["expanded"]["bytes_per_token_per_layer"] / row["latent"]["bytes_per_token_per_layer"]
    )
    attention = next(m for m in model.modules() if hasattr(m, "kv_lora_rank"))
    row["dims"] = {
        name: getattr(attention, name)
        for name in ("num_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim")
    } | {"v_head_dim": attention.v_head_dim}
    return row


def filled_cache(model, form: str, prompts: torch.Tensor, extra_tokens: int) -> PagedCache:
    """A PagedCache of ``form`` holding ``prompts`` (prefilled by the model)."""
    batch, context = prompts.shape
    blocks = batch * (-(-(context + extra_tokens) // BLOCK_SIZE) + 1)
    cache = PagedCache(model, block_size=BLOCK_SIZE, num_blocks=blocks, mla=form)
    with torch.no_grad():
        model(input_ids=prompts, use_cache=True, **{cache_argument_name(model): cache})
    return cache


def decode_round(model, cache: PagedCache, tokens: torch.Tensor, steps: int) -> float:
    """Seconds per decode step over ``steps`` steps feeding ``tokens`` ``[batch, 1]``."""
    name = cache_argument_name(model)
    with torch.no_grad():
        start = time.perf_counter()
        for _ in range(steps):
            model(input_ids=tokens, use_cache=True, **{name: cache})
        return (time.perf_counter() - start) / steps


def time_decode(model, batch: int, context: int, steps: int, rounds: int) -> dict:
    gen = torch.Generator().manual_seed(batch * 100003 + context)
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (batch, context), generator=gen)
    tokens = torch.randint(3, vocab, (batch, 1), generator=gen)
    caches = {form: filled_cache(model, form, prompts, steps * rounds) for form in FORMS}
    times: dict[str, list[float]] = {form: [] for form in FORMS}
    for _ in range(rounds):
        for form in FORMS:  # A B A B: drifts in the machine's load hit both
            times[form].append(decode_round(model, caches[form], tokens, steps))
    row = {"batch": batch, "context": context}
    for form in FORMS:
        kv = caches[form].kv_cache
        row[form] = {
            "ms_per_step_rounds": [round(t * 1e3, 3) for t in times[form]],
            "ms_per_step_best": round(min(times[form]) * 1e3, 3),
            "cache_bytes_in_use": caches[form].blocks_in_use() * kv.bytes_per_block,
        }
    row["expanded_over_latent"] = (
        row["expanded"]["ms_per_step_best"] / row["latent"]["ms_per_step_best"]
    )
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--steps", type=int, default=4, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each form")
    parser.add_argument("--decode-model", type=json.loads, default={}, help="config overrides")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: a shared machine's cores)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    machine = machine_info()
    print(describe_machine(machine))
    sizes = [kv_bytes_per_token(model_type) for model_type in REAL_MODELS]
    print(f"\n{'model (bf16)':16} {'expanded B/token/layer':>23} {'latent':>8} {'ratio':>6}")
    for row in sizes:
        print(
            f"{row['model']:16} {row['expanded']['bytes_per_token_per_layer']:>23} "
            f"{row['latent']['bytes_per_token_per_layer']:>8} {row['ratio']:>6.1f}"
        )

    settings = {**DECODE_MODEL, **args.decode_model}
    model = build("deepseek_v3", **settings)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    decode = []
    print(f"\n{'batch':>5} {'context':>7} {'expanded ms/step':>17} {'latent ms/step':>15}", end="")
    print(f" {'ratio':>6}")
    for batch in args.batches:
        for context in args.contexts:
            row = time_decode(model, batch, context, args.steps, args.rounds)
            decode.append(row)
            print(
                f"{batch:>5} {context:>7} {row['expanded']['ms_per_step_best']:>17.2f} "
                f"{row['latent']['ms_per_step_best']:>15.2f} {row['expanded_over_latent']:>6.2f}"
            )
    report = {
        "benchmark": "bench_mla",
        "kv_bytes": sizes,
        "decode_model": {"model_type": "deepseek_v3", "dtype": "float32", **settings},
        "decode": decode,
        "settings": {"steps": args.steps, "rounds": args.rounds, "block_size": BLOCK_SIZE},
        "machine": machine,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "torch_threads": torch.get_num_threads(),
    }
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
            handle.write("\n")
    return report


if __name__ == "__main__":
    main()
