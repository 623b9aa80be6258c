"""``bench_server.py --compare``: ``paged-attention serve`` and llama.cpp's ``llama-server`` side
by side on the same GGUF, with the same streaming OpenAI-client workload.

The two servers run alternately, never both at once: in each of ``--rounds`` rounds, ``serve``
starts, answers the loads and stops (its whole process tree has exited), then ``llama-server``
does the same (A B A B ...). Each start is timed until ``/health`` first answers at all
(``first_answer_s``: a server that listens while it loads answers 503 meanwhile) and until it
answers 200, ready (``start_s``). The loads, one
after the other on the started server, are closed loops of streamed chat completions (greedy,
the prompts of bench_server.py; ``--loads one-user`` or ``--loads chats`` runs one of them):

* ``32 chats x 64 tokens``: 32 clients, one request each, ``max_tokens`` 64;
* ``1 user x 128 tokens``: one client, two requests one after the other, ``max_tokens`` 128.

Recorded per load: output tokens per second (the server's usage counts, or the streamed content
chunks where a server sends no usage; wall time from the first request to the last answer), time
to first token and inter-token latency (the gaps between streamed chunks) p50 and p90, the CPU
cores the server's process tree used (psutil: its CPU seconds over the wall time), and what the
rest of the machine used meanwhile (every other process's cores and the VM's stolen time, from
the system's CPU times); per server run, the tree's peak resident memory (the sum over its
processes, sampled every 0.1 s) and the seconds from the start until ``/health`` first answered
and until it answered 200.

The JSON (``--json``, default results/bench_server_compare.json) holds every run and the median,
minimum and maximum over the rounds; the table on stdout and the PNG (``--plot``) show them.
publish.py renders the JSON into docs/benchmarks.md. The llama-server binary must be given
(``--llama-server PATH``; benchmarks/build_llama_server.sh builds one and prints its path).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
from bench_server import PROMPTS, one_request
from publish import compare_table_rows

from paged_attention.cli.machine import describe_machine, machine_info


@dataclasses.dataclass(frozen=True)
class Load:
    """A closed loop: ``clients`` clients send ``requests`` requests of ``max_tokens`` in all."""

    name: str
    clients: int
    requests: int
    max_tokens: int
    key: str
    """What ``--loads`` calls it."""


LOADS = (
    Load("32 chats x 64 tokens", clients=32, requests=32, max_tokens=64, key="chats"),
    Load("1 user x 128 tokens", clients=1, requests=2, max_tokens=128, key="one-user"),
)
SAMPLE_INTERVAL_S = 0.1
STOP_TIMEOUT_S = 60.0


# --------------------------------------------------------------------------------------------
# A server's process tree


class ProcessTreeMonitor:
    """Samples a process and its descendants every SAMPLE_INTERVAL_S in a thread: the peak of
    their summed resident memory, and the CPU seconds each has used (the last sample of a process
    that exited keeps counting)."""

    def __init__(self, pid: int):
        self.root = psutil.Process(pid)
        self.peak_rss_bytes = 0
        self._cpu_seconds: dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> ProcessTreeMonitor:
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            self.sample()

    def processes(self) -> list[psutil.Process]:
        try:
            return [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def sample(self) -> float:
        """Take a sample now; returns the CPU seconds the tree has used so far."""
        rss = 0
        with self._lock:
            for process in self.processes():
                try:
                    with process.oneshot():
                        times = process.cpu_times()
                        rss += process.memory_info().rss
                except psutil.Error:  # exited between the listing and the sample
                    continue
                self._cpu_seconds[process.pid] = times.user + times.system
            self.peak_rss_bytes = max(self.peak_rss_bytes, rss)
            return sum(self._cpu_seconds.values())


class SystemCpu:
    """The machine's CPU seconds (all CPUs together: ``total``, of which ``busy`` for every
    process and ``steal`` taken by the VM's host), and this client process's own, so that the
    rest of the machine's load can be told apart."""

    def __init__(self):
        self.client = psutil.Process()

    def sample(self) -> dict:
        times = psutil.cpu_times()
        idle = times.idle + getattr(times, "iowait", 0.0)
        steal = getattr(times, "steal", 0.0)
        own = self.client.cpu_times()
        # guest time is counted in user time too
        total = sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)
        client = own.user + own.system
        return dict(total=total, busy=total - idle - steal, steal=steal, client=client)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class ServerSpec:
    """How to start one of the servers: ``argv`` with ``{port}`` where its port goes."""

    name: str
    argv: tuple[str, ...]

    def command(self, port: int) -> list[str]:
        return [arg.replace("{port}", str(port)) for arg in self.argv]


class RunningServer:
    """A server started from its spec (its output in ``log_path``) until /health answers 200;
    stopped with SIGTERM (SIGKILL after STOP_TIMEOUT_S) and waited for, its whole process tree,
    so that the next server never runs beside it."""

    def __init__(self, spec: ServerSpec, log_dir: Path, start_timeout_s: float, round_: int):
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{spec.name}-{round_}.log"
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen | None = None
        self.monitor: ProcessTreeMonitor | None = None
        self.start_s: float | None = None
        """Seconds from the start until ``/health`` answered 200 (ready)."""
        self.first_answer_s: float | None = None
        """Seconds until ``/health`` first answered anything (503 while loading, or 200)."""

    def __enter__(self) -> RunningServer:
        with open(self.log_path, "w") as log:
            started = time.perf_counter()
            self.process = subprocess.Popen(
                self.spec.command(self.port),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.monitor = ProcessTreeMonitor(self.process.pid).start()
        try:
            self.start_s = self._wait_for_health(started)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_for_health(self, started: float) -> float:
        while time.perf_counter() - started < self.start_timeout_s:
            if self.process.poll() is not None:
                raise SystemExit(
                    f"bench_server --compare: {self.spec.name} exited with status "
                    f"{self.process.returncode} before answering /health; its output:\n"
                    + self.log_tail()
                )
            try:
                status = httpx.get(f"{self.url}/health", timeout=5).status_code
            except httpx.HTTPError:
                status = None
            if status is not None and self.first_answer_s is None:
                self.first_answer_s = time.perf_counter() - started
            if status == 200:
                return time.perf_counter() - started
            time.sleep(0.05)
        raise SystemExit(
            f"bench_server --compare: {self.spec.name} did not answer /health within "
            f"{self.start_timeout_s:g} s (--start-timeout); its output:\n" + self.log_tail()
        )

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process is None:
            return
        tree = self.monitor.processes() if self.monitor else []
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for child in tree[1:]:  # a descendant the server left behind
            with contextlib.suppress(psutil.Error):
                child.kill()
        psutil.wait_procs(tree[1:], timeout=STOP_TIMEOUT_S)
        if self.monitor is not None:
            self.monitor.stop()


# --------------------------------------------------------------------------------------------
# The client workload


def served_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


async def closed_loop(url: str, model: str, load: Load) -> tuple[list, float]:
    """``load.clients`` clients, each sending its next request when the last one ended."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(load.requests)]
    queue = list(reversed(prompts))
    results = []
    limits = httpx.Limits(max_connections=load.clients + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def one_client() -> None:
            while queue:
                prompt = queue.pop()
                results.append(await one_request(client, url, model, prompt, load.max_tokens))

        started = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(load.clients)))
        return results, time.perf_counter() - started


def percentile_ms(values: list[float], q: float) -> float | None:
    return round(1000 * float(np.percentile(values, q)), 2) if values else None


def measure_load(server: RunningServer, model: str, load: Load) -> dict:
    """One load against a started server: rates, latencies, and the cores it and the rest of
    the machine used meanwhile."""
    system = SystemCpu()
    loadavg = [round(x, 2) for x in os.getloadavg()]
    server_before, system_before = server.monitor.sample(), system.sample()
    results, wall = asyncio.run(closed_loop(server.url, model, load))
    server_after, system_after = server.monitor.sample(), system.sample()
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    chunks = sum(len(r.chunk_times) for r in ok)
    usage = sum(r.output_tokens for r in ok)
    ttfts = [r.first_chunk - r.sent for r in ok if r.first_chunk is not None]
    itls = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    server_cores = (server_after - server_before) / wall
    client_cores = (system_after["client"] - system_before["client"]) / wall
    delta = {key: system_after[key] - system_before[key] for key in system_before}
    # The system's times tick every 10 ms per CPU: as a share of the CPU time that passed, they
    # stay within the machine's cores over a short load too.
    per_core = (os.cpu_count() or 1) / delta["total"] if delta["total"] > 0 else 1.0 / wall
    return {
        "load": load.name,
        "requests": len(results),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "seconds": round(wall, 3),
        "output_tokens": usage or chunks,
        "tokens_counted_from": "usage" if usage else "chunks",
        "output_tokens_per_s": round((usage or chunks) / wall, 2),
        "ttft_p50_ms": percentile_ms(ttfts, 50),
        "ttft_p90_ms": percentile_ms(ttfts, 90),
        "itl_p50_ms": percentile_ms(itls, 50),
        "itl_p90_ms": percentile_ms(itls, 90),
        "server_cores": round(server_cores, 3),
        "other_cores": round(max(0.0, delta["busy"] * per_core - server_cores - client_cores), 3),
        "client_cores": round(client_cores, 3),
        "steal_cores": round(delta["steal"] * per_core, 3),
        "loadavg_before": loadavg,
    }


def compare(specs, loads, rounds: int, log_dir: Path, start_timeout_s: float) -> list[dict]:
    """Every round starts each server in turn (A B A B ...), runs the loads on it and stops it
    before the next one starts. Returns one entry per server run."""
    runs = []
    for round_ in range(1, rounds + 1):
        for spec in specs:
            print(f"round {round_}: starting {spec.name}", flush=True)
            with RunningServer(spec, log_dir, start_timeout_s, round_) as server:
                model = served_model(server.url)
                rows = []
                for load in loads:
                    rows.append(measure_load(server, model, load))
                    row = rows[-1]
                    print(
                        f"  {load.name}: {row['output_tokens_per_s']:.1f} tok/s, TTFT p50 "
                        f"{row['ttft_p50_ms']} ms, server cores {row['server_cores']:.2f}, "
                        f"others {row['other_cores']:.2f}, errors {row['errors']}",
                        flush=True,
                    )
            runs.append(
                dict(
                    server=spec.name,
                    round=round_,
                    command=shlex.join(spec.command(server.port)),
                    start_s=round(server.start_s, 3),
                    first_answer_s=round(server.first_answer_s, 3),
                    peak_rss_bytes=server.monitor.peak_rss_bytes,
                    loads=rows,
                )
            )
    return runs


# --------------------------------------------------------------------------------------------
# Summary, table, plot

LOAD_METRICS = (
    "output_tokens_per_s", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms",
    "server_cores", "other_cores", "steal_cores",
)  # fmt: skip
RUN_METRICS = ("start_s", "first_answer_s", "peak_rss_bytes")


def spread(values: list) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return dict(median=statistics.median(values), min=min(values), max=max(values))


def summarise(runs: list[dict]) -> dict:
    """Server -> {metric: {median, min, max}} over its rounds, per run and per load."""
    summary = {}
    for server in dict.fromkeys(run["server"] for run in runs):
        mine = [run for run in runs if run["server"] == server]
        entry = {metric: spread([run[metric] for run in mine]) for metric in RUN_METRICS}
        entry["loads"] = {}
        for load in dict.fromkeys(row["load"] for run in mine for row in run["loads"]):
            rows = [row for run in mine for row in run["loads"] if row["load"] == load]
            stats = {metric: spread([row.get(metric) for row in rows]) for metric in LOAD_METRICS}
            stats["errors"] = sum(row["errors"] for row in rows)
            entry["loads"][load] = stats
        summary[server] = entry
    return summary


def print_table(report: dict) -> None:
    info = report["info"]
    print(describe_machine(info["machine"]))
    print(f"{info['rounds']} rounds, servers alternating; median (range) over the rounds")
    header, rows = compare_table_rows(report["summary"])
    print("| " + " | ".join(header) + " |")
    print("|---" * len(header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, summary = report["runs"], report["summary"]
    servers = list(summary)
    loads = list(dict.fromkeys(row["load"] for run in runs for row in run["loads"]))
    panels = [(load, "output_tokens_per_s", "output tokens/s") for load in loads]
    panels += [(load, "ttft_p50_ms", "TTFT p50 ms") for load in loads[:1]]
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(4 * (len(panels) + 1), 4))
    for ax, (load, metric, label) in zip(axes, panels):
        for i, server in enumerate(servers):
            values = [
                row[metric]
                for run in runs
                if run["server"] == server
                for row in run["loads"]
                if row["load"] == load and row[metric] is not None
            ]
            ax.bar(i, statistics.median(values) if values else 0, color=f"C{i}", alpha=0.6)
            ax.plot([i] * len(values), values, "ko", markersize=4)
        ax.set_xticks(range(len(servers)), servers)
        ax.set_title(f"{load}\n{label}", fontsize=9)
    ax = axes[-1]
    for i, server in enumerate(servers):
        values = [run["peak_rss_bytes"] / 1e9 for run in runs if run["server"] == server]
        ax.bar(i, statistics.median(values), color=f"C{i}", alpha=0.6)
        ax.plot([i] * len(values), values, "ko", markersize=4)
    ax.set_xticks(range(len(servers)), servers)
    ax.set_title("peak resident memory GB", fontsize=9)
    fig.suptitle("same GGUF, servers run alternately; bars: median, dots: rounds", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--compare (paged-attention serve against llama-server)")
    group.add_argument("--llama-server", metavar="PATH", help="the llama-server binary")
    group.add_argument("--gguf", help="the GGUF both servers serve (default: SmolLM2's)")
    group.add_argument("--rounds", type=int, default=2, help="rounds of A B (default 2)")
    group.add_argument(
        "--serve-command",
        default=f"{shlex.quote(sys.executable)} -m paged_attention serve",
        help="how to start this project's server (default: this Python's -m paged_attention serve)",
    )
    group.add_argument("--serve-args", default="", help="more arguments for serve")
    cores = os.cpu_count() or 1
    group.add_argument(
        "--llama-args",
        default=f"-t {cores} -tb {cores} -np 32 -c 16384",
        help="llama-server's arguments besides the model, host and port (default: every core, "
        "32 parallel slots, 16384 tokens of context)",
    )
    group.add_argument(
        "--start-timeout", type=float, default=900.0, help="seconds a server may take to start"
    )
    group.add_argument(
        "--loads",
        default=",".join(load.key for load in LOADS),
        help="the loads to run, comma-separated, of "
        + ", ".join(f"{load.key} ({load.name})" for load in LOADS)
        + " (default: all)",
    )


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a comparison that cannot run, naming the argument."""
    if args.llama_server is None:
        parser.error(
            "--compare needs --llama-server PATH, the llama-server binary to compare with "
            "(bash benchmarks/build_llama_server.sh builds it and prints its path)"
        )
    binary = Path(args.llama_server)
    if not binary.is_file() or not os.access(binary, os.X_OK):
        parser.error(f"--llama-server: {args.llama_server} is not an executable file")
    if args.gguf is not None and not Path(args.gguf).is_file():
        parser.error(f"--gguf: {args.gguf} is not a file")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if not args.start_timeout > 0:
        parser.error(f"--start-timeout must be positive, got {args.start_timeout}")
    known = {load.key for load in LOADS}
    chosen = args.loads.split(",")
    if not chosen or not set(chosen) <= known or len(set(chosen)) != len(chosen):
        parser.error(f"--loads: {args.loads!r} is not a list of distinct loads of {sorted(known)}")
    for option in ("serve_command", "serve_args", "llama_args"):
        try:
            shlex.split(getattr(args, option))
        except ValueError as error:
            parser.error(f"--{option.replace('_', '-')}: {error}")


def specs_of(args: argparse.Namespace) -> tuple[ServerSpec, ServerSpec]:
    gguf = args.gguf or str(default_gguf())
    serve = ServerSpec(
        "serve",
        (*shlex.split(args.serve_command), "--model", gguf, "--host", "127.0.0.1",
         "--port", "{port}", *shlex.split(args.serve_args)),
    )  # fmt: skip
    llama = ServerSpec(
        "llama-server",
        (args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", "{port}",
         *shlex.split(args.llama_args)),
    )  # fmt: skip
    return serve, llama


def default_gguf() -> Path:
    from paged_attention.modeling.models import ModelLoadError, smollm2_gguf

    try:
        return smollm2_gguf()
    except ModelLoadError as error:
        raise SystemExit(f"--gguf not given and the default model is missing: {error}") from None


def run(args: argparse.Namespace, command: str, loads=None) -> dict:
    """The comparison the parsed arguments ask for (``command``: how it was typed): runs it,
    prints the table, writes the JSON and the plot; returns the report."""
    if loads is None:
        chosen = args.loads.split(",")
        loads = tuple(load for load in LOADS if load.key in chosen)
    specs = specs_of(args)
    info = dict(
        machine=machine_info("cpu"),
        command=command,
        gguf=Path(specs[0].argv[specs[0].argv.index("--model") + 1]).name,
        rounds=args.rounds,
        loads=[dataclasses.asdict(load) for load in loads],
        loadavg_before=[round(x, 2) for x in os.getloadavg()],
    )
    with tempfile.TemporaryDirectory(prefix="bench_server_compare-") as log_dir:
        runs = compare(specs, loads, args.rounds, Path(log_dir), args.start_timeout)
    info["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    report = dict(benchmark="bench_server_compare", info=info, runs=runs, summary=summarise(runs))
    print_table(report)
    json_path = args.json or "results/bench_server_compare.json"
    os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
    Path(json_path).write_text(json.dumps(report, indent=1))
    print(f"wrote {json_path}")
    plot_path = args.plot or "results/bench_server_compare.png"
    plot(report, plot_path)
    print(f"wrote {plot_path}")
    return report
