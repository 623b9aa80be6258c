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
    args = parser.parse_args()
    trees = dict(item.split("=", 1) for item in args.trees.split(","))
    rows = []
    for _ in range(args.rounds):
        for name, path in trees.items():
            row = {"tree": name, **one_start(args.serve_args, args.timeout, Path(path))}
            rows.append(row)
            print(
                json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
            )
    keys = ("first_answer_s", "health_s", "first_completion_s")
    medians = {
        name: {key: statistics.median(r[key] for r in rows if r["tree"] == name) for key in keys}
        for name in trees
    }
    print("median", json.dumps(medians))
    if args.json:
        from paged_attention.cli.machine import machine_info

        report = {
            "benchmark": "bench_start",
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
