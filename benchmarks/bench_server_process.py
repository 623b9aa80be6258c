"""One user through ``serve`` against the offline engine, in one run: the tokens/s of a
single streamed chat of ``--max-tokens`` tokens (the openai client, greedy), the rate of the
same engine offline for the same prompt (the engine ``serve`` builds from the same arguments,
``--serve-args`` included, its compiled steps loaded from the same cache; built in this
process from this checkout), and the seconds from starting ``serve`` until ``/health``
answers, with the cores each process used during the measured answer: ``serve``'s own (the
HTTP side), its engine's and the client's (this process). Servers are started from the
checkouts given (``--checkouts before=PATH,after=PATH``) in turn, A B A B, so a shared
machine's load falls on both alike; /proc/loadavg is recorded.

    python benchmarks/bench_server_process.py --checkouts before=../old,after=. --rounds 2
    python benchmarks/bench_server_process.py --checkouts now=. --rounds 3 \
        --serve-args '--max-num-seqs 1 --max-n 1'
    python benchmarks/bench_server_process.py --checkouts after=. --start-methods
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time

PROMPT = "Write a long story about a lighthouse keeper and the sea."


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def loadavg() -> str:
    with open("/proc/loadavg") as file:
        return " ".join(file.read().split()[:3])


def serve_arguments(model: str, threads: int | None, serve_args: str) -> list[str]:
    """``serve``'s arguments after the command: the model, the threads and ``serve_args``."""
    threads_args = ["--threads", str(threads)] if threads else []
    return ["--model", model, "--log-level", "warning", *threads_args, *shlex.split(serve_args)]


class CoreUse:
    """Cores used from now on (CPU seconds over wall seconds) by ``serve``'s process (its HTTP
    side), its child processes (the engine's) and this process (the client)."""

    def __init__(self, server_pid: int) -> None:
        import psutil

        self.server = psutil.Process(server_pid)
        self.client = psutil.Process()
        self.started = time.perf_counter()
        self.before = self._seconds()

    def _seconds(self) -> dict[str, float]:
        def busy(process) -> float:
            times = process.cpu_times()
            return times.user + times.system

        engine = sum(busy(child) for child in self.server.children(recursive=True))
        return {"server": busy(self.server), "engine": engine, "client": busy(self.client)}

    def cores(self) -> dict[str, float]:
        wall = time.perf_counter() - self.started
        after = self._seconds()
        return {f"{name}_cores": (after[name] - self.before[name]) / wall for name in after}


def serve_once(checkout: str, model: str, max_tokens: int, threads, serve_args: str) -> dict:
    import httpx
    import openai

    port = free_port()
    command = [sys.executable, "-m", "paged_attention", "serve", "--port", str(port)]
    command += serve_arguments(model, threads, serve_args)
    environment = {**os.environ, "PYTHONPATH": os.path.abspath(checkout)}
    started = time.perf_counter()
    server = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL)
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise RuntimeError(f"serve from {checkout} exited with {server.returncode}")
            time.sleep(0.05)
        health = time.perf_counter() - started
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        rates = []
        for _ in range(2):  # the first one warms the model up
            processes = CoreUse(server.pid)
            times, usage = [], None
            stream = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                if chunk.choices and chunk.choices[0].delta.content:
                    times.append(time.perf_counter())
            tokens = usage.completion_tokens
            rates.append((tokens - 1) / (times[-1] - times[0]))
        return {"health_s": health, "tok_s": rates[-1], "tokens": tokens, **processes.cores()}
    finally:
        server.terminate()
        server.wait(60)


def offline(model: str, max_tokens: int, threads: int | None, serve_args: str) -> dict:
    from paged_attention.cli import serve
    from paged_attention.engine import SamplingParams

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(serve_arguments(model, threads, serve_args))
    engine, _ = serve.ServeSpec(args).build()
    messages = [{"role": "user", "content": PROMPT}]
    rate = None
    for _ in range(2):
        (output,) = engine.generate([messages], SamplingParams(max_new_tokens=max_tokens))
        times = output.metrics.token_times
        rate = (len(output.outputs[0]) - 1) / (times[-1] - times[0])
    return {"tok_s": rate, "tokens": len(output.outputs[0])}


def start_methods(model: str, rounds: int) -> list[dict]:
    """Seconds until the engine's process is ready, ``spawn`` and ``fork`` alternately, from
    this process (which imported torch, as ``serve``'s has)."""
    from paged_attention.server.engine_process import EngineProcess, EngineSpec

    results = []
    for _ in range(rounds):
        for method in ("spawn", "fork"):
            load = loadavg()
            started = time.perf_counter()
            engine = EngineProcess(EngineSpec(model, {"num_blocks": 256}), start_method=method)
            ready = time.perf_counter() - started
            engine.close()
            results.append({"start_method": method, "ready_s": ready, "load": load})
            print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkouts", required=True, help="name=PATH,name=PATH")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, help="torch threads (serve --threads)")
    parser.add_argument("--serve-args", default="", help="more arguments for serve (both sides)")
    parser.add_argument("--json")
    parser.add_argument(
        "--start-methods",
        action="store_true",
        help="instead: time the engine process's start with spawn and with fork",
    )
    args = parser.parse_args()
    if args.start_methods:
        import torch  # noqa: F401  (imported before the child starts, as in serve)

        start_methods(args.model, args.rounds)
        return
    checkouts = dict(item.split("=", 1) for item in args.checkouts.split(","))
    results = []
    for round_ in range(args.rounds):
        entry = {"round": round_, "load_before": loadavg()}
        entry["offline"] = offline(args.model, args.max_tokens, args.threads, args.serve_args)
        print(f"offline: {entry['offline']}", file=sys.stderr, flush=True)
        for name, path in checkouts.items():
            entry[name] = serve_once(
                path, args.model, args.max_tokens, args.threads, args.serve_args
            )
            print(f"{name}: {entry[name]}", file=sys.stderr, flush=True)
        entry["load_after"] = loadavg()
        results.append(entry)
        print(json.dumps(entry), flush=True)
    if args.json:
        from paged_attention.cli.machine import machine_info

        report = {
            "benchmark": "bench_server_process",
            "command": " ".join(["python", "benchmarks/bench_server_process.py", *sys.argv[1:]]),
            "checkouts": checkouts,
            "serve_args": args.serve_args,
            "machine": machine_info(),
            "rounds": results,
        }
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()
