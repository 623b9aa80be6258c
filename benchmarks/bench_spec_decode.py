"""Speculative decoding with n-gram drafts and with a draft model against plain decoding, on a
workload whose answers repeat their prompts: "repeat this code with a variable renamed".

SmolLM2-135M-Instruct in bfloat16 (float weights), greedy, no end tokens (every request makes
all its tokens), on the CPU. Each configuration (``plain``, ``ngram`` with ``k`` drafts per step
for each ``k`` of ``--k``) serves the same requests on a fresh engine over the same model; the
configurations alternate A B A B over ``--rounds``. ``draft k=...`` drafts with a second model
instead (``--draft-weights``: by default the same model as shipped, SmolLM2's Q4_1 GGUF layers,
drafting for the bfloat16 model; ``--draft-k ''`` leaves it out). Two batch shapes: ``single``
(the requests one after another, batch 1: where speculation pays most, as a decode step's cost
is reading the weights) and ``batch`` (all requests at once). Reported: output tokens per
second, steps, the draft acceptance rate (accepted / drafted), and how many requests got exactly
the plain run's tokens.

    python benchmarks/bench_spec_decode.py [--k 3,5] [--draft-k 3] [--rounds 2]
        [--requests 4] [--new-tokens 96] [--json docs/results/bench_spec_decode.json]

The JSON records the machine (``paged_attention.cli.machine``) and the load average before and
after each run (the machine may be shared: other work skews timings).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

SNIPPETS = [
    (
        "total",
        "def add_prices(items):\n    total = 0\n    for item in items:\n"
        "        total = total + item.price * item.quantity\n    if total > 100:\n"
        "        total = total * 0.9\n    return total\n",
        "amount",
    ),
    (
        "count",
        "def count_words(text):\n    count = {}\n    for word in text.split():\n"
        "        word = word.lower().strip('.,!?')\n        count[word] = count.get(word, 0) + 1\n"
        "    return count\n",
        "frequencies",
    ),
    (
        "result",
        "def flatten(nested):\n    result = []\n    for part in nested:\n"
        "        if isinstance(part, list):\n            result.extend(flatten(part))\n"
        "        else:\n            result.append(part)\n    return result\n",
        "flat",
    ),
    (
        "best",
        "def longest_line(path):\n    best = ''\n    with open(path) as handle:\n"
        "        for line in handle:\n            if len(line) > len(best):\n"
        "                best = line.rstrip()\n    return best\n",
        "longest",
    ),
]


def code_edit_prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` chat prompts asking to repeat a function with a variable renamed."""
    prompts = []
    for i in range(count):
        old, code, new = SNIPPETS[i % len(SNIPPETS)]
        question = (
            f"Repeat the following Python code exactly, with the variable `{old}` renamed to "
            f"`{new}`. Answer with the code only.\n\n```python\n{code}```"
        )
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def speculative_config(k: int | None, draft) -> dict | None:
    """The engine's speculative decoding: off, n-gram drafts, or ``draft``'s drafts."""
    if k is None:
        return None
    if draft is not None:
        return {"method": "draft_model", "draft_model": draft, "num_speculative_tokens": k}
    return {"num_speculative_tokens": k, "prompt_lookup_max": 4}


def serve(model, tokenizer, prompts, new_tokens: int, speculative: dict | None, shape) -> dict:
    """One configuration over ``prompts`` on a fresh engine; its tokens, speed and drafts."""
    from paged_attention.engine import Engine, SamplingParams

    engine = Engine(
        model,
        num_blocks=len(prompts) * ((max(map(len, prompts)) + new_tokens) // 16 + 2),
        max_num_seqs=len(prompts),
        tokenizer=tokenizer,
        eos_token_id=[],
        speculative=speculative,
    )
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    start = time.perf_counter()
    if shape == "single":
        outputs = [engine.generate([p], params)[0] for p in prompts]
    else:
        outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    stats = engine.stats
    generated = sum(len(o.outputs[0]) for o in outputs)
    return {
        "tokens": [o.outputs[0] for o in outputs],
        "generated": generated,
        "seconds": elapsed,
        "tok_per_s": generated / elapsed,
        "steps": stats.steps,
        "drafted": stats.draft_tokens,
        "accepted": stats.accepted_draft_tokens,
        "acceptance_rate": stats.draft_acceptance_rate,
    }


def run(args, model, tokenizer, draft=None) -> list[dict]:
    prompts = code_edit_prompts(tokenizer, args.requests)
    configs = [("plain", None, None)] + [(f"ngram k={k}", k, None) for k in args.k]
    configs += [(f"draft k={k}", k, draft) for k in args.draft_k]
    rows, plain_tokens = [], {}
    for shape in args.shapes:
        for round_index in range(args.rounds):
            for name, k, drafter in configs:
                before = os.getloadavg()[0]
                speculative = speculative_config(k, drafter)
                result = serve(model, tokenizer, prompts, args.new_tokens, speculative, shape)
                tokens = result.pop("tokens")
                if k is None:  # plain runs first in every round
                    plain_tokens.setdefault(shape, tokens)
                same = sum(a == b for a, b in zip(tokens, plain_tokens[shape]))
                rows.append(
                    {
                        "shape": shape,
                        "config": name,
                        "round": round_index,
                        "requests": len(prompts),
                        "prompt_tokens": sum(map(len, prompts)),
                        **result,
                        "same_tokens_as_plain": same,
                        "load_before": before,
                        "load_after": os.getloadavg()[0],
                    }
                )
                print(
                    f"{shape} round {round_index} {name}: {result['tok_per_s']:.1f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        f"{'shape':6} {'config':10} {'round':>5} {'tok/s':>7} {'steps':>5} {'accepted':>14} "
        f"{'same':>5} {'load':>9}"
    )
    for row in rows:
        rate = row["acceptance_rate"]
        accepted = "-" if rate is None else f"{row['accepted']}/{row['drafted']} {rate:.0%}"
        same = f"{row['same_tokens_as_plain']}/{row['requests']}"
        load = f"{row['load_before']:.1f}->{row['load_after']:.1f}"
        print(
            f"{row['shape']:6} {row['config']:10} {row['round']:>5} {row['tok_per_s']:7.1f} "
            f"{row['steps']:>5} {accepted:>14} {same:>5} {load:>9}"
        )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", default="3,5", help="drafts per step of each ngram run")
    parser.add_argument(
        "--draft-k", default="3", help="drafts per step of each draft-model run ('' for none)"
    )
    parser.add_argument(
        "--draft-weights",
        default="auto",
        choices=("auto", "q4", "q8", "bf16", "fp32"),
        help="the draft model: --model loaded with these weights (auto: as shipped)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--shapes", default="single,batch")
    parser.add_argument("--model", default="smollm2", help="'tiny' for the tests")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    try:
        args.k = [int(k) for k in args.k.split(",") if k]
    except ValueError:
        parser.error(f"--k: comma-separated integers, got {args.k!r}")
    if not args.k or min(args.k) < 1:
        parser.error("--k: at least one number of drafts, each >= 1")
    try:
        args.draft_k = [int(k) for k in args.draft_k.split(",") if k]
    except ValueError:
        parser.error(f"--draft-k: comma-separated integers, got {args.draft_k!r}")
    if args.draft_k and min(args.draft_k) < 1:
        parser.error("--draft-k: numbers of drafts, each >= 1")
    args.shapes = [s for s in args.shapes.split(",") if s]
    if not args.shapes or any(s not in ("single", "batch") for s in args.shapes):
        parser.error("--shapes: choose from single, batch")
    for name in ("rounds", "requests", "new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    from paged_attention.modeling.models import load_model

    torch.manual_seed(0)
    model, tokenizer = load_model(args.model, dtype=torch.bfloat16)
    draft = None
    if args.draft_k:
        draft, _ = load_model(args.model, dtype=torch.bfloat16, weights=args.draft_weights)
    rows = run(args, model, tokenizer, draft)
    print_table(rows)
    if args.json:
        from paged_attention.cli.machine import machine_info

        record = {
            "machine": machine_info(),
            "model": args.model,
            "draft_weights": args.draft_weights if args.draft_k else None,
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
