"""Tensor-parallel generation on a paged KV cache: ``generate()`` through ``PagedCache`` and the
serving engine, on a model split over the processes of a torchrun job::

    torchrun --nproc-per-node 2 examples/tp_generate.py            # the demo's tiny Llama
    torchrun --nproc-per-node 2 examples/tp_generate.py CHECKPOINT # a local checkpoint
    python examples/tp_generate.py                                 # one process, to compare

Each rank loads its shard with transformers' tensor-parallel plan (``DistributedConfig``; needs
``pip install 'paged_attention[tp]'``), keeps the KV cache of its own heads and makes the same
calls as every other rank (SPMD); rank 0 prints the tokens, which equal the one-process run's.
On the CPU the ranks talk over gloo, on CUDA over NCCL (one GPU per rank).
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import AutoModelForCausalLM, DistributedConfig

from paged_attention.cli.demo import default_model
from paged_attention.engine import Engine, SamplingParams
from paged_attention.integrations.transformers import (
    ATTN_IMPLEMENTATION,
    PagedCache,
    cache_argument_name,
)

PROMPTS = [[1, 17, 240, 51, 9, 388, 12], [1, 17, 240, 51, 9, 600], [1, 77, 5]]


def serve(model: torch.nn.Module) -> dict:
    """Greedy ``generate()`` through a PagedCache, then the engine: a greedy request, two
    samples and a beam search."""
    device = next(model.parameters()).device
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedCache(model, block_size=16, num_blocks=64)
    input_ids = torch.tensor(PROMPTS[:1], device=device)
    generated = model.generate(
        input_ids, max_new_tokens=16, do_sample=False, **{cache_argument_name(model): cache}
    )
    engine = Engine(model, num_blocks=64, block_size=16)
    params = [
        SamplingParams(16),
        SamplingParams(16, temperature=0.8, top_p=0.95, n=2, seed=1),
        SamplingParams(12, beam_width=2),
    ]
    outputs = engine.generate(PROMPTS, params)
    return {
        "generate": generated[0, input_ids.shape[1] :].tolist(),
        "engine": [out.outputs for out in outputs],
        "kv_heads_per_rank": engine.kv_cache.num_kv_heads,
        "kv_bytes_per_rank": engine.kv_cache.device_bytes,
    }


def load(checkpoint: str | None) -> torch.nn.Module:
    """This process's shard of the model (all of it outside torchrun)."""
    ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    split = {"distributed_config": DistributedConfig(tp_size=ranks)} if ranks > 1 else {}
    if checkpoint:
        return AutoModelForCausalLM.from_pretrained(checkpoint, **split).eval()
    model = default_model(seed=0)  # the same seeded weights in every process
    if not split:
        return model
    return (
        type(model)
        .from_pretrained(None, config=model.config, state_dict=model.state_dict(), **split)
        .eval()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", nargs="?", help="a local transformers checkpoint directory")
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:  # started by torchrun
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        result = serve(load(args.checkpoint))
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank == 0:
            ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
            print(f"ranks: {ranks}")
            print(f"generate() through PagedCache: {result['generate']}")
            for prompt, outputs in zip(PROMPTS, result["engine"]):
                print(f"engine, prompt of {len(prompt)} tokens: {outputs}")
            print(f"KV heads per rank: {result['kv_heads_per_rank']}")
            print(f"KV cache bytes per rank: {result['kv_bytes_per_rank']}")
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
