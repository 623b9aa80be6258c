"""Serving benchmark: the engine beside transformers' own continuous batching
(``generate_batch()``) and a padded ``generate()``, on the same model and prompts.

Chat workloads, on a real model (``--model``, default SmolLM2-135M-Instruct; ``tiny`` or any
name ``paged_attention.modeling.models.load_model`` takes), in every ``--dtypes`` (default bfloat16
and float32):

* ``chat``: ``--requests`` (default 32 and 64) concurrent chat requests, each a distinct
  question formatted by the tokenizer's chat template, ``--new-tokens`` (64) greedy new tokens
  each, all arriving at time 0;
* ``single``: one chat request alone (``--single-tokens``, 128 new tokens), and the time of its
  decode steps split, under ``torch.profiler``, into the model's linear layers, the attention
  op, the model's other ops and the rest (Python: the model's code, the engine's scheduling,
  metadata and sampling).

Each runs on the engine eagerly (``engine``) and with compiled decode steps
(``engine compiled``: ``Engine(compile=True)``; each padded batch size is compiled by a
warm-up before the timed runs, and the compile times are reported), and on transformers'
``generate_batch()`` and padded ``generate()`` (``generate()`` alone for ``single``).

Token-id workloads on a random Llama (8 layers, hidden 512, 8 query / 2 KV heads of 64, fixed
seed, fp32; ``--quick``: 2 layers, hidden 128), large enough that attention and the KV cache
matter, comparing the engine with prefix caching and chunked prefill on and off:

* A: 64 requests sharing a 512-token system prompt, each with its own 32-256-token question,
  128 new tokens each, greedy;
* B: the demo's mix (``paged_attention.cli.demo.default_workload``: prompts of 8-96 tokens, half
  with a 48-token system prompt, greedy, parallel sampling and beam search);
* C: the demo's prompts, every request greedy with 64 new tokens.

A, B and C run offline (every request at time 0) and with Poisson arrivals at a fixed rate.

Reported per run: generated tokens per second (wall time from the first arrival to the last
token), time to first token and inter-token latency p50/p99, prompt tokens computed (the rest
came from the prefix cache), peak KV blocks. Every engine run generates exactly its
``max_new_tokens`` per sequence (no EOS), so throughputs compare like for like. transformers'
batching runs the all-greedy workloads offline only (it takes neither arrival times nor
per-request sampling parameters); the engine's greedy outputs are compared token for token with
the padded ``generate()``'s (in bfloat16 a padded batch rounds differently from one sequence, so
some outputs part after a while). ``--device cuda`` adds an engine row with CUDA graphs off
(they are on by default there). The JSON records the machine: CPU model, its vector and matrix
extensions, threads and the load average.

    python benchmarks/bench_serving.py [--workloads chat,single,A,B,C] [--model smollm2]
        [--dtypes bfloat16,float32] [--requests 32,64] [--configs ...] [--quick]
        [--device cpu|cuda] [--modes offline,poisson] [--max-num-batched-tokens 256]
        [--json results/bench_serving.json] [--plot results/bench_serving.png]

(with the package installed, or ``PYTHONPATH=.`` from the repository root).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import resource
import time

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from paged_attention.cli.demo import default_workload
from paged_attention.cli.machine import describe_machine, machine_info
from paged_attention.engine import Engine, SamplingParams
from paged_attention.modeling.models import DTYPE_NAMES as DTYPES
from paged_attention.modeling.models import MODEL_HELP, load_model
from paged_attention.modeling.tiny import tiny_llama_config

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
CHAT_NUM_BLOCKS = 768  # 64 chat requests of up to ~90 prompt + 64 new tokens, with room
MAX_NUM_SEQS = 64
CHUNK_TOKENS = 256  # max_num_batched_tokens with chunked prefill on (--max-num-batched-tokens)
CONFIGS = {
    "prefix cache + chunked prefill": dict(enable_prefix_caching=True, chunked=True),
    "prefix cache": dict(enable_prefix_caching=True, chunked=False),
    "chunked prefill": dict(enable_prefix_caching=False, chunked=True),
    "neither": dict(enable_prefix_caching=False, chunked=False),
}
# On CUDA, decode steps replay CUDA graphs by default; this row runs them eagerly.
NO_GRAPHS = "prefix cache + chunked prefill without CUDA graphs"
CUDA_CONFIGS = {NO_GRAPHS: dict(enable_prefix_caching=True, chunked=True, cuda_graphs=False)}
ENGINE = "engine"
COMPILED = "engine compiled"
CHAT_CONFIGS = {ENGINE: dict(compile=False), COMPILED: dict(compile=True)}
GENERATE_BATCH = "transformers generate_batch()"
GENERATE = "transformers generate()"
BASELINES = (GENERATE_BATCH, GENERATE)
TOKEN_WORKLOADS = ("A", "B", "C")
CHAT_WORKLOADS = ("chat", "single")
# Chat questions: every template with every topic gives distinct prompts of similar length.
QUESTIONS = (
    "What is {}? Explain it in a few sentences.",
    "Give me three interesting facts about {}.",
    "Write a short poem about {}.",
    "How would you explain {} to a ten-year-old?",
    "What are the most common misconceptions about {}?",
    "Summarize the history of {} in one paragraph.",
    "Why does {} matter in everyday life?",
    "Write a haiku about {}.",
)
TOPICS = (
    "photosynthesis",
    "the Moon",
    "volcanoes",
    "the French Revolution",
    "black holes",
    "honey bees",
    "the printing press",
    "rainbows",
    "the human heart",
    "the Roman Empire",
    "electricity",
    "coral reefs",
    "the Internet",
    "glaciers",
    "chess",
    "the Pacific Ocean",
    "vaccines",
    "the Eiffel Tower",
    "DNA",
    "thunderstorms",
)


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


def chat_questions(count: int, offset: int = 0) -> list[str]:
    """``count`` distinct questions (``offset`` skips the first ones: runs on one engine get
    prompts of their own, so none is served from the prefix cache a previous run filled)."""
    if offset + count > len(QUESTIONS) * len(TOPICS):
        raise ValueError(f"only {len(QUESTIONS) * len(TOPICS)} distinct chat questions")
    return [
        QUESTIONS[i % len(QUESTIONS)].format(TOPICS[i // len(QUESTIONS)])
        for i in range(offset, offset + count)
    ]


def chat_prompt_ids(tokenizer, questions: list[str]) -> list[list[int]]:
    """Each question as one user message through the tokenizer's chat template, with the
    generation prompt."""
    prompts = []
    for question in questions:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


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


def token_workload_engine(model, config, chunk_tokens) -> Engine:
    return Engine(
        model,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=chunk_tokens if config["chunked"] else None,
        enable_prefix_caching=config["enable_prefix_caching"],
        eos_token_id=[],
        cuda_graphs=config.get("cuda_graphs"),
    )


def chat_engine(model, config) -> Engine:
    """No swap space: the chat workloads fit the KV budget (and four times it in host memory
    would be wasted)."""
    return Engine(
        model,
        num_blocks=CHAT_NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        num_host_blocks=0,
        max_num_seqs=MAX_NUM_SEQS,
        eos_token_id=[],
        **config,
    )


def warm_up(engine, prompt: list[int], batch_sizes) -> dict[int, float]:
    """Runs a step of every decode batch size in ``batch_sizes`` (copies of a prompt the timed
    runs do not use: they start with a cold prefix cache but for the chat template's shared
    start); returns the seconds each size's first decode step took (its compile time when
    decode steps are compiled)."""
    compiled = getattr(engine.runner.graphs, "compile_seconds", None)
    seconds = {}
    for size in batch_sizes:
        started = time.perf_counter()
        engine.generate([prompt] * size, SamplingParams(2))
        seconds[size] = (
            compiled.get(next(s for s in engine.runner.graphs.sizes if s >= size))
            if compiled is not None
            else time.perf_counter() - started
        )
    engine.stats.__init__()
    return seconds


def run_engine(engine, model, work, arrivals, name) -> dict:
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
    row = summarize(
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
    engine.stats.__init__()
    return row


def check_greedy_outputs(rows: list[dict]) -> None:
    """For every engine run of a workload that generate() also ran: how many outputs equal."""
    key = ("workload", "dtype", "requests", "arrivals")
    reference = {tuple(r[k] for k in key): r["outputs"] for r in rows if r["config"] == GENERATE}
    for row in rows:
        want = reference.get(tuple(row[k] for k in key))
        if want is not None and row["config"] not in BASELINES:
            row["greedy_matching"] = sum(a == b for a, b in zip(row["outputs"], want))


def _itl_points(times: list[float]):
    return [(a, b, b) for a, b in zip(times, times[1:])]


def run_generate_batch(model, work, num_blocks) -> dict:
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
    batching = ContinuousBatchingConfig(num_blocks=num_blocks, **{page: BLOCK_SIZE})
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
    default cache (one request: no padding). It records no per-token times: TTFT and ITL are
    n/a."""
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


# --------------------------------------------------------------------------------------------
# One request alone: where a decode step's time goes

# Self time of these profiler events is the model's linear layers (eager: aten matrix
# products; the compiled step's prepacked products run from its C++ wrapper, unseen).
LINEAR_EVENTS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear", "mkl::_mkl_linear")
ATTENTION_EVENTS = ("paged_attention::",)
SPANS = ("Torch-Compiled Region", "## Call CompiledFxGraph")  # around work, not work
SPLIT_PARTS = (
    ("linear_ms", "linear layers"),
    ("attention_ms", "attention"),
    ("other_ops_ms", "other ops"),
    ("rest_of_forward_ms", "rest of the forward"),
    ("engine_ms", "engine (scheduling, sampling)"),
)


def decode_step_split(engine, prompt: list[int], new_tokens: int) -> dict:
    """Serves ``prompt`` alone: its prompt step untimed, then its decode steps under
    ``torch.profiler``. Per decode step (ms): the wall time; the time in the model runner (the
    forward pass, with its metadata or static-buffer copies); of that, the self time of the
    linear layers' ops, of the attention op and of every other op the profiler sees; the rest
    of the forward (the model's Python code around its ops; in a compiled step, whose kernels
    run from a C++ wrapper the profiler does not see, the linear layers and fused kernels
    too); and the engine outside the forward (scheduling, sampling, outputs). The profiler's
    own cost per event inflates the Python shares a little."""
    from torch.profiler import ProfilerActivity, profile

    engine.add_request(prompt, SamplingParams(new_tokens))
    engine.step()  # the prompt
    runner, forward = engine.runner, [0.0]
    run = runner.run

    def timed_run(*args, **kwargs):
        started = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            forward[0] += time.perf_counter() - started

    runner.run = timed_run
    steps = 0
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
                steps += 1
            wall = time.perf_counter() - started
    finally:
        del runner.run
    engine.stats.__init__()
    linear = attention = other = 0.0
    for event in prof.key_averages():
        if event.key.startswith(SPANS):
            continue
        seconds = event.self_cpu_time_total / 1e6
        if event.key.startswith(LINEAR_EVENTS):
            linear += seconds
        elif event.key.startswith(ATTENTION_EVENTS):
            attention += seconds
        else:
            other += seconds
    per_step = 1000 / steps
    return {
        "decode_steps": steps,
        "step_ms": wall * per_step,
        "forward_ms": forward[0] * per_step,
        "linear_ms": linear * per_step,
        "attention_ms": attention * per_step,
        "other_ops_ms": other * per_step,
        "rest_of_forward_ms": (forward[0] - linear - attention - other) * per_step,
        "engine_ms": (wall - forward[0]) * per_step,
    }


# --------------------------------------------------------------------------------------------
# Output


def print_table(rows: list[dict]) -> None:
    header = (
        "| workload | dtype | arrivals | config | tokens/s | TTFT p50 / p99 | ITL p50 / p99 | "
        "prompt tokens computed | peak KV blocks |"
    )
    print(header)
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        computed, total = row.get("prompt_tokens_computed"), row["prompt_tokens"]
        computed_text = (
            "n/a" if computed is None else f"{computed} of {total} ({100 * computed / total:.0f}%)"
        )
        ttft = f"{_fmt(row['ttft_p50_ms'])} / {_fmt(row['ttft_p99_ms'])}"
        itl = f"{_fmt(row['itl_p50_ms'])} / {_fmt(row['itl_p99_ms'])}"
        print(
            f"| {row['workload']} ({row['requests']}) | {row['dtype']} | {row['arrivals']} | "
            f"{row['config']} | {row['tokens_per_s']:.0f} | {ttft} | {itl} | {computed_text} | "
            f"{row.get('peak_blocks', 'n/a')} |"
        )


def print_step_splits(rows: list[dict]) -> None:
    split_rows = [r for r in rows if "step_split" in r]
    if not split_rows:
        return
    print("\nOne request alone, per decode step (ms):")
    print(
        "| dtype | config | step | linear layers | attention | other ops | rest of the forward "
        "| engine |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in split_rows:
        parts = [row["step_split"][key] for key, _ in SPLIT_PARTS]
        print(
            f"| {row['dtype']} | {row['config']} | {row['step_split']['step_ms']:.1f} | "
            + " | ".join(f"{ms:.1f}" for ms in parts)
            + " |"
        )


def _fmt(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms"


def plot(rows: list[dict], path: str) -> None:
    """Tokens/s of every chat run (grouped by workload, dtype and request count), the single
    request's step split, and the inter-token latency over time of the token-id workloads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chat = [r for r in rows if r["workload"] in CHAT_WORKLOADS]
    splits = [r for r in rows if "step_split" in r]
    panels = sorted(
        {(r["workload"], r["arrivals"]) for r in rows if r.get("itl_timeline")}
        - {(w, "offline") for w in CHAT_WORKLOADS}
    )
    count = bool(chat) + bool(splits) + len(panels)
    fig, axes = plt.subplots(count, 1, figsize=(9, 3.4 * count), squeeze=False)
    axes = list(axes[:, 0])
    if chat:
        ax = axes.pop(0)
        groups = sorted({(r["workload"], r["dtype"], r["requests"]) for r in chat})
        configs = list(dict.fromkeys(r["config"] for r in chat))
        width = 0.8 / len(configs)
        for i, config in enumerate(configs):
            values = [
                next(
                    (
                        r["tokens_per_s"]
                        for r in chat
                        if (r["workload"], r["dtype"], r["requests"]) == g and r["config"] == config
                    ),
                    0,
                )
                for g in groups
            ]
            ax.bar([x + i * width for x in range(len(groups))], values, width, label=config)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))])
        ax.set_xticklabels([f"{w} {n}\n{d}" for w, d, n in groups], fontsize=8)
        ax.set_ylabel("generated tokens/s")
        ax.set_title("chat requests: throughput")
        ax.legend(fontsize=7)
    if splits:
        ax = axes.pop(0)
        labels = [f"{r['dtype']}\n{r['config']}" for r in splits]
        bottom = [0.0] * len(splits)
        for key, label in SPLIT_PARTS:
            values = [r["step_split"][key] for r in splits]
            ax.bar(labels, values, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_ylabel("ms per decode step")
        ax.set_title("one request alone: a decode step's time")
        ax.tick_params(axis="x", labelsize=7)
        ax.legend(fontsize=7)
    for ax, (workload, arrivals) in zip(axes, panels):
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


# --------------------------------------------------------------------------------------------
# The runs


def run_chat_workloads(args, workloads, configs) -> list[dict]:
    """Every chat workload in every dtype: one engine per (dtype, config), warmed up for the
    batch sizes it will see, then the timed runs on prompts none of them has seen."""
    rows = []
    new_tokens = 8 if args.quick else args.new_tokens
    single_tokens = 16 if args.quick else args.single_tokens
    counts = [int(n) for n in args.requests.split(",")] if "chat" in workloads else []
    for dtype in args.dtypes.split(","):
        model, tokenizer = load_model(args.model, dtype=dtype, device=args.device)
        if tokenizer is None:
            raise SystemExit(f"--model {args.model}: the chat workloads need a tokenizer")
        offset = 1  # question 0 warms up
        work = {}
        for count in counts:
            prompts = chat_prompt_ids(tokenizer, chat_questions(count, offset))
            work[("chat", count)] = [(p, SamplingParams(new_tokens)) for p in prompts]
            offset += count
        if "single" in workloads:
            (prompt,) = chat_prompt_ids(tokenizer, chat_questions(1, offset))
            work[("single", 1)] = [(prompt, SamplingParams(single_tokens))]
        warm_prompt = chat_prompt_ids(tokenizer, chat_questions(1))[0]
        for name in configs:
            if name in BASELINES:
                continue
            engine = chat_engine(model, CHAT_CONFIGS[name])
            compile_seconds = warm_up(engine, warm_prompt, sorted({n for _, n in work}))
            for (workload, count), requests in work.items():
                row = run_engine(engine, model, requests, [0.0] * count, name)
                row.update(workload=workload, dtype=dtype, arrivals="offline")
                row["first_step_seconds"] = compile_seconds
                if workload == "single":
                    row["step_split"] = decode_step_split(
                        engine, requests[0][0], requests[0][1].max_new_tokens
                    )
                rows.append(row)
                print(f"  done: {workload} {count} {dtype} {name}", flush=True)
            del engine
            gc.collect()
        for (workload, count), requests in work.items():
            for name in configs:
                if name not in BASELINES or (workload == "single" and name == GENERATE_BATCH):
                    continue
                if name == GENERATE_BATCH:
                    row = run_generate_batch(model, requests, CHAT_NUM_BLOCKS)
                else:
                    row = run_generate(model, requests)
                row.update(workload=workload, dtype=dtype, arrivals="offline")
                rows.append(row)
                print(f"  done: {workload} {count} {dtype} {name}", flush=True)
        del model
        gc.collect()
    return rows


def run_token_workloads(args, workloads, configs) -> list[dict]:
    """Workloads A, B and C on the random Llama, offline and with Poisson arrivals."""
    rows = []
    model = build_model(args.quick).to(args.device)
    vocab = model.config.vocab_size
    builders = {"A": workload_a, "B": workload_b, "C": workload_c}
    engine_configs = {**CONFIGS, **(CUDA_CONFIGS if args.device == "cuda" else {})}
    for workload in workloads:
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
                    if name == GENERATE_BATCH:
                        row = run_generate_batch(model, work, NUM_BLOCKS)
                    else:
                        row = run_generate(model, work)
                else:
                    engine = token_workload_engine(
                        model, engine_configs[name], args.max_num_batched_tokens
                    )
                    warm_up(engine, work[0][0][:8], [1])
                    row = run_engine(engine, model, work, arrivals, name)
                row.update(workload=workload, dtype="float32", arrivals=label)
                rows.append(row)
                print(f"  done: {workload} {label} {name}", flush=True)
    return rows


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models and workloads")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--workloads", default="chat,single", help="of chat, single, A, B, C")
    parser.add_argument(
        "--model", default="smollm2", help=f"the chat workloads' model: {MODEL_HELP}"
    )
    parser.add_argument(
        "--dtypes", default="bfloat16,float32", help=f"the chat workloads' dtypes, of {DTYPES}"
    )
    parser.add_argument("--requests", default="32,64", help="concurrent chat requests per run")
    parser.add_argument("--new-tokens", type=int, default=64, help="per chat request")
    parser.add_argument("--single-tokens", type=int, default=128, help="of the single request")
    parser.add_argument("--modes", default="offline,poisson", help="arrivals of A, B and C")
    parser.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated, of {[*CHAT_CONFIGS, *CONFIGS, *CUDA_CONFIGS, *BASELINES]} "
        "(default: all that apply to the workloads and the device)",
    )
    parser.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=CHUNK_TOKENS,
        help="the per-step token budget of the chunked-prefill configs",
    )
    parser.add_argument(
        "--merge",
        default=None,
        help="comma-separated JSON files of earlier runs: print and plot their rows together "
        "(with --json, written as one file), running nothing",
    )
    parser.add_argument("--json", default="results/bench_serving.json")
    parser.add_argument("--plot", default="results/bench_serving.png")
    return parser


def main() -> None:
    parser = argument_parser()
    args = parser.parse_args()
    if args.merge:
        runs = []
        for path in args.merge.split(","):
            with open(path) as f:
                runs.append(json.load(f))
        settings = [{k: v for k, v in run.items() if k != "rows"} for run in runs]
        report([row for run in runs for row in run["rows"]], {"runs": settings}, args)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in (*CHAT_WORKLOADS, *TOKEN_WORKLOADS)]
    if unknown:
        parser.error(f"unknown --workloads {unknown}; known: {[*CHAT_WORKLOADS, *TOKEN_WORKLOADS]}")
    bad_dtypes = [d for d in args.dtypes.split(",") if d not in DTYPES]
    if bad_dtypes:
        parser.error(f"unknown --dtypes {bad_dtypes}; known: {list(DTYPES)}")
    chat_configs = {**CHAT_CONFIGS} if args.device == "cpu" else {ENGINE: CHAT_CONFIGS[ENGINE]}
    engine_configs = {**CONFIGS, **(CUDA_CONFIGS if args.device == "cuda" else {})}
    known = [*chat_configs, *engine_configs, *BASELINES]
    chosen = None if args.configs is None else [c for c in args.configs.split(",") if c]
    unknown = [c for c in chosen or [] if c not in known]
    if unknown:
        parser.error(f"unknown --configs {unknown} for --device {args.device}; known: {known}")
    rows = []
    chat_workloads = [w for w in workloads if w in CHAT_WORKLOADS]
    if chat_workloads:
        configs = [c for c in (chosen or known) if c in chat_configs or c in BASELINES]
        rows += run_chat_workloads(args, chat_workloads, configs)
    token_workloads = [w for w in workloads if w in TOKEN_WORKLOADS]
    if token_workloads:
        configs = [c for c in (chosen or known) if c in engine_configs or c in BASELINES]
        rows += run_token_workloads(args, token_workloads, configs)
    check_greedy_outputs(rows)
    result = {
        "machine": machine_info(args.device),
        "chat_model": args.model if chat_workloads else None,
        "token_model": (QUICK_MODEL if args.quick else MODEL) if token_workloads else None,
        "block_size": BLOCK_SIZE,
        "max_num_seqs": MAX_NUM_SEQS,
        "chunk_tokens": args.max_num_batched_tokens,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    report(rows, result, args)


def report(rows: list[dict], result: dict, args) -> None:
    """The table, the step splits, the greedy checks and the compile times; the JSON (``result``
    with the rows) and the plot."""
    for machine in [result.get("machine")] + [run["machine"] for run in result.get("runs", [])]:
        if machine is not None:
            print(describe_machine(machine))
    print_table(rows)
    print_step_splits(rows)
    for row in rows:
        if "greedy_matching" in row:
            print(
                f"{row['workload']} ({row['requests']}) {row['dtype']} {row['arrivals']}, "
                f"{row['config']}: greedy outputs equal generate(): "
                f"{row['greedy_matching']}/{row['requests']}"
            )
    compile_times = {r["dtype"]: r["first_step_seconds"] for r in rows if r["config"] == COMPILED}
    for dtype, seconds in compile_times.items():
        times = ", ".join(f"{n}: {s:.0f} s" for n, s in seconds.items())
        print(f"{dtype}, compiled decode steps: first step (compiling) per batch size: {times}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({**result, "rows": rows}, f, indent=1)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
