"""Serving benchmark: the engine with prefix caching and chunked prefill on and off, beside
transformers' own continuous batching (``generate_batch()``), on the same model and prompts.

Model: a random Llama (8 layers, hidden 512, 8 query / 2 KV heads of 64, fixed seed, fp32),
large enough that attention and the KV cache matter. Workloads:

* A: 64 requests sharing a 512-token system prompt, each with its own 32-256-token question,
  128 new tokens each, greedy;
* B: the demo's mix (``paged_attention.demo.default_workload``: prompts of 8-96 tokens, half with
  a 48-token system prompt, greedy, parallel sampling and beam search);
* C: the demo's prompts, every request greedy with 64 new tokens.

Each runs offline (every request at time 0) and with Poisson arrivals at a fixed rate. Reported
per run: generated tokens per second (wall time from the first arrival to the last token), time
to first token and inter-token latency p50/p99, prompt tokens computed (the rest came from the
prefix cache), peak KV blocks. Every engine run generates exactly ``max_new_tokens`` per
sequence (no EOS), so throughputs compare like for like. transformers' ``generate_batch()`` and
a padded ``generate()`` run the all-greedy workloads (A, C) offline only (they take neither arrival
times nor per-request sampling parameters), and every offline engine run of those workloads is
checked token for token against ``generate()``. ``--device cuda`` adds a row with CUDA graphs
off (they are on by default there).

    python benchmarks/bench_serving.py [--quick] [--device cpu|cuda] [--workloads A,B,C]
        [--modes offline,poisson] [--configs ...] [--max-num-batched-tokens 256]
        [--json results/bench_serving.json] [--plot results/bench_serving.png]

(with the package installed, or ``PYTHONPATH=.`` from the repository root).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import time

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

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
CHUNK_TOKENS = 256  # max_num_batched_tokens with chunked prefill on (--max-num-batched-tokens)
CONFIGS = {
    "prefix cache + chunked prefill": dict(enable_prefix_caching=True, chunked=True),
    "prefix cache": dict(enable_prefix_caching=True, chunked=False),
    "chunked prefill": dict(enable_prefix_caching=False, chunked=True),
    "neither": dict(enable_prefix_caching=False, chunked=False),
}
# On CUDA, decode steps replay CUDA graphs by default; this row runs them eagerly.
NO_GRAPHS = "prefix cache + chunked prefill, no CUDA graphs"
CUDA_CONFIGS = {NO_GRAPHS: dict(enable_prefix_caching=True, chunked=True, cuda_graphs=False)}
GENERATE_BATCH = "transformers generate_batch()"
GENERATE = "transformers generate(), padded batch"
BASELINES = (GENERATE_BATCH, GENERATE)


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


def workload_c(vocab: int, quick: bool) -> list[tuple[list[int], SamplingParams]]:
    """The demo's prompts, every request greedy with the same 64 new tokens (16 with
    ``--quick``): a workload transformers' own batching runs as well."""
    new = 16 if quick else 64
    return [(prompt, SamplingParams(new)) for prompt, _ in workload_b(vocab, quick)]


def is_uniform_greedy(work) -> bool:
    """Every request greedy with one sample and the same max_new_tokens."""
    params = {p for _, p in work}
    return len(params) == 1 and all(p.temperature == 0 and p.num_seqs == 1 for p in params)


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


def synchronize(model) -> None:
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


def run_engine(model, work, arrivals, name, config, chunk_tokens) -> dict:
    engine = Engine(
        model,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=chunk_tokens if config["chunked"] else None,
        enable_prefix_caching=config["enable_prefix_caching"],
        eos_token_id=[],
        cuda_graphs=config.get("cuda_graphs"),
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
    synchronize(model)
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
            "outputs": [
                outputs[i].outputs[0] if outputs[i].outputs else [] for i in sorted(outputs)
            ],
        },
    )


def check_greedy_outputs(rows: list[dict]) -> None:
    """For every engine run of a workload that generate() also ran: how many outputs equal."""
    reference = {r["workload"]: r["outputs"] for r in rows if r["config"] == GENERATE}
    for row in rows:
        want = reference.get(row["workload"])
        if want is not None and row["config"] not in BASELINES and row["arrivals"] == "offline":
            row["greedy_matching"] = sum(a == b for a, b in zip(row["outputs"], want))


def _itl_points(times: list[float]):
    return [(a, b, b) for a, b in zip(times, times[1:])]


def run_generate_batch(model, work) -> dict:
    prompts = [p for p, _ in work]
    new = work[0][1].max_new_tokens
    config = GenerationConfig(
        max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    # The engine's KV budget and block size (unsized, it infers them from free memory).
    # transformers renamed block_size to page_size (5.24 warns on the old name)
    page = (
        "page_size"
        if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters
        else "block_size"
    )
    batching = ContinuousBatchingConfig(num_blocks=NUM_BLOCKS, **{page: BLOCK_SIZE})
    model.set_attn_implementation("sdpa")
    model.generate_batch(
        inputs=[prompts[0][:8]],
        generation_config=config,
        continuous_batching_config=batching,
        progress_bar=False,
    )
    synchronize(model)
    start = time.perf_counter()
    results = model.generate_batch(
        inputs=prompts,
        generation_config=config,
        continuous_batching_config=batching,
        record_timestamps=True,
        progress_bar=False,
    )
    synchronize(model)
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


def run_generate(model, work) -> dict:
    """transformers' generate() on the whole batch at once, left-padded, greedy, with its
    default cache: the reference the engine's greedy outputs must equal."""
    prompts = [p for p, _ in work]
    new = work[0][1].max_new_tokens
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    model.set_attn_implementation("sdpa")
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(ids[:1, -8:].to(device), max_new_tokens=2, **kwargs)  # warm up
    synchronize(model)
    start = time.perf_counter()
    out = model.generate(
        ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, **kwargs
    )
    synchronize(model)
    elapsed = time.perf_counter() - start
    generated = out[:, width:].tolist()
    return summarize(
        GENERATE,
        work,
        elapsed,
        sum(len(g) for g in generated),
        [],
        [],
        {"prompt_tokens": sum(len(p) for p in prompts), "outputs": generated},
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
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--workloads", default="A,B,C")
    parser.add_argument("--modes", default="offline,poisson")
    parser.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated, of {[*CONFIGS, *CUDA_CONFIGS, *BASELINES]} "
        "(default: all that apply to the device)",
    )
    parser.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=CHUNK_TOKENS,
        help="the per-step token budget of the chunked-prefill configs",
    )
    parser.add_argument("--json", default="results/bench_serving.json")
    parser.add_argument("--plot", default="results/bench_serving.png")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    model = build_model(args.quick).to(args.device)
    vocab = model.config.vocab_size
    builders = {"A": workload_a, "B": workload_b, "C": workload_c}
    engine_configs = {**CONFIGS, **(CUDA_CONFIGS if args.device == "cuda" else {})}
    known = [*engine_configs, *BASELINES]
    configs = known if args.configs is None else [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in known]
    if unknown:
        parser.error(f"unknown --configs {unknown} for --device {args.device}; known: {known}")
    bad_workloads = [w for w in args.workloads.split(",") if w not in builders]
    if bad_workloads:
        parser.error(f"unknown --workloads {bad_workloads}; known: {list(builders)}")
    rows = []
    for workload in args.workloads.split(","):
        work = builders[workload](vocab, args.quick)
        for mode in args.modes.split(","):
            rate = args.rate or (64.0 if args.quick else 4.0)
            arrivals = [0.0] * len(work) if mode == "offline" else poisson_arrivals(len(work), rate)
            label = "offline" if mode == "offline" else f"Poisson {rate:g}/s"
            for name in configs:
                if name in BASELINES:
                    # transformers' batching takes neither arrival times nor per-request params
                    if mode != "offline" or not is_uniform_greedy(work):
                        continue
                    run = run_generate_batch if name == GENERATE_BATCH else run_generate
                    row = run(model, work)
                else:
                    row = run_engine(
                        model,
                        work,
                        arrivals,
                        name,
                        engine_configs[name],
                        args.max_num_batched_tokens,
                    )
                row.update(workload=workload, arrivals=label)
                rows.append(row)
                print(f"  done: {workload} {label} {name}", flush=True)
    check_greedy_outputs(rows)
    print_table(rows)
    for row in rows:
        if "greedy_matching" in row:
            print(
                f"workload {row['workload']}, {row['config']}: greedy outputs equal "
                f"generate(): {row['greedy_matching']}/{row['requests']}"
            )
    result = {
        "machine": {
            "platform": platform.platform(),
            "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        },
        "model": QUICK_MODEL if args.quick else MODEL,
        "block_size": BLOCK_SIZE,
        "num_blocks": NUM_BLOCKS,
        "max_num_seqs": MAX_NUM_SEQS,
        "chunk_tokens": args.max_num_batched_tokens,
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
