"""Offline generation speed and resident memory of SmolLM2 with ``--weights bf16`` against
``--weights auto`` (the GGUF's Q4_1 blocks as quantized layers), alternating A B A B.

Each measurement runs in a fresh process (so its resident memory is that model's alone): it
loads the model, records its resident set size, then generates 64 greedy tokens for 1 request
and for 32 requests (the demo's questions through the chat template; the end-of-sequence token
is replaced by one the answers never produce, so every answer runs all 64 tokens) and reports
generated tokens per second, prefill included.

    python benchmarks/bench_quantized.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TOKENS = 64
BATCHES = (1, 32)


def resident_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(weights: str, threads: int) -> dict:
    import torch

    from paged_attention.demo import QUESTIONS
    from paged_attention.engine import Engine, SamplingParams
    from paged_attention.models import load_model

    torch.set_num_threads(threads)
    started = time.perf_counter()
    model, tokenizer = load_model("smollm2", weights=weights)
    result = {"weights": weights, "load_s": time.perf_counter() - started, "rss_mb": resident_mb()}
    never = model.config.vocab_size - 1
    for batch in BATCHES:
        prompts = [
            [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(batch)
        ]
        engine = Engine(model, tokenizer=tokenizer, num_blocks=1024, eos_token_id=never)
        engine.generate(prompts[:1], SamplingParams(max_new_tokens=4))  # warm up
        started = time.perf_counter()
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=TOKENS))
        seconds = time.perf_counter() - started
        generated = sum(len(output.outputs[0]) for output in outputs)
        result[f"tok_s_{batch}"] = generated / seconds
        model.set_attn_implementation("sdpa")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=("bf16", "auto"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.threads)))
        return
    rows = []
    for _ in range(args.rounds):
        for weights in ("bf16", "auto"):
            command = [sys.executable, __file__, "--child", weights, "--threads", str(args.threads)]
            out = subprocess.run(
                command, check=True, capture_output=True, text=True, env=os.environ
            )
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(
                json.dumps(
                    {k: round(v, 2) if isinstance(v, float) else v for k, v in rows[-1].items()}
                )
            )
    print("loadavg", Path("/proc/loadavg").read_text().strip())


if __name__ == "__main__":
    main()
