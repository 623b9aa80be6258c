"""HTTP serving benchmark: drives a running ``paged-attention serve`` over its OpenAI API, as
vLLM's serving benchmark drives ``vllm serve``.

A fixed set of chat prompts (questions of a few dozen tokens, greedy, ``--max-tokens`` each) is
sent as streamed chat completions in two kinds of load:

* Poisson arrivals at each of ``--rates`` requests per second (``--requests`` requests each,
  seeded inter-arrival times): latency as the offered load grows;
* a closed loop of ``--concurrency`` clients, each sending its next request when the last one
  ended (``--requests`` requests in all): the throughput the server sustains.

Reported per run: request throughput, output tokens per second (the server's usage counts; wall
time from the first request to the last answer), time to first token and inter-token latency
(the gaps between streamed chunks) p50/p99, end-to-end latency p50, and the peak of KV blocks in
use (the server's /metrics, sampled every 0.05 s). A table on stdout, JSON (with the CPU model,
the load average and the server's model) and a PNG of latency against load.

    python benchmarks/bench_server.py --url http://127.0.0.1:8000 [--rates 0.5,1,2,4]
        [--concurrency 1,4,16] [--requests 32] [--max-tokens 64]
        [--json results/bench_server.json] [--plot results/bench_server.png]
    python benchmarks/bench_server.py --launch "--model smollm2 --kv-memory 1" ...

``--launch ARGS`` starts ``python -m paged_attention serve ARGS --port 0`` first and stops it
afterwards (SIGTERM) instead of using ``--url``.

``--compare --llama-server PATH`` runs ``serve`` and llama.cpp's ``llama-server`` on the same GGUF
alternately with the same client workload (bench_server_compare.py says how):

    python benchmarks/bench_server.py --compare --llama-server PATH [--rounds 2]
        [--json results/bench_server_compare.json] [--plot results/bench_server_compare.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from paged_attention.cli.machine import describe_machine, machine_info

PROMPTS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "List three uses of a paperclip.",
    "What is the difference between a virus and a bacterium?",
    "Give me a short recipe for pancakes.",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "How does a refrigerator keep food cold?",
    "What are the primary colours?",
    "Translate 'good morning, how are you?' into Spanish.",
    "Why do we have seasons on Earth?",
    "Name five animals that live in the ocean.",
    "What is photosynthesis?",
    "Suggest a name for a friendly robot.",
    "How many minutes are there in a day? Show the calculation.",
    "What does a compiler do?",
    "Describe the water cycle briefly.",
    "Write a two-line poem about the sea.",
    "What is the tallest mountain in the world?",
    "Give three tips for a good night's sleep.",
    "What is the boiling point of water at sea level in Celsius and Fahrenheit?",
    "Explain what a prime number is, with an example.",
    "Who wrote 'Pride and Prejudice'?",
    "What is the largest planet in our solar system?",
    "How do bees make honey?",
    "Write a short thank-you note to a teacher.",
    "What is the speed of light?",
    "Name three famous paintings and their painters.",
    "What causes rainbows?",
    "Give an example of a renewable energy source and explain it.",
    "What is the Pythagorean theorem?",
    "Describe a cat to someone who has never seen one.",
]


@dataclass
class Result:
    sent: float
    first_chunk: float | None = None
    done: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int
) -> Result:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = Result(sent=time.perf_counter())
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c["delta"].get("content") for c in chunk["choices"]):
                    now = time.perf_counter()
                    if result.first_chunk is None:
                        result.first_chunk = now
                    result.chunk_times.append(now)
        result.done = time.perf_counter()
    except httpx.HTTPError as error:
        result.error = repr(error)
    return result


async def kv_blocks_sampler(client: httpx.AsyncClient, url: str, peak: list[int]) -> None:
    """Keeps ``peak[0]`` at the most KV blocks in use seen on /metrics."""
    pattern = re.compile(r"^paged_attention_kv_blocks_used (\S+)$", re.MULTILINE)
    while True:
        try:
            text = (await client.get(f"{url}/metrics")).text
            match = pattern.search(text)
            if match:
                peak[0] = max(peak[0], int(float(match.group(1))))
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.05)


async def run_load(
    url: str, model: str, requests: int, max_tokens: int, rate=None, concurrency=None, seed=0
) -> dict:
    """One run: Poisson arrivals at ``rate`` requests/s, or a closed loop of ``concurrency``
    clients."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    limits = httpx.Limits(max_connections=requests + 2, max_keepalive_connections=requests + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        peak = [0]
        sampler = asyncio.create_task(kv_blocks_sampler(client, url, peak))
        started = time.perf_counter()
        if rate is not None:
            gaps = np.random.default_rng(seed).exponential(1.0 / rate, requests)
            gaps[0] = 0.0
            arrivals = np.cumsum(gaps)

            async def arrive(prompt: str, at: float) -> Result:
                await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
                return await one_request(client, url, model, prompt, max_tokens)

            results = await asyncio.gather(*(arrive(p, a) for p, a in zip(prompts, arrivals)))
        else:
            queue = list(reversed(prompts))
            results = []

            async def loop() -> None:
                while queue:
                    results.append(await one_request(client, url, model, queue.pop(), max_tokens))

            await asyncio.gather(*(loop() for _ in range(concurrency)))
        wall = time.perf_counter() - started
        sampler.cancel()
    return summarise(results, wall, peak[0], rate=rate, concurrency=concurrency)


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _ms(value: float | None) -> float | None:
    return None if value is None else round(1000 * value, 2)


def summarise(results: list[Result], wall: float, peak_blocks: int, rate, concurrency) -> dict:
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    ttfts = [r.first_chunk - r.sent for r in ok if r.first_chunk is not None]
    itls = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    e2e = [r.done - r.sent for r in ok]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "load": f"Poisson {rate:g} req/s" if rate is not None else f"closed loop x{concurrency}",
        "rate": rate,
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "seconds": round(wall, 3),
        "requests_per_s": round(len(ok) / wall, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 2),
        "ttft_p50_ms": _ms(_percentile(ttfts, 50)),
        "ttft_p99_ms": _ms(_percentile(ttfts, 99)),
        "itl_p50_ms": _ms(_percentile(itls, 50)),
        "itl_p99_ms": _ms(_percentile(itls, 99)),
        "e2e_p50_ms": _ms(_percentile(e2e, 50)),
        "peak_kv_blocks_used": peak_blocks,
    }


def print_table(rows: list[dict], info: dict) -> None:
    print(
        f"model {info['model']} ({info['kv_blocks_total']} KV blocks); "
        f"{describe_machine(info['machine'])}"
    )
    header = (
        "| load | req/s | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | e2e p50 ms "
        "| peak KV blocks | errors |"
    )
    print(header)
    print("|---" * 8 + "|")
    for r in rows:
        print(
            f"| {r['load']} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} "
            f"| {_fmt(r['ttft_p50_ms'])} / {_fmt(r['ttft_p99_ms'])} "
            f"| {_fmt(r['itl_p50_ms'])} / {_fmt(r['itl_p99_ms'])} | {_fmt(r['e2e_p50_ms'])} "
            f"| {r['peak_kv_blocks_used']} | {r['errors']} |"
        )


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    panels = (
        (axes[0], "Poisson arrivals", "rate", "offered requests/s"),
        (axes[1], "closed loop", "concurrency", "concurrent clients"),
    )
    for ax, kind, key, xlabel in panels:
        runs = [r for r in rows if r[key] is not None]
        if not runs:
            ax.set_visible(False)
            continue
        load = [r[key] for r in runs]
        for metric, style in (("ttft_p50_ms", "o-"), ("ttft_p99_ms", "o--"), ("itl_p50_ms", "s-")):
            values = [r[metric] for r in runs]
            ax.plot(load, values, style, label=metric.replace("_ms", "").replace("_", " "))
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ms")
        ax.set_xscale("log", base=2)
        ax.set_xticks(load, [f"{x:g}" for x in load])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_ylim(bottom=0)
        ax.set_title(f"latency against load: {kind}")
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def server_info(url: str) -> dict:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    total = re.search(r"^paged_attention_kv_blocks_total (\S+)$", metrics, re.MULTILINE)
    return {
        "model": model["id"],
        "max_model_len": model.get("max_model_len"),
        "kv_blocks_total": int(float(total.group(1))) if total else None,
    }


def launch(serve_args: str) -> tuple[subprocess.Popen, str]:
    """``python -m paged_attention serve ARGS --port 0``; returns it and its URL once it
    listens."""
    command = [sys.executable, "-m", "paged_attention", "serve", *shlex.split(serve_args)]
    process = subprocess.Popen(
        [*command, "--port", "0", "--log-level", "warning"], stdout=subprocess.PIPE, text=True
    )
    line = process.stdout.readline()
    match = re.search(r"on (http://\S+)", line)
    if match is None:
        process.wait(60)
        raise SystemExit(f"bench_server: the server did not start: {line!r}")
    url = match.group(1)
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.1)
    process.terminate()
    raise SystemExit("bench_server: the server did not answer /health")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="the running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--launch", metavar="ARGS", help="start `paged_attention serve ARGS`")
    where.add_argument(
        "--compare",
        action="store_true",
        help="serve against llama-server on the same GGUF, alternately (needs --llama-server)",
    )
    parser.add_argument("--rates", default="0.5,1,2,4", help="Poisson request rates (req/s)")
    parser.add_argument("--concurrency", default="1,4,16", help="closed-loop client counts")
    parser.add_argument("--requests", type=int, default=32, help="requests per run")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--json", help="default: results/bench_server.json (--compare: ..._compare)"
    )
    parser.add_argument("--plot", help="default: results/bench_server.png (--compare: ..._compare)")
    import bench_server_compare  # imports this module: not at the top

    bench_server_compare.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.compare:
        bench_server_compare.check_arguments(parser, args)
    else:
        args.json = "results/bench_server.json" if args.json is None else args.json
        args.plot = "results/bench_server.png" if args.plot is None else args.plot
    return args


def _numbers(text: str, kind) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    typed = sys.argv if argv is None else ["benchmarks/bench_server.py", *argv]
    command = " ".join(shlex.quote(a) for a in typed)
    if args.compare:
        import bench_server_compare

        return bench_server_compare.run(args, command)
    process = None
    url = args.url
    if args.launch is not None:
        process, url = launch(args.launch)
    url = url.rstrip("/")
    try:
        info = server_info(url)
        info.update(
            machine=machine_info("cpu"),  # the client's; a launched server runs on it too
            url=url,
            command=command,
            requests_per_run=args.requests,
            max_tokens=args.max_tokens,
        )
        rows = []
        for rate in _numbers(args.rates, float):
            rows.append(
                asyncio.run(run_load(url, info["model"], args.requests, args.max_tokens, rate=rate))
            )
        for clients in _numbers(args.concurrency, int):
            rows.append(
                asyncio.run(
                    run_load(
                        url, info["model"], args.requests, args.max_tokens, concurrency=clients
                    )
                )
            )
        info["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
    print_table(rows, info)
    report = {"info": info, "rows": rows}
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return report


if __name__ == "__main__":
    main()
