"""Block-manager cost per step, next to a straightforward list-based manager.

Workload (issue 5): block size 16; 256 sequences, each a 1024-token prompt whose first 512
tokens are shared (prefix caching on); allocate all; 256 decode steps, each appending one
token to every sequence and producing the int32 block-table tensor and the slot mapping;
``stats()`` over the 256 sequences (the serving engine calls it every step); free all. Also
beam search: 64 requests of width 4 (512-token prompts), each step reordering the beams (fork
the chosen parents, free the old beams, each as one batched call) and then decoding one token.

    python benchmarks/bench_block_manager.py [--json results/bench_block_manager.json]

(with the package installed, or ``PYTHONPATH=.`` from the repository root).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time
from collections import deque

import torch

from paged_attention.cli.machine import machine_info
from paged_attention.kv.block_manager import BlockManager

BLOCK_SIZE = 16
NUM_SEQS = 256
PROMPT_LEN = 1024
SHARED_PREFIX = 512
DECODE_STEPS = 256
BEAM_REQUESTS = 64
BEAM_WIDTH = 4
BEAM_PROMPT_LEN = 512
BEAM_STEPS = 128
STATS_CALLS = 32
NUM_BLOCKS = NUM_SEQS * (PROMPT_LEN + DECODE_STEPS) // BLOCK_SIZE


class ListBlockManager:
    """The baseline: nano-vllm's design (per-sequence Python lists of block ids, a free deque,
    prefix caching by chained hash) plus fork and copy-on-write, rebuilding every tensor from
    lists each step."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[list[int] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_blocks = deque(range(num_blocks))
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def _take(self) -> int:
        block = self.free_blocks.popleft()
        old_hash = self.block_hash[block]
        if old_hash is not None and self.hash_to_block.get(old_hash) == block:
            del self.hash_to_block[old_hash]
        self.block_hash[block] = self.block_tokens[block] = None
        self.ref_count[block] = 1
        return block

    def allocate(self, seq_id: int, tokens: list[int]) -> None:
        size = self.block_size
        table = []
        chain_hash = -1
        miss = False
        for start in range(0, len(tokens), size):
            chunk = tokens[start : start + size]
            full = len(chunk) == size
            chain_hash = hash((chain_hash, tuple(chunk))) if full else -1
            block = self.hash_to_block.get(chain_hash, -1)
            miss = miss or block == -1 or self.block_tokens[block] != chunk
            if miss:
                block = self._take()
            else:
                if self.ref_count[block] == 0:
                    self.free_blocks.remove(block)
                self.ref_count[block] += 1
            if full:
                self.block_hash[block], self.block_tokens[block] = chain_hash, chunk
                self.hash_to_block[chain_hash] = block
            table.append(block)
        self.tables[seq_id] = table
        self.lens[seq_id] = len(tokens)

    def fork(self, parent: int, child: int) -> None:
        self.tables[child] = list(self.tables[parent])
        self.lens[child] = self.lens[parent]
        for block in self.tables[child]:
            self.ref_count[block] += 1

    def fork_many(self, parent_ids: list[int], child_ids: list[int]) -> None:
        for parent, child in zip(parent_ids, child_ids):
            self.fork(parent, child)

    def free(self, seq_id: int) -> None:
        for block in reversed(self.tables.pop(seq_id)):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free_blocks.append(block)
        del self.lens[seq_id]

    def free_many(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.free(seq_id)

    def stats(self) -> dict:
        """Used, shared and saved blocks, tokens stored and fragmentation, by walking the lists."""
        size = self.block_size
        filled: dict[int, int] = {}  # tokens held in each used block
        for seq_id, table in self.tables.items():
            length = self.lens[seq_id]
            for index, block in enumerate(table):
                filled[block] = max(filled.get(block, 0), min(size, length - index * size))
        used = len(filled)
        tokens = sum(filled.values())
        return {
            "used_blocks": used,
            "shared_blocks": sum(1 for block in filled if self.ref_count[block] > 1),
            "tokens_stored": tokens,
            "fragmentation": 1 - tokens / (used * size) if used else 0.0,
            "blocks_saved_by_sharing": sum(map(len, self.tables.values())) - used,
        }

    def decode_step(self, seq_ids: list[int]):
        size = self.block_size
        pairs = []
        for seq_id in seq_ids:
            table, length = self.tables[seq_id], self.lens[seq_id]
            if length % size == 0:
                table.append(self._take())
            elif self.ref_count[table[-1]] > 1:
                self.ref_count[table[-1]] -= 1
                new = self._take()
                pairs.append((table[-1], new))
                table[-1] = new
            self.lens[seq_id] = length + 1
        tables = [self.tables[s] for s in seq_ids]
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        lens = [self.lens[s] for s in seq_ids]
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        slots = [t[(n - 1) // size] * size + (n - 1) % size for t, n in zip(tables, lens)]
        return pairs, block_tables, seq_lens, torch.tensor(slots, dtype=torch.int64)


def make_manager(kind: str):
    if kind == "block_manager":
        return BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True)
    return ListBlockManager(NUM_BLOCKS, BLOCK_SIZE)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_decode_workload(kind: str, rng: random.Random) -> dict:
    prefix = [rng.randrange(32000) for _ in range(SHARED_PREFIX)]
    prompts = [
        prefix + [rng.randrange(32000) for _ in range(PROMPT_LEN - SHARED_PREFIX)]
        for _ in range(NUM_SEQS)
    ]
    manager = make_manager(kind)
    seq_ids = list(range(NUM_SEQS))

    def allocate_all():
        for seq_id, prompt in zip(seq_ids, prompts):
            manager.allocate(seq_id, prompt)

    def free_all():
        for seq_id in seq_ids:
            manager.free(seq_id)

    cpu_start = time.process_time()
    allocate_s = timed(allocate_all)
    allocate_cpu_s = time.process_time() - cpu_start
    steps = [timed(lambda: manager.decode_step(seq_ids)) for _ in range(DECODE_STEPS)]
    stats = [timed(manager.stats) for _ in range(STATS_CALLS)]
    free_s = timed(free_all)
    return {
        "allocate_s": allocate_s,
        "allocate_cpu_s": allocate_cpu_s,
        "steps_s": steps,
        "stats_s": stats,
        "free_s": free_s,
    }


def run_beam_workload(kind: str, rng: random.Random) -> list[float]:
    manager = make_manager(kind)
    next_id = 0
    beams = []
    for _ in range(BEAM_REQUESTS):
        root = next_id
        manager.allocate(root, [rng.randrange(32000) for _ in range(BEAM_PROMPT_LEN)])
        group = [root]
        for child in range(root + 1, root + BEAM_WIDTH):
            manager.fork(root, child)
            group.append(child)
        next_id += BEAM_WIDTH
        beams.append(group)
    choices = [
        [sorted(rng.choices(range(BEAM_WIDTH), k=BEAM_WIDTH)) for _ in range(BEAM_REQUESTS)]
        for _ in range(BEAM_STEPS)
    ]

    steps = []
    for step_choices in choices:
        start = time.perf_counter()
        old_beams = [seq_id for group in beams for seq_id in group]
        parents, children = [], []
        for group_index, picks in enumerate(step_choices):
            new = list(range(next_id, next_id + BEAM_WIDTH))
            next_id += BEAM_WIDTH
            parents += [beams[group_index][pick] for pick in picks]
            children += new
            beams[group_index] = new
        manager.fork_many(parents, children)
        manager.free_many(old_beams)
        manager.decode_step(children)
        steps.append(time.perf_counter() - start)
    return steps


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def benchmark(kind: str, repeats: int) -> dict:
    gc.collect()
    gc.disable()  # as timeit does: a collection landing in one step is noise, not its cost
    try:
        decode_runs = [run_decode_workload(kind, random.Random(i)) for i in range(repeats + 1)]
        beam_runs = [run_beam_workload(kind, random.Random(i)) for i in range(repeats + 1)]
    finally:
        gc.enable()
    decode_runs, beam_runs = decode_runs[1:], beam_runs[1:]  # the first run warms up
    steps = [s for run in decode_runs for s in run["steps_s"]]
    beam_steps = [s for run in beam_runs for s in run]
    return {
        "allocate_all_ms": statistics.median(r["allocate_s"] for r in decode_runs) * 1e3,
        # CPU time: what allocate-all costs when other processes share the cores.
        "allocate_all_cpu_ms": statistics.median(r["allocate_cpu_s"] for r in decode_runs) * 1e3,
        "decode_step_median_us": statistics.median(steps) * 1e6,
        "decode_step_p90_us": percentile(steps, 0.9) * 1e6,
        "free_all_ms": statistics.median(r["free_s"] for r in decode_runs) * 1e3,
        "stats_median_us": statistics.median(s for r in decode_runs for s in r["stats_s"]) * 1e6,
        "beam_step_median_us": statistics.median(beam_steps) * 1e6,
        "beam_step_p90_us": percentile(beam_steps, 0.9) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default="results/bench_block_manager.json")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs after one warm-up")
    args = parser.parse_args()
    torch.set_num_threads(1)

    results = {kind: benchmark(kind, args.repeats) for kind in ("block_manager", "list_baseline")}
    columns = list(results["block_manager"])
    print(f"{'':<22}" + "".join(f"{kind:>16}" for kind in results))
    for column in columns:
        print(f"{column:<22}" + "".join(f"{row[column]:>16.1f}" for row in results.values()))

    report = {
        "workload": {
            "block_size": BLOCK_SIZE,
            "num_seqs": NUM_SEQS,
            "prompt_len": PROMPT_LEN,
            "shared_prefix": SHARED_PREFIX,
            "decode_steps": DECODE_STEPS,
            "stats_calls": STATS_CALLS,
            "beam_requests": BEAM_REQUESTS,
            "beam_width": BEAM_WIDTH,
            "beam_prompt_len": BEAM_PROMPT_LEN,
            "beam_steps": BEAM_STEPS,
            "repeats": args.repeats,
        },
        "machine": machine_info("cpu"),
        "results": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
