"""Seconds from starting ``python -m paged_attention serve`` to its first ``/health`` answer
(200) and to its first completion (one chat request for one token), on a model that is already
converted (run it once before, or the first round pays the conversion).

Each round starts a fresh server process on a free port, polls ``/health`` every 20 ms, then asks
for one completion and stops the server with SIGINT. The rounds' seconds, their median, and the
machine (``paged_attention.cli.machine``) go to ``--json``.

    python benchmarks/bench_start.py --rounds 3 --json docs/results/bench_start.json
"""

from __future__ import annotations

import argparse
import json
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


def one_start(serve_args: list[str], timeout: float) -> dict:
    """One server start: seconds to the first 200 of /health and to the first completion."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "paged_attention", "serve", "--port", str(port), *serve_args]
    started = time.perf_counter()
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        health = None
        while time.perf_counter() - started < timeout:
            if process.poll() is not None:
                error = process.stderr.read()
                raise RuntimeError(f"serve exited with {process.returncode}: {error}")
            if _get(url + "/health", timeout=1.0) == 200:
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
    return {"health_s": health, "first_completion_s": first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one start may take")
    parser.add_argument("--json", type=Path, help="write the rounds and the machine here")
    parser.add_argument(
        "serve_args", nargs="*", help="arguments for serve after --, e.g. -- --model tiny"
    )
    args = parser.parse_args()
    rows = []
    for _ in range(args.rounds):
        rows.append(one_start(args.serve_args, args.timeout))
        print(json.dumps({key: round(value, 2) for key, value in rows[-1].items()}), flush=True)
    keys = ("health_s", "first_completion_s")
    summary = {key: statistics.median(row[key] for row in rows) for key in keys}
    print("median", json.dumps({key: round(value, 2) for key, value in summary.items()}))
    if args.json:
        from paged_attention.cli.machine import machine_info

        report = {
            "benchmark": "bench_start",
            "command": " ".join(["python", "benchmarks/bench_start.py", *sys.argv[1:]]),
            "serve_args": args.serve_args,
            "machine": machine_info(),
            "rows": rows,
            "median": summary,
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
