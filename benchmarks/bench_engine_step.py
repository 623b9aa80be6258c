"""The engine's own cost per step, one source tree against another in one run.

Two workloads, each run in a fresh Python process per tree so that every tree imports its own
``paged_attention`` (``PYTHONPATH`` set to the tree) and the trees alternate A B A B:

* ``tiny64``: the tiny random Llama (``paged_attention.testing.tiny_llama``), 64 requests of
  16 prompt tokens, 48 greedy new tokens each, eager; the time of every step in which all 64
  sequences decode, median and p90. The model is small, so this is the engine's overhead:
  scheduling, inputs, sampling, outputs.
* ``chat``: SmolLM2-135M-Instruct in bfloat16 (float weights in both trees), 32 chat
  questions formatted by its template, 64 greedy new tokens each, all at time 0: output tokens
  per second.

    python benchmarks/bench_engine_step.py --trees old=../old-tree,new=. [--rounds 2]
        [--workloads tiny64,chat] [--json docs/results/bench_engine_step.json]

``old-tree`` is a git worktree of the older commit with its extension built in place
(``git worktree add ../old-tree <commit> && cd ../old-tree && python setup.py build_ext
--inplace``). The JSON records the machine and the load average before and after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORKLOADS = ("tiny64", "chat")


def run_tiny64(quick: bool) -> dict:
    from paged_attention import testing  # every tree compared has it here
    from paged_attention.engine import Engine, SamplingParams

    num_seqs, new_tokens = (8, 8) if quick else (64, 48)
    engine = Engine(testing.tiny_llama(seed=0), num_blocks=num_seqs * 8, max_num_seqs=num_seqs)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    for i in range(num_seqs):
        engine.add_request([1 + (i * 7 + j) % 250 for j in range(16)], params)
    decode_steps = []
    while engine.has_unfinished():
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        if len(outputs) == num_seqs and all(len(o.outputs[0]) > 1 for o in outputs):
            decode_steps.append(elapsed)
    decode_steps.sort()
    return {
        "sequences": num_seqs,
        "decode_steps": len(decode_steps),
        "step_ms_median": 1e3 * statistics.median(decode_steps),
        "step_ms_p90": 1e3 * decode_steps[int(0.9 * (len(decode_steps) - 1))],
    }


def chat_questions(count: int) -> list[str]:
    topics = ["tea", "rivers", "prime numbers", "the moon", "bread", "chess", "owls", "rain"]
    return [
        f"In two sentences, what is interesting about {topics[i % 8]} (#{i})?" for i in range(count)
    ]


def model_loader():
    """``load_model`` of the tree being measured: the trees compared keep it in different
    modules (a flat package, then the layered one)."""
    import importlib

    for module in ("modeling.models", "models"):
        try:
            return importlib.import_module(f"paged_attention.{module}").load_model
        except ModuleNotFoundError:
            continue
    raise SystemExit("this tree has no load_model")


def run_chat(quick: bool) -> dict:
    import torch

    from paged_attention.engine import Engine, SamplingParams

    load_model = model_loader()
    count, new_tokens = (4, 8) if quick else (32, 64)
    model, tokenizer = load_model("tiny" if quick else "smollm2", dtype=torch.bfloat16)
    # No end tokens (the older trees have no ignore_eos): every request makes all its tokens.
    engine = Engine(
        model, num_blocks=count * 16, max_num_seqs=count, tokenizer=tokenizer, eos_token_id=[]
    )
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    prompts = []
    for question in chat_questions(count):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0]) for o in outputs)
    return {"requests": count, "generated": generated, "tok_per_s": generated / elapsed}


def child(workload: str, quick: bool) -> None:
    import torch

    torch.manual_seed(0)
    result = run_tiny64(quick) if workload == "tiny64" else run_chat(quick)
    print(json.dumps(result))


def load_average() -> float:
    return os.getloadavg()[0]


def run_tree(name: str, tree: str, workload: str, quick: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    command = [sys.executable, str(Path(__file__).resolve()), "--child", workload]
    if quick:
        command.append("--quick")
    before = load_average()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{name} ({tree}) {workload} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "tree": name,
        "workload": workload,
        **result,
        "load_before": before,
        "load_after": load_average(),
    }


def parse_trees(text: str) -> list[tuple[str, str]]:
    trees = []
    for item in text.split(","):
        name, sep, path = item.partition("=")
        if not sep or not name or not Path(path, "paged_attention").is_dir():
            raise SystemExit(f"--trees: {item!r} is not NAME=PATH of a source tree")
        trees.append((name, path))
    return trees


def print_table(rows: list[dict]) -> None:
    print(f"{'workload':8} {'tree':6} {'round':>5} {'result':>24} {'load':>11}")
    for row in rows:
        if row["workload"] == "tiny64":
            result = f"{row['step_ms_median']:.2f} ms (p90 {row['step_ms_p90']:.2f})"
        else:
            result = f"{row['tok_per_s']:.1f} tok/s"
        load = f"{row['load_before']:.1f}->{row['load_after']:.1f}"
        print(f"{row['workload']:8} {row['tree']:6} {row['round']:>5} {result:>24} {load:>11}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", default="new=.", help="NAME=PATH,... (alternated A B A B)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the tests)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", choices=WORKLOADS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.quick)
        return
    workloads = [w for w in args.workloads.split(",") if w]
    if not workloads or any(w not in WORKLOADS for w in workloads):
        raise SystemExit(f"--workloads: choose from {', '.join(WORKLOADS)}")
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    trees = parse_trees(args.trees)
    rows = []
    for workload in workloads:
        for round_index in range(args.rounds):
            for name, tree in trees:
                rows.append({**run_tree(name, tree, workload, args.quick), "round": round_index})
    print_table(rows)
    if args.json:
        from paged_attention.cli.machine import machine_info

        Path(args.json).write_text(json.dumps({"machine": machine_info(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
