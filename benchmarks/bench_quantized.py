"""Offline generation speed and resident memory of SmolLM2 with float weights (``--weights bf16``,
or ``fp32``, the default dtype on a CPU without native bfloat16 products) against
``--weights auto`` (the GGUF's Q4_1 blocks as quantized layers) through each quantized kernel
(``PAGED_ATTENTION_QUANTIZED_KERNEL=int4pack``, torch's, and ``gguf``, the op's AVX512-VNNI or
AVX2 variant; on a CPU with neither the gguf rows run its slow portable loop), alternating
A B C A B C.

Each measurement runs in a fresh process (so its resident memory is that model's alone): it
loads the model, records its resident set size, then generates 64 greedy tokens for 1 request
and for 32 requests (the demo's questions through the chat template; the end-of-sequence token
is replaced by one the answers never produce, so every answer runs all 64 tokens) and reports
generated tokens per second, prefill included.

A configuration with ``+compile`` (``gguf+compile``) runs its decode steps compiled
(``compile=True``, through the compile cache of ``paged-attention serve --compile``: the first
round compiles and caches them, the later ones load them), each batch in an engine of that many
sequences, its steps compiled or loaded before the clock starts (``compile_s``: the seconds
the engine took to build, that included;
``dynamo_s`` and ``aot_s``: of them, dynamo's and AOTAutograd's tracing; ``aot_cache``: how
AOTAutograd's cache answered).

    python benchmarks/bench_quantized.py --rounds 2 --json docs/results/bench_quantized.json
    python benchmarks/bench_quantized.py --configs gguf,gguf+compile --batches 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from paged_attention.ops.cpu_info import cpu_identity

TOKENS = 64
BATCHES = (1, 32)
CONFIGS = {
    "bf16": ("bf16", None),
    "fp32": ("fp32", None),
    "int4pack": ("auto", "int4pack"),
    "gguf": ("auto", "gguf"),
}
"""A configuration's name: its ``--weights`` and its quantized kernel."""


def resident_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(config: str, threads: int, batches: tuple[int, ...] = BATCHES) -> dict:
    import torch

    from paged_attention.cli.demo import QUESTIONS
    from paged_attention.engine import SamplingParams
    from paged_attention.modeling.models import load_model

    base, _, compiled = config.partition("+")
    weights, kernel = CONFIGS[base]
    if kernel is not None:
        os.environ["PAGED_ATTENTION_QUANTIZED_KERNEL"] = kernel
    torch.set_num_threads(threads)
    started = time.perf_counter()
    model, tokenizer = load_model("smollm2", weights=weights)
    result = {"config": config, "weights": weights, "load_s": time.perf_counter() - started}
    result["rss_mb"] = resident_mb()
    never = model.config.vocab_size - 1
    for batch in batches:
        prompts = [
            [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(batch)
        ]
        building = time.perf_counter()
        engine = build_engine(model, tokenizer, never, batch if compiled else None, weights)
        if compiled:
            result[f"compile_s_{batch}"] = time.perf_counter() - building
            result.update({f"{k}_{batch}": v for k, v in compile_breakdown().items()})
        engine.generate(prompts[:1], SamplingParams(max_new_tokens=4))  # warm up
        started = time.perf_counter()
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=TOKENS))
        seconds = time.perf_counter() - started
        generated = sum(len(output.outputs[0]) for output in outputs)
        result[f"tok_s_{batch}"] = generated / seconds
        model.set_attn_implementation("sdpa")
    return result


def compile_breakdown() -> dict:
    """Seconds dynamo traced and AOTAutograd traced (or loaded) the compiled steps so far in
    this process, and how AOTAutograd's cache answered (``hit``, ``miss``, ``bypass``)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    aot = counters["aot_autograd"]
    return {
        "dynamo_s": sum(compilation_time_metrics.get("bytecode_tracing", [])),
        "aot_s": sum(compilation_time_metrics.get("create_aot_dispatcher_function", [])),
        "aot_cache": ",".join(k.removeprefix("autograd_cache_") for k in aot if "cache_" in k),
    }


def build_engine(model, tokenizer, never: int, compiled_batch: int | None, weights: str):
    """An engine over ``model``; with ``compiled_batch``, of that many sequences, its decode
    steps compiled through the compile cache (loaded from it when warm)."""
    from paged_attention.engine import Engine
    from paged_attention.engine.compile_cache import (
        CompileCache,
        CompileKey,
        compile_decode_steps,
    )
    from paged_attention.engine.model_runner import CompiledDecode

    options = dict(tokenizer=tokenizer, num_blocks=1024, eos_token_id=never)
    if compiled_batch is None:
        return Engine(model, **options)
    engine = Engine(model, max_num_seqs=compiled_batch, compile=True, **options)
    sizes = CompiledDecode.sizes_for(compiled_batch)
    cache = CompileCache(CompileKey.of("smollm2", model, weights, sizes))
    compile_decode_steps(engine, cache, lambda line: print(line, file=sys.stderr))
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help="of " + ", ".join(CONFIGS) + ", each also with +compile (gguf+compile)",
    )
    parser.add_argument(
        "--batches", default=",".join(map(str, BATCHES)), help="requests at once, per row"
    )
    parser.add_argument("--json", type=Path, help="write the rows and the machine here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = tuple(int(batch) for batch in args.batches.split(","))
    for config in args.configs.split(","):
        base, plus, suffix = config.partition("+")
        if base not in CONFIGS or (plus and suffix != "compile"):
            parser.error(f"--configs: unknown configuration {config!r}")
    if args.child:
        print(json.dumps(measure(args.child, args.threads, batches)))
        return
    rows = []
    load_before = Path("/proc/loadavg").read_text().strip()
    for _ in range(args.rounds):
        for config in args.configs.split(","):
            command = [sys.executable, __file__, "--child", config, "--threads", str(args.threads)]
            command += ["--batches", args.batches]
            out = subprocess.run(
                command, check=True, capture_output=True, text=True, env=os.environ
            )
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(
                json.dumps(
                    {k: round(v, 2) if isinstance(v, float) else v for k, v in rows[-1].items()}
                )
            )
    load_after = Path("/proc/loadavg").read_text().strip()
    print("loadavg", load_before, "->", load_after)
    if args.json:
        machine = {
            **cpu_identity(),
            "cores": os.cpu_count(),
            "threads": args.threads,
            "loadavg_before": load_before,
            "loadavg_after": load_after,
        }
        report = {"tokens": TOKENS, "machine": machine, "rows": rows}
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
