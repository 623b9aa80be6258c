"""Seconds from starting ``python -m paged_attention serve`` to its first ``/health`` answer
(200) and to its first completion (one chat request for one token), on a model that is already
converted (run it once before, or the first round pays the conversion).

Each round starts a fresh server process on a free port, polls ``/health`` every 20 ms, then asks
for one completion and stops the server with SIGINT. Three times: the first answer of any kind
(a loading server answers 503), the first 200 of ``/health`` (the engine is ready), and the
first completion. ``--trees old=PATH,new=.`` alternates checkouts (each with its extension
built in place) round by round, A B A B. The rounds, their medians per tree, and the machine
(``paged_attention.cli.machine``) go to ``--json``.

    python benchmarks/bench_start.py --rounds 3 --json docs/results/bench_start.json

``--split`` times, instead, where the engine's side of such a start goes: in a fresh
interpreter per round, what ``serve``'s engine process does before it is ready, step by step
(each module ``serve`` imports before it forks the engine's process, ``load_model``, with a
warm compile cache the import of ``torch._inductor.graph`` that loading a compiled step begins
with, then ``serve.build_engine``: the steps loaded and the warm-up), on one core's critical
path as in ``serve`` (its HTTP side runs beside it, in the other process).

    python benchmarks/bench_start.py --split --rounds 3 -- --max-num-seqs 1 --max-n 1
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

POLL_SECONDS = 0.02


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str, body: dict | None = None, timeout: float = 2.0) -> int:
    """The status of a GET (or a POST of ``body``); 0 when nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0


def one_start(serve_args: list[str], timeout: float, tree: Path) -> dict:
    """One server start of the checkout ``tree``: seconds to the first answer of /health, to
    its first 200 and to the first completion."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "paged_attention", "serve", "--port", str(port), *serve_args]
    # run from the checkout: ``python -m`` puts the working directory first on the path
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
    started = time.perf_counter()
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tree.resolve(),
    )
    try:
        answer = health = None
        while time.perf_counter() - started < timeout:
            if process.poll() is not None:
                error = process.stderr.read()
                raise RuntimeError(f"serve exited with {process.returncode}: {error}")
            status = _get(url + "/health", timeout=1.0)
            if status and answer is None:
                answer = time.perf_counter() - started
            if status == 200:
                health = time.perf_counter() - started
                break
            time.sleep(POLL_SECONDS)
        if health is None:
            raise RuntimeError(f"no /health answer within {timeout} s")
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        status = _get(url + "/v1/chat/completions", chat, timeout=timeout)
        if status != 200:
            raise RuntimeError(f"the first completion answered {status}")
        first = time.perf_counter() - started
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return {"first_answer_s": answer, "health_s": health, "first_completion_s": first}


SPLIT_CHILD = """
import gc, importlib, json, sys, time
modules, serve_args = json.loads(sys.argv[1]), json.loads(sys.argv[2])
started = previous = time.perf_counter()
steps = {}
def step(name):
    global previous
    now = time.perf_counter()
    steps[name], previous = now - previous, now
gc.disable()  # as serve imports them
for name in modules:
    importlib.import_module(name)
    step("import " + name)
gc.freeze()
gc.enable()
import argparse
import torch
from paged_attention.cli import serve
from paged_attention.cli.arguments import decode_compile_cache
from paged_attention.modeling.models import load_model
parser = argparse.ArgumentParser()
serve.add_arguments(parser)
args = parser.parse_args(serve_args)
if args.threads:
    torch.set_num_threads(args.threads)
step("the command line")
model, tokenizer = load_model(
    args.model, dtype=args.dtype, device=args.device, weights=args.weights
)
step("load_model")
if decode_compile_cache(model, args, args.max_num_seqs, lambda line: None) is not None:
    importlib.import_module("torch._inductor.graph")
    step("import torch._inductor.graph")
serve.build_engine(model, tokenizer, args)
step("build_engine")
steps["total"] = time.perf_counter() - started
print(json.dumps(steps))
"""
"""The engine's side of a ``serve`` start, in steps: its JSON on the last line of stdout."""


def one_split(serve_args: list[str], tree: Path, modules: tuple[str, ...]) -> dict:
    """Seconds of each step of the engine's side of a start (:data:`SPLIT_CHILD`), in a fresh
    interpreter running the checkout ``tree``."""
    command = [sys.executable, "-c", SPLIT_CHILD, json.dumps(modules), json.dumps(serve_args)]
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tree.resolve())
    if done.returncode != 0:
        raise RuntimeError(f"the split exited with {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def split_medians(rows: list[dict]) -> dict[str, float]:
    """The median seconds of each step over ``rows``, in the steps' order."""
    names = list(dict.fromkeys(name for row in rows for name in row if name != "tree"))
    return {name: statistics.median(row[name] for row in rows if name in row) for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one start may take")
    parser.add_argument("--json", type=Path, help="write the rounds and the machine here")
    parser.add_argument(
        "--trees", default="new=.", help="name=checkout,... to alternate (default: this one)"
    )
    parser.add_argument(
        "serve_args", nargs="*", help="arguments for serve after --, e.g. -- --model tiny"
    )
    parser.add_argument(
        "--split",
        action="store_true",
        help="time the steps of the engine's side of a start instead (module docstring)",
    )
    args = parser.parse_args()
    trees = dict(item.split("=", 1) for item in args.trees.split(","))
    if args.split:
        from paged_attention.cli.serve import ENGINE_MODULES
    rows = []
    for _ in range(args.rounds):
        for name, path in trees.items():
            if args.split:
                measured = one_split(args.serve_args, Path(path), ENGINE_MODULES)
            else:
                measured = one_start(args.serve_args, args.timeout, Path(path))
            rows.append({"tree": name, **measured})
            print(
                json.dumps(
                    {k: round(v, 2) if isinstance(v, float) else v for k, v in rows[-1].items()}
                )
            )
    if args.split:
        medians = {name: split_medians([r for r in rows if r["tree"] == name]) for name in trees}
        for name, steps in medians.items():
            print(f"{name}: median seconds of {args.rounds} rounds")
            for step, seconds in steps.items():
                print(f"  {step:48s} {seconds:6.2f}")
    else:
        keys = ("first_answer_s", "health_s", "first_completion_s")
        medians = {
            name: {
                key: statistics.median(r[key] for r in rows if r["tree"] == name) for key in keys
            }
            for name in trees
        }
        print("median", json.dumps(medians))
    if args.json:
        from paged_attention.cli.machine import machine_info

        report = {
            "benchmark": "bench_start_split" if args.split else "bench_start",
            "command": " ".join(["python", "benchmarks/bench_start.py", *sys.argv[1:]]),
            "serve_args": args.serve_args,
            "trees": trees,
            "machine": machine_info(),
            "rows": rows,
            "median": medians,
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
