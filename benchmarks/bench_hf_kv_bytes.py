"""KV-cache bytes of Hugging Face generate(): PagedCache vs transformers' default DynamicCache.

For a beam search (width 4) and a sampling run with num_return_sequences=4, runs the same
generate() call twice on a Llama-architecture model built from a fixed config and seed (no
download) and reports:

* DynamicCache: bytes of its key/value tensors after generation (it only grows, so this is its
  peak holding; beam reordering also makes a transient copy of the whole cache every step);
* PagedCache peak: most blocks in use at any step x bytes per block (all layers, K and V);
* PagedCache unshared: the blocks the same sequences would need without fork/copy-on-write
  sharing (each row holding its own blocks), for scale.

Usage:
    python benchmarks/bench_hf_kv_bytes.py [--json results/bench_hf_kv_bytes.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from paged_attention.cli.machine import machine_info
from paged_attention.integrations.transformers import (
    ATTN_IMPLEMENTATION,
    PagedCache,
    cache_argument_name,
)
from paged_attention.modeling.tiny import tiny_llama_config

CONFIG = tiny_llama_config(
    vocab_size=512,
    intermediate_size=512,
    num_hidden_layers=4,
    head_dim=64,
    max_position_embeddings=4096,
    eos_token_id=None,  # every run generates exactly max_new_tokens
)

RUNS = {
    "beam search, width 4": dict(num_beams=4, do_sample=False),
    "sampling, num_return_sequences=4": dict(do_sample=True, num_return_sequences=4, top_k=50),
}


def dynamic_cache_bytes(cache: DynamicCache) -> int:
    return sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
    )


def measure(model, prompt_len: int, new_tokens: int, block_size: int, options: dict) -> dict:
    ids = torch.randint(
        3, CONFIG["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(0)
    )
    kwargs = dict(input_ids=ids, max_new_tokens=new_tokens, **options)

    model.set_attn_implementation("sdpa")
    dynamic = DynamicCache(config=model.config)
    torch.manual_seed(0)
    expected = model.generate(**kwargs, **{cache_argument_name(model): dynamic})

    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    paged = PagedCache(model, block_size=block_size, num_blocks=4096)
    torch.manual_seed(0)
    got = model.generate(**kwargs, **{cache_argument_name(model): paged})
    rows = len(paged._rows)
    final_len = prompt_len + new_tokens - 1  # the last token is never fed back
    unshared_blocks = rows * math.ceil(final_len / block_size)
    stats = paged.stats()
    return {
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "rows": rows,
        "same_tokens": bool(torch.equal(expected, got)),
        "dynamic_cache_bytes": dynamic_cache_bytes(dynamic),
        "paged_peak_blocks": paged.peak_blocks_in_use,
        "paged_peak_bytes": paged.peak_blocks_in_use * paged.kv_cache.bytes_per_block,
        "paged_final_bytes": stats.device.used_blocks * paged.kv_cache.bytes_per_block,
        "paged_unshared_bytes": unshared_blocks * paged.kv_cache.bytes_per_block,
        "bytes_per_block": paged.kv_cache.bytes_per_block,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default="results/bench_hf_kv_bytes.json")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()

    torch.manual_seed(1234)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    results = []
    header = (
        f"{'run':34} {'prompt':>6} {'new':>4} {'rows':>4} {'DynamicCache':>13} "
        f"{'Paged peak':>11} {'ratio':>6} {'unshared':>10} {'same':>5}"
    )
    print(header)
    print("-" * len(header))
    for prompt_len in args.prompt_lens:
        for name, options in RUNS.items():
            row = measure(model, prompt_len, args.new_tokens, args.block_size, options)
            row["run"] = name
            row["ratio"] = row["paged_peak_bytes"] / row["dynamic_cache_bytes"]
            results.append(row)
            print(
                f"{name:34} {prompt_len:>6} {args.new_tokens:>4} {row['rows']:>4} "
                f"{row['dynamic_cache_bytes'] / 2**20:>10.2f} MiB "
                f"{row['paged_peak_bytes'] / 2**20:>7.2f} MiB {row['ratio']:>6.2f} "
                f"{row['paged_unshared_bytes'] / 2**20:>6.2f} MiB {str(row['same_tokens']):>5}"
            )
    report = {
        "benchmark": "bench_hf_kv_bytes",
        "model": {"architecture": "LlamaForCausalLM", **CONFIG, "dtype": "float32"},
        "block_size": args.block_size,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "machine": machine_info("cpu"),
        "results": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
