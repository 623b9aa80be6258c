"""The tensor-parallel scenarios of tests/test_tensor_parallel.py.

``scenarios(model)`` runs generate() through PagedCache (greedy on a left-padded batch, beam
search, sampling with num_return_sequences) and the engine (swapping, recompute, prefix caching,
parallel sampling and beams), and returns every token with the KV sizes. The test calls it in
one process on a plainly loaded model; under torchrun this file loads the same checkpoint with
transformers' ``tp_plan="auto"`` on each rank, runs it and a few error cases there, and writes
``OUT_DIR/rank<r>.json``::

    torchrun --standalone --nproc-per-node 2 tests/tensor_parallel_worker.py CHECKPOINTS OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch

from paged_attention.cli.demo import default_workload
from paged_attention.engine import Engine, SamplingParams
from paged_attention.integrations.transformers import (
    ATTN_IMPLEMENTATION,
    PagedCache,
    cache_argument_name,
)
from paged_attention.kv import cache as cache_module
from paged_attention.modeling.geometry import ModelGeometry
from paged_attention.modeling.tensor_parallel import TensorParallel

BLOCK = 16
ENGINE_BLOCKS = 20  # too few for the workload at once: requests are preempted
MEMORY_BUDGET = 1 << 20  # bytes, for the cache sized by memory
HOST_AVAILABLE = 64 << 20  # bytes, the host memory the CPU default takes a quarter of


def _generate(model, cache_blocks: int, **kwargs) -> list[list[int]]:
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedCache(model, block_size=BLOCK, num_blocks=cache_blocks)
    out = model.generate(**kwargs, **{cache_argument_name(model): cache}, pad_token_id=0)
    return out.tolist()


def scenarios(model) -> dict:
    """Every token the scenarios produce, the KV sizes, and the engine's preemption counts."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, model.config.vocab_size, (2, 21), generator=gen)
    mask = torch.ones_like(ids)
    ids[1, :6], mask[1, :6] = 0, 0  # left padding
    results = {
        "greedy": _generate(
            model, 32, input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False
        ),
        "beam_search": _generate(
            model,
            64,
            input_ids=ids[:1],
            max_new_tokens=16,
            num_beams=3,
            num_return_sequences=2,
            do_sample=False,
        ),
    }
    torch.manual_seed(11)  # generate() draws from torch's global generator
    results["sampling"] = _generate(
        model,
        64,
        input_ids=ids[:1],
        max_new_tokens=16,
        do_sample=True,
        temperature=0.9,
        top_k=0,
        num_return_sequences=3,
    )
    sized = PagedCache(model, block_size=BLOCK, max_memory=MEMORY_BUDGET)
    available = cache_module._host_available_bytes
    cache_module._host_available_bytes = lambda: HOST_AVAILABLE  # the CPU default's base
    try:
        default = PagedCache(model, block_size=BLOCK)
    finally:
        cache_module._host_available_bytes = available
    results["kv"] = {
        "bytes_per_block": sized.kv_cache.bytes_per_block,
        "blocks_for_budget": sized.kv_cache.num_blocks,
        "kv_heads": sized.kv_cache.num_kv_heads,
        "default_device_bytes": default.kv_cache.device_bytes,
    }

    workload = default_workload(10, model.config.vocab_size, seed=5)
    prompts = [prompt for prompt, _ in workload]
    params = [p for _, p in workload]
    for name, host_blocks in (("engine_swap", 4 * ENGINE_BLOCKS), ("engine_recompute", 0)):
        engine = Engine(
            model, num_blocks=ENGINE_BLOCKS, block_size=BLOCK, num_host_blocks=host_blocks
        )
        outputs = engine.generate(prompts, params)
        stats = engine.stats
        results[name] = {
            "outputs": [out.outputs for out in outputs],
            "swaps_out": stats.swaps_out,
            "preemptions_by_recompute": stats.preemptions_by_recompute,
            "prompt_tokens_cached": stats.prompt_tokens_cached,
            "device_bytes": engine.kv_cache.device_bytes,
        }
    return results


def _error(call) -> str | None:
    """The message of the ValueError or RuntimeError ``call`` raises, None if it returns."""
    try:
        call()
    except (ValueError, RuntimeError) as error:
        return str(error)
    return None


def _load(path: str):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # tp_plan= moves to DistributedConfig
        return AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval()


def main(checkpoints: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    model = _load(os.path.join(checkpoints, "model"))
    split = ModelGeometry.of(model).tensor_parallel
    rank = split.rank

    checks: dict[str, int] = {}
    check = TensorParallel.check_same_on_every_rank

    def counted(self, what, tensors):
        checks[what] = checks.get(what, 0) + 1
        return check(self, what, tensors)

    TensorParallel.check_same_on_every_rank = counted
    results = scenarios(model)
    results["tensor_parallel"] = {"size": split.size, "rank": rank, "checks": checks}

    # Ranks that pad the same prompt differently: their slot mappings differ (the model's own
    # collectives would fail on inputs of different shapes, before the check).
    mask = torch.tensor([[rank == 0, 1, 1, 1]])
    results["diverged_padding"] = _error(
        lambda: _generate(
            model, 8, input_ids=torch.tensor([[5, 6, 7, 8]]), attention_mask=mask, max_new_tokens=2
        )
    )

    # A rank that receives a request the other does not: the debug check stops both.
    engine = Engine(model, num_blocks=ENGINE_BLOCKS, block_size=BLOCK)
    engine.add_request([5, 6, 7 + rank], SamplingParams(4))
    results["diverged_requests"] = _error(engine.step)
    # Budgets that differ between the ranks: every rank takes the smaller one's blocks.
    budget = PagedCache(model, block_size=BLOCK, max_memory=MEMORY_BUDGET * (1 + rank))
    results["blocks_for_rank_dependent_budget"] = budget.kv_cache.num_blocks
    results["different_num_blocks"] = _error(
        lambda: PagedCache(model, block_size=BLOCK, num_blocks=8 + rank)
    )
    for name in ("mqa", "odd_kv_heads"):
        results[name] = _error(lambda n=name: PagedCache(_load(os.path.join(checkpoints, n))))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
        json.dump(results, file)


if __name__ == "__main__":
    torch.distributed.init_process_group("gloo")
    try:
        main(*sys.argv[1:])
    finally:
        torch.distributed.destroy_process_group()
