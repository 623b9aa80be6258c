"""Serving benchmark: the engine with prefix caching and chunked prefill on and off, beside
transformers' own continuous batching (``generate_batch()``), on the same model and prompts.

Model: a random Llama (8 layers, hidden 512, 8 query / 2 KV heads of 64, fixed seed, fp32),
large enough that attention and the KV cache matter. Workloads:

* A: 64 requests sharing a 512-token system prompt, each with its own 32-256-token question,
  128 new tokens each, greedy;
* B: the demo's mix (``paged_attention.demo.default_workload``: prompts of 8-96 tokens, half with
  a 48-token system prompt, greedy, parallel sampling and beam search).

Each runs offline (every request at time 0) and with Poisson arrivals at a fixed rate. Reported
per run: generated tokens per second (wall time from the first arrival to the last token), time
to first token and inter-token latency p50/p99, prompt tokens computed (the rest came from the
prefix cache), peak KV blocks. Every engine run generates exactly ``max_new_tokens`` per
sequence (no EOS), so throughputs compare like for like; ``generate_batch()`` runs workload A
offline only (it takes neither arrival times nor per-request sampling parameters).

    python benchmarks/bench_serving.py [--quick] [--workloads A,B] [--modes offline,poisson]
        [--json results/bench_serving.json] [--plot results/bench_serving.png]

(with the package installed, or ``PYTHONPATH=.`` from the repository root).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from paged_attention.demo import default_workload, tiny_llama_config
from paged_attention.engine import Engine, SamplingParams

MODEL = tiny_llama_config(
    vocab_size=2048,
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=8,
    head_dim=64,
    max_position_embeddings=4096,
    eos_token_id=None,
)
QUICK_MODEL = {**MODEL, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}
BLOCK_SIZE = 16
NUM_BLOCKS = 4096
MAX_NUM_SEQS = 64
CHUNK_TOKENS = 256  # max_num_batched_tokens with chunked prefill on
CONFIGS = {
    "prefix cache + chunked prefill": dict(enable_prefix_caching=True, chunked=True),
    "prefix cache": dict(enable_prefix_caching=True, chunked=False),
    "chunked prefill": dict(enable_prefix_caching=False, chunked=True),
    "neither": dict(enable_prefix_caching=False, chunked=False),
}
GENERATE_BATCH = "transformers generate_batch()"


def build_model(quick: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**(QUICK_MODEL if quick else MODEL))).eval()


def workload_a(vocab: int, quick: bool) -> list[tuple[list[int], SamplingParams]]:
    rng = torch.Generator().manual_seed(1)
    count, system_len, new = (8, 64, 16) if quick else (64, 512, 128)
    low, high = (8, 32) if quick else (32, 256)
    system = torch.randint(3, vocab, (system_len,), generator=rng).tolist()
    work = []
    for _ in range(count):
        length = int(torch.randint(low, high + 1, (), generator=rng))
        question = torch.randint(3, vocab, (length,), generator=rng).tolist()
        work.append((system + question, SamplingParams(new)))
    return work


def workload_b(vocab: int, quick: bool) -> list[tuple[list[int], SamplingParams]]:
    return default_workload(8 if quick else 32, vocab, seed=0)


def poisson_arrivals(count: int, rate: float, seed: int = 2) -> list[float]:
    gaps = torch.empty(count, dtype=torch.float64).exponential_(
        rate, generator=torch.Generator().manual_seed(seed)
    )
    gaps[0] = 0.0
    return gaps.cumsum(0).tolist()


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(torch.tensor(values, dtype=torch.float64).quantile(q / 100))


def summarize(name, work, elapsed, generated, ttfts, itls, extra) -> dict:
    return {
        "config": name,
        "requests": len(work),
        "generated_tokens": generated,
        "seconds": elapsed,
        "tokens_per_s": generated / elapsed,
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "itl_p50_ms": _ms(percentile(itls, 50)),
        "itl_p99_ms": _ms(percentile(itls, 99)),
        **extra,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def run_engine(model, work, arrivals, name, config) -> dict:
    engine = Engine(
        model,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=CHUNK_TOKENS if config["chunked"] else None,
        enable_prefix_caching=config["enable_prefix_caching"],
        eos_token_id=[],
    )
    engine.generate([work[0][0][:8]], SamplingParams(2))  # warm up allocations and threads
    engine.stats.__init__()
    start = time.perf_counter()
    outputs, added = {}, 0
    while added < len(work) or engine.has_unfinished():
        now = time.perf_counter() - start
        while added < len(work) and arrivals[added] <= now:
            prompt, params = work[added]
            engine.add_request(prompt, params, arrival_time=start + arrivals[added])
            added += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[added] - (time.perf_counter() - start)))
            continue
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    elapsed = time.perf_counter() - start
    served = [o for o in outputs.values() if o.rejected is None]
    stats = engine.stats
    timeline = sorted(
        (t - start, b - a) for o in served for a, b, t in _itl_points(o.metrics.token_times)
    )
    return summarize(
        name,
        work,
        elapsed,
        stats.generated_tokens,
        [o.metrics.time_to_first_token for o in served],
        [latency for o in served for latency in o.metrics.inter_token_latencies],
        {
            "rejected": len(outputs) - len(served),
            "prompt_tokens": stats.prompt_tokens,
            "prompt_tokens_computed": stats.prompt_tokens_computed,
            "prompt_tokens_cached": stats.prompt_tokens_cached,
            "peak_blocks": stats.peak_blocks,
            "preemptions": stats.swaps_out + stats.preemptions_by_recompute,
            "itl_timeline": timeline,
        },
    )


def _itl_points(times: list[float]):
    return [(a, b, b) for a, b in zip(times, times[1:])]


def run_generate_batch(model, work) -> dict:
    prompts = [p for p, _ in work]
    new = work[0][1].max_new_tokens
    config = GenerationConfig(
        max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    model.set_attn_implementation("sdpa")
    model.generate_batch(inputs=[prompts[0][:8]], generation_config=config, progress_bar=False)
    start = time.perf_counter()
    results = model.generate_batch(
        inputs=prompts, generation_config=config, record_timestamps=True, progress_bar=False
    )
    elapsed = time.perf_counter() - start
    outputs = list(results.values())
    ttfts = [o.timestamps[0] - o.created_time for o in outputs if o.timestamps]
    itls = [b - a for o in outputs if o.timestamps for a, b in zip(o.timestamps, o.timestamps[1:])]
    return summarize(
        GENERATE_BATCH,
        work,
        elapsed,
        sum(len(o.generated_tokens) for o in outputs),
        ttfts,
        itls,
        {"prompt_tokens": sum(len(p) for p in prompts)},
    )


def print_table(rows: list[dict]) -> None:
    header = (
        "| workload | arrivals | config | tokens/s | TTFT p50 / p99 | ITL p50 / p99 | "
        "prompt tokens computed | peak KV blocks |"
    )
    print(header)
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        computed, total = row.get("prompt_tokens_computed"), row["prompt_tokens"]
        computed_text = (
            "n/a" if computed is None else f"{computed} of {total} ({100 * computed / total:.0f}%)"
        )
        ttft = f"{_fmt(row['ttft_p50_ms'])} / {_fmt(row['ttft_p99_ms'])}"
        itl = f"{_fmt(row['itl_p50_ms'])} / {_fmt(row['itl_p99_ms'])}"
        print(
            f"| {row['workload']} | {row['arrivals']} | {row['config']} | "
            f"{row['tokens_per_s']:.0f} | {ttft} | {itl} | {computed_text} | "
            f"{row.get('peak_blocks', 'n/a')} |"
        )


def _fmt(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["workload"], r["arrivals"]) for r in rows if r.get("itl_timeline")})
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.2 * len(panels)), squeeze=False)
    for ax, (workload, arrivals) in zip(axes[:, 0], panels):
        for row in rows:
            if (row["workload"], row["arrivals"]) != (workload, arrivals):
                continue
            points = row.get("itl_timeline") or []
            if points:
                times, latencies = zip(*points)
                ax.plot(times, [1000 * v for v in latencies], ".", ms=2, label=row["config"])
        ax.set_title(f"workload {workload}, {arrivals}: inter-token latency over time")
        ax.set_xlabel("seconds since the first arrival")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.legend(fontsize=7, markerscale=4)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and workloads")
    parser.add_argument("--workloads", default="A,B")
    parser.add_argument("--modes", default="offline,poisson")
    parser.add_argument("--configs", default=",".join([*CONFIGS, GENERATE_BATCH]))
    parser.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default="results/bench_serving.json")
    parser.add_argument("--plot", default="results/bench_serving.png")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args.quick)
    vocab = model.config.vocab_size
    builders = {"A": workload_a, "B": workload_b}
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS and c != GENERATE_BATCH]
    if unknown:
        parser.error(f"unknown --configs {unknown}; known: {[*CONFIGS, GENERATE_BATCH]}")
    rows = []
    for workload in args.workloads.split(","):
        work = builders[workload](vocab, args.quick)
        for mode in args.modes.split(","):
            rate = args.rate or (64.0 if args.quick else 4.0)
            arrivals = [0.0] * len(work) if mode == "offline" else poisson_arrivals(len(work), rate)
            label = "offline" if mode == "offline" else f"Poisson {rate:g}/s"
            for name in configs:
                if name == GENERATE_BATCH:
                    if workload != "A" or mode != "offline":
                        continue
                    row = run_generate_batch(model, work)
                else:
                    row = run_engine(model, work, arrivals, name, CONFIGS[name])
                row.update(workload=workload, arrivals=label)
                rows.append(row)
                print(f"  done: {workload} {label} {name}", flush=True)
    print_table(rows)
    result = {
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads()},
        "model": QUICK_MODEL if args.quick else MODEL,
        "block_size": BLOCK_SIZE,
        "num_blocks": NUM_BLOCKS,
        "max_num_seqs": MAX_NUM_SEQS,
        "chunk_tokens": CHUNK_TOKENS,
        "rows": rows,
    }
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
