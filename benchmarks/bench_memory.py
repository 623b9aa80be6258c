"""KV-cache memory efficiency of paging, measured with the real BlockManager.

Two experiments on a seeded synthetic trace shaped like chat traffic:

1. Utilisation: requests are served by a continuous batch of ``--concurrency`` slots; every
   request prefills its prompt, then decodes one token per step until its output length, and a
   finished request's slot goes to the next one in the trace. After every step we count the KV
   slots holding real tokens against the slots reserved by
     * paged caches with block sizes 8, 16 and 32 (blocks actually taken from a BlockManager),
     * contiguous reservation of the maximum sequence length per request (what servers without
       paging did: FasterTransformer, Orca "max"),
     * contiguous reservation of each request's own final length (an oracle that knows the
       output length in advance: Orca "oracle", the best a contiguous cache can do).
   Utilisation is summed over all steps, so it is the time average the cache actually delivers.

2. Sharing: each request runs alone; parallel sampling forks the prompt into n samples, beam
   search keeps ``width`` beams and at every step each new beam picks a parent among the current
   beams uniformly at random (seeded), forking it and freeing the beams nobody picked, as a beam
   search engine on a paged cache does. Saving = 1 - (blocks in use) / (blocks the same
   sequences would hold without sharing), summed over all steps.

Trace: prompt and output lengths are log-normal (sigma 1.0) with means 161 and 338 tokens, the
ShareGPT averages reported in the PagedAttention paper (Kwon et al., SOSP 2023), rounded and
clipped to [1, max_len - 1] with prompt + output <= max_len (2048, OPT's context).

    python benchmarks/bench_memory.py [--requests 1000] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from dataclasses import asdict, dataclass

import numpy as np

from paged_attention.kv.block_manager import BlockManager

BLOCK_SIZES = (8, 16, 32)
SAMPLE_COUNTS = (2, 4, 6)
BEAM_WIDTHS = (2, 4, 6)
PROMPT_MEAN, OUTPUT_MEAN, SIGMA = 161.0, 338.0, 1.0


@dataclass(frozen=True)
class Request:
    prompt_len: int
    output_len: int


def chat_trace(num_requests: int, max_len: int, seed: int) -> list[Request]:
    """Log-normal prompt and output lengths with the ShareGPT means, clipped to ``max_len``."""
    rng = np.random.default_rng(seed)

    def lognormal(mean: float) -> np.ndarray:
        mu = math.log(mean) - SIGMA**2 / 2  # so that E[length] = mean
        return np.rint(rng.lognormal(mu, SIGMA, num_requests)).astype(np.int64)

    prompts = np.clip(lognormal(PROMPT_MEAN), 1, max_len - 1)
    outputs = np.clip(lognormal(OUTPUT_MEAN), 1, max_len - prompts)
    return [Request(int(p), int(o)) for p, o in zip(prompts, outputs)]


@dataclass
class Usage:
    """KV slots summed over all steps: holding a token, and reserved."""

    token_slots: int = 0
    reserved_slots: int = 0

    def add(self, tokens: int, reserved: int) -> None:
        self.token_slots += tokens
        self.reserved_slots += reserved

    @property
    def utilisation(self) -> float:
        return self.token_slots / self.reserved_slots


def utilisation(trace: list[Request], concurrency: int, max_len: int) -> dict[str, Usage]:
    """Serve the trace with a continuous batch and account every scheme's slots per step."""
    schemes = [f"paged, block {b}" for b in BLOCK_SIZES]
    schemes += ["contiguous, max length", "contiguous, own length (oracle)"]
    usage = {name: Usage() for name in schemes}
    # Enough blocks for any mix of running requests.
    managers = {
        b: BlockManager(concurrency * -(-max_len // b), b, watermark=0.0) for b in BLOCK_SIZES
    }
    waiting = list(enumerate(trace))[::-1]
    running: dict[int, int] = {}  # request index -> tokens in the cache

    def admit() -> None:
        while waiting and len(running) < concurrency:
            index, request = waiting.pop()
            for manager in managers.values():
                manager.allocate(index, request.prompt_len)
            running[index] = request.prompt_len

    admit()
    while running:
        tokens = sum(running.values())
        for b, manager in managers.items():
            used = manager.num_device_blocks - manager.num_free_device_blocks()
            usage[f"paged, block {b}"].add(tokens, used * b)
        usage["contiguous, max length"].add(tokens, len(running) * max_len)
        own = sum(trace[i].prompt_len + trace[i].output_len for i in running)
        usage["contiguous, own length (oracle)"].add(tokens, own)

        # One decode step: every running request gets a slot for its next token.
        ids = list(running)
        for manager in managers.values():
            manager.decode_step(ids)
        for index in ids:
            running[index] += 1
            if running[index] == trace[index].prompt_len + trace[index].output_len:
                del running[index]
                for manager in managers.values():
                    manager.free(index)
        admit()
    return usage


class SharingMeter:
    """Sums, over steps, the device blocks in use and the blocks the same sequences would
    hold if nothing were shared."""

    def __init__(self, manager: BlockManager) -> None:
        self.block_manager = manager
        self.used = 0
        self.unshared = 0

    def sample(self, seq_ids: list[int]) -> None:
        manager = self.block_manager
        self.used += manager.num_device_blocks - manager.num_free_device_blocks()
        size = manager.block_size
        self.unshared += sum(-(-manager.num_tokens(s) // size) for s in seq_ids)

    @property
    def saving(self) -> float:
        return 1 - self.used / self.unshared


def parallel_sampling_saving(trace: list[Request], n: int, block_size: int, max_len: int) -> float:
    manager = BlockManager(n * (max_len // block_size + 1), block_size, watermark=0.0)
    meter = SharingMeter(manager)
    for request in trace:
        manager.allocate(0, request.prompt_len)
        samples = list(range(n))
        for child in samples[1:]:
            manager.fork(0, child)
        for _ in range(request.output_len):
            manager.decode_step(samples)
            meter.sample(samples)
        for sample in samples:
            manager.free(sample)
    return meter.saving


def beam_search_saving(
    trace: list[Request], width: int, block_size: int, max_len: int, seed: int
) -> float:
    manager = BlockManager(2 * width * (max_len // block_size + 1), block_size, watermark=0.0)
    meter = SharingMeter(manager)
    rng = random.Random(seed)
    next_id = 0
    for request in trace:
        manager.allocate(next_id, request.prompt_len)
        beams = [next_id] * width  # every beam starts as the prompt
        next_id += 1
        for _ in range(request.output_len):
            parents = [rng.choice(beams) for _ in range(width)]
            children = list(range(next_id, next_id + width))
            next_id += width
            for parent, child in zip(parents, children):
                manager.fork(parent, child)
            for beam in set(beams):
                manager.free(beam)
            manager.decode_step(children)
            meter.sample(children)
            beams = children
        for beam in beams:
            manager.free(beam)
    return meter.saving


def run(args: argparse.Namespace) -> dict:
    trace = chat_trace(args.requests, args.max_len, args.seed)
    usage = utilisation(trace, args.concurrency, args.max_len)
    sharing_trace = trace[: args.sharing_requests]
    sampling = {
        n: parallel_sampling_saving(sharing_trace, n, args.sharing_block_size, args.max_len)
        for n in SAMPLE_COUNTS
    }
    beams = {
        w: beam_search_saving(sharing_trace, w, args.sharing_block_size, args.max_len, args.seed)
        for w in BEAM_WIDTHS
    }
    prompts = [r.prompt_len for r in trace]
    outputs = [r.output_len for r in trace]
    return {
        "trace": {
            "distribution": (
                f"log-normal prompt and output lengths, sigma {SIGMA}, means {PROMPT_MEAN:g} "
                f"and {OUTPUT_MEAN:g} tokens (ShareGPT averages), clipped so prompt + output "
                f"<= {args.max_len}"
            ),
            "requests": len(trace),
            "seed": args.seed,
            "max_len": args.max_len,
            "mean_prompt_len": float(np.mean(prompts)),
            "mean_output_len": float(np.mean(outputs)),
            "concurrency": args.concurrency,
        },
        "utilisation": {
            name: {**asdict(u), "utilisation": u.utilisation, "waste": 1 - u.utilisation}
            for name, u in usage.items()
        },
        "sharing": {
            "requests": len(sharing_trace),
            "block_size": args.sharing_block_size,
            "parallel_sampling_saving": {str(n): s for n, s in sampling.items()},
            "beam_search_saving": {str(w): s for w, s in beams.items()},
        },
    }


def print_report(result: dict) -> None:
    trace = result["trace"]
    print(f"Trace: {trace['requests']} requests (seed {trace['seed']}), {trace['distribution']}.")
    print(
        f"Measured mean prompt {trace['mean_prompt_len']:.1f}, mean output "
        f"{trace['mean_output_len']:.1f} tokens; {trace['concurrency']} requests in flight."
    )
    print()
    print(f"{'KV cache scheme':34} {'holds tokens':>12} {'wasted':>8}")
    for name, u in result["utilisation"].items():
        print(f"{name:34} {u['utilisation']:>12.1%} {u['waste']:>8.1%}")
    sharing = result["sharing"]
    print()
    print(
        f"Memory saved by sharing ({sharing['requests']} requests, block size "
        f"{sharing['block_size']}):"
    )
    print(f"{'decoding':34} {'saved':>8}")
    for n, s in sharing["parallel_sampling_saving"].items():
        print(f"{f'parallel sampling, n = {n}':34} {s:>8.1%}")
    for w, s in sharing["beam_search_saving"].items():
        print(f"{f'beam search, width {w}':34} {s:>8.1%}")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(result["utilisation"])
    values = [100 * result["utilisation"][n]["utilisation"] for n in names]
    left.barh(names[::-1], values[::-1], color=["tab:gray"] * 2 + ["tab:blue"] * 3)
    left.set_xlabel("KV memory holding real tokens (%)")
    left.set_xlim(0, 112)
    for y, v in enumerate(values[::-1]):
        left.text(v + 1, y, f"{v:.1f}%", va="center")
    left.set_title("Utilisation on the chat trace")

    sharing = result["sharing"]
    labels = [f"n={n}" for n in sharing["parallel_sampling_saving"]]
    labels += [f"beam {w}" for w in sharing["beam_search_saving"]]
    savings = list(sharing["parallel_sampling_saving"].values())
    savings += list(sharing["beam_search_saving"].values())
    right.set_ylim(0, 100)
    right.bar(labels, [100 * s for s in savings], color=["tab:orange"] * 3 + ["tab:green"] * 3)
    right.set_ylabel("KV memory saved by sharing (%)")
    right.set_title(f"Saved by sharing, block size {sharing['block_size']}")
    for x, saving in enumerate(savings):
        right.text(x, 100 * saving + 1, f"{100 * saving:.1f}%", ha="center")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--sharing-requests", type=int, default=200)
    parser.add_argument("--sharing-block-size", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="results/bench_memory.json")
    parser.add_argument("--plot", default="results/bench_memory.png")
    args = parser.parse_args(argv)
    for name in ("requests", "sharing_requests", "sharing_block_size", "concurrency"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.max_len < 2:
        parser.error("--max-len must be at least 2")

    result = run(args)
    print_report(result)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    plot(result, args.plot)
    print(f"\nWrote {args.json} and {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
