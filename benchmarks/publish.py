"""Write the published results from the benchmark JSON committed under docs/results/.

Every figure in README.md's headline table, on docs/benchmarks.md and on docs/performance.md is
written here, between marker comments, from the JSON files the benchmarks wrote; each table
names the machine the JSON records and the command that produced it: the one the JSON records
(bench_server.py records it), else the line naming the file in docs/results/INDEX.txt
(``<file>: <command>``), else the benchmark's script with "(arguments not recorded)".
INDEX.txt's ``note: ...`` lines are published with the tables.

    python benchmarks/publish.py            # rewrite the marked sections
    python benchmarks/publish.py --check    # exit 1, naming the file, if a section is stale
    python benchmarks/publish.py --take DIR # first take DIR's JSON, plots and INDEX.txt lines

``make bench`` runs the benchmarks into docs/results/ and then this script; after copying new
JSON (and its PNGs into docs/img/) by hand, run it alone.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
IMAGES = ROOT / "docs" / "img"
BEGIN = "<!-- results:begin (written by benchmarks/publish.py from docs/results/; do not edit) -->"
END = "<!-- results:end -->"

# The instruction-set features worth naming in a machine's one-line description.
ISA_NAMES = (
    ("avx512f", "AVX-512"),
    ("avx512_bf16", "AVX512-BF16"),
    ("amx_bf16", "AMX"),
)


# --------------------------------------------------------------------------------------------
# Reading the results


def load_results(directory: Path = RESULTS) -> dict[str, dict]:
    """Every JSON file of ``directory`` by file name, in name order."""
    return {path.name: json.loads(path.read_text()) for path in sorted(directory.glob("*.json"))}


def kind_of(data: dict) -> str | None:
    """Which benchmark wrote ``data``, from its shape (file names may vary)."""
    rows = data.get("rows")
    first = rows[0] if isinstance(rows, list) and rows else {}
    if data.get("benchmark") == "bench_server_compare":
        return "server_compare"
    if data.get("benchmark") == "bench_start":
        return "start"
    if data.get("benchmark") == "bench_start_split":
        return "start_split"
    if data.get("benchmark") == "bench_server_process":
        return "server_process"
    if data.get("benchmark") == "bench_offline":
        return "offline"
    if {"pairs", "runs"} <= data.keys():
        return "greedy_agreement"
    if {"tree", "workload"} <= first.keys():
        return "engine_step"
    if {"shape", "config", "acceptance_rate"} <= first.keys():
        return "spec_decode"
    if {"int4pack_us", "gguf_us"} <= first.keys():
        return "gguf_linear"
    if {"config", "rss_mb", "tok_s_1"} <= first.keys():
        return "quantized"
    if {"kv_budget_blocks", "contiguous_blocks"} <= data.keys():
        return "demo"
    if {"memory", "compute", "from_memory"} <= data.keys():
        return "decode_cpu_core"
    if {"utilisation", "sharing"} <= data.keys():
        return "memory"
    if data.get("benchmark") == "bench_hf_kv_bytes":
        return "hf_kv_bytes"
    if data.get("benchmark") == "bench_mla":
        return "mla"
    if "results" in data and "block_manager" in data.get("results", {}):
        return "block_manager"
    if "info" in data and "load" in first:
        return "server"
    if "config" in first and "tokens_per_s" in first:
        return "serving"
    if "query_len" in first and "method" in first:
        return "prefill"
    if "method" in first and "context" in first:
        return "decode"
    return None


SCRIPTS = {
    "demo": "-m paged_attention demo --json",
    "decode": "bench_decode.py",
    "decode_cpu_core": "bench_decode_cpu_core.py",
    "prefill": "bench_prefill.py",
    "serving": "bench_serving.py",
    "server": "bench_server.py",
    "server_compare": "bench_server.py --compare",
    "memory": "bench_memory.py",
    "hf_kv_bytes": "bench_hf_kv_bytes.py",
    "mla": "bench_mla.py",
    "block_manager": "bench_block_manager.py",
    "gguf_linear": "bench_gguf_linear.py",
    "quantized": "bench_quantized.py",
    "greedy_agreement": "greedy_agreement.py",
    "engine_step": "bench_engine_step.py",
    "spec_decode": "bench_spec_decode.py",
    "offline": "bench_offline.py",
}


def index_notes(directory: Path = RESULTS) -> dict[str | None, list[str]]:
    """The notes of ``directory/INDEX.txt``: ``note: TEXT`` about every run (key None) and
    ``note FILE: TEXT`` about one file's run, what a reader of its figures must know (a smoke
    run, a busy machine); published with the tables."""
    notes: dict[str | None, list[str]] = {}
    path = directory / "INDEX.txt"
    if not path.exists():
        return notes
    for line in path.read_text().splitlines():
        match = re.match(r"^note(?:\s+([\w.\-]+?)(?:\.json)?)?\s*:\s*(.+)$", line)
        if match:
            name = match.group(1) and match.group(1) + ".json"
            notes.setdefault(name, []).append(match.group(2).strip())
    return notes


def normal_command(command: str) -> str:
    """``command`` as a reader would type it from the repository's root: backquotes, a trailing
    ``(rc=..., ...)`` and ``bash -c``/``time`` wrappers dropped, the interpreter's path made
    ``python``, and a JSON or PNG argument's directory the one it is committed in."""
    command = command.replace("`", "").strip()
    command = re.sub(r"\s*\(rc=[^)]*\)\s*$", "", command)
    command = re.sub(r"^bash -c\s+[\"']?", "", command)
    command = re.sub(r"^/usr/bin/time( -v)?\s+", "", command)
    command = re.sub(r"(?:^|(?<=\s))\S*/python3?(?=\s)", "python", command)
    command = re.sub(r"(?:^|(?<=\s))\S*/([\w.\-]+\.json)\b", r"docs/results/\1", command)
    command = re.sub(r"(?:^|(?<=\s))\S*/([\w.\-]+\.png)\b", r"docs/img/\1", command)
    if command.startswith("benchmarks/"):
        command = "python " + command
    return command


def index_commands(directory: Path = RESULTS) -> dict[str, str]:
    """File name -> command, from ``directory/INDEX.txt`` (absent: none). A line names a result
    (``bench_decode_cpu`` or ``bench_decode_cpu.json``), then ``:`` or ``|``, then the command;
    backquotes, a leading ``-`` and a trailing ``(rc=..., ...)`` are dropped, the interpreter's
    path becomes ``python``, and a JSON or PNG argument's directory becomes the one it is
    committed in (docs/results/, docs/img/)."""
    path = directory / "INDEX.txt"
    commands: dict[str, str] = {}
    if not path.exists():
        return commands
    for line in path.read_text().splitlines():
        if re.match(r"^note[\s:]", line) or re.search(r"\(rc=[1-9]", line):
            continue
        match = re.match(r"^[\s\-*`]*([\w.\-/]+?)(?:\.json)?`?\s*[:|]\s*(.+)$", line)
        if not match:
            continue
        name = Path(match.group(1)).name + ".json"
        command = normal_command(match.group(2))
        if command:
            commands.setdefault(name, command)
    return commands


def command_of(name: str, data: dict, kind: str, commands: dict[str, str]) -> str:
    """The command that wrote ``data``: the one it records (bench_server.py's keeps its
    arguments' quoting), else INDEX.txt's, else the script's name."""
    recorded = data.get("info", {}).get("command") if kind in ("server", "server_compare") else None
    if recorded and kind == "server_compare":
        return as_typed(recorded)
    if recorded:
        return normal_command(recorded)
    if name in commands:
        return commands[name]
    script = SCRIPTS[kind]
    where = script if script.startswith("-m") else f"benchmarks/{script}"
    return f"python {where} (arguments not recorded)"


def machine_of(data: dict, kind: str) -> str:
    """One line naming the machine a JSON file records."""
    if kind == "memory":
        return "any (a replay of the block manager; no timing)"
    if kind == "hf_kv_bytes":
        return f"any (bytes held, no timing); torch {data.get('torch', '?')}"
    if kind == "greedy_agreement":
        return "not recorded (token ids compared, no timing)"
    machine = data["info"]["machine"] if kind in ("server", "server_compare") else data["machine"]
    if "gpu" in machine:
        return f"{machine['gpu']} ({machine['sms']} SMs), torch {machine['torch']}"
    if "cpu_model" not in machine:
        return proc_machine(machine)
    model = machine["cpu_model"]
    flags = set(machine["cpu_isa_flags"])
    isa = "/".join(label for flag, label in ISA_NAMES if flag in flags)
    if "avx512f" not in flags and "avx2" in flags:
        isa = "AVX2, no AVX-512"
    threads = machine.get("threads")
    parts = [model]
    if isa:
        parts.append(isa)
    if threads:
        parts.append(f"{threads} thread{'s' if threads != 1 else ''}")
    if machine.get("torch"):
        parts.append(f"torch {machine['torch']}")
    load = machine.get("load_average")
    before, after = machine.get("loadavg_before"), machine.get("loadavg_after")
    if load:
        parts.append(f"load average {load[0]:.1f}")
    elif before and after:
        parts.append(f"load average {before.split()[0]} to {after.split()[0]}")
    return ", ".join(parts)


def proc_machine(machine: dict) -> str:
    """The machine as the quantized benchmarks record it: /proc/cpuinfo's model name, threads
    and /proc/loadavg's lines before and after the run."""
    parts = [machine.get("cpu", "CPU not recorded")]
    threads = machine.get("threads")
    if threads:
        parts.append(f"{threads} thread{'s' if threads != 1 else ''}")
    before, after = machine.get("loadavg_before"), machine.get("loadavg_after")
    if before and after:
        parts.append(f"load average {before.split()[0]} to {after.split()[0]}")
    return ", ".join(parts)


# --------------------------------------------------------------------------------------------
# Formatting


def ms(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f"{seconds * 1e6:.1f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.1f} ms"


def num(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "" if value is None else f"{value:.{digits}f}{suffix}"


def pct(fraction: float | None) -> str:
    return "" if fraction is None else f"{100 * fraction:.1f}%"


def table(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
    align = align or "l" * len(header)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def provenance(machine: str, command: str) -> str:
    return f"Machine: {machine}. Command: `{command}`."


def image(name: str, alt: str) -> str:
    """A Markdown image of docs/img/``name``, or nothing when the file is absent."""
    return f"\n\n![{alt}](img/{name})" if (IMAGES / name).exists() else ""


# --------------------------------------------------------------------------------------------
# Sections of docs/benchmarks.md, one per JSON file


def demo_section(data: dict) -> str:
    peak, contiguous = data["peak_blocks"], data["contiguous_blocks"]
    body = [
        ["model", f"`{data['model']}`, {data.get('dtype')} on {data.get('device')}"],
        [
            "requests",
            f"{data['requests']} ({data['parallel_sampling_requests']} parallel "
            f"sampling, {data['beam_search_requests']} beam search, {data['rejected']} rejected)",
        ],
        ["generated tokens", f"{data['generated_tokens']} ({num(data['tokens_per_s'])} tokens/s)"],
        ["KV budget", f"{data['kv_budget_blocks']} blocks of {data['block_size']} tokens"],
        [
            "peak KV blocks in use",
            f"{peak} (contiguous max-length reservation: {contiguous}, "
            f"{num(contiguous / peak, 1)}x)",
        ],
        ["blocks saved by sharing (peak)", str(data["blocks_saved_by_sharing"])],
        [
            "prompt tokens computed / from cache",
            f"{data['prompt_tokens_computed']} / {data['prompt_tokens_cached']} "
            f"(of {data['prompt_tokens']})",
        ],
        ["TTFT p50 / p99", f"{num(data['ttft_p50_ms'])} / {num(data['ttft_p99_ms'])} ms"],
        ["ITL p50 / p99", f"{num(data['itl_p50_ms'])} / {num(data['itl_p99_ms'])} ms"],
        ["copy-on-write copies", str(data["cow_copies"])],
        [
            "swaps out / in (requests)",
            f"{data['swaps_out']} / {data['swaps_in']} "
            f"({data['preemptions_by_recompute']} recomputed)",
        ],
        [
            "greedy outputs == transformers' generate()",
            f"{'yes' if data['greedy_matches_transformers'] else 'no'} "
            f"({data['greedy_matching']} of {data['greedy_requests']} identical"
            + (f", {data['greedy_ties']} parting at a tie" if data.get("greedy_ties") else "")
            + ")",
        ],
    ]
    text = (
        "`python -m paged_attention demo` (what `make demo` runs): a seeded workload served with "
        "continuous batching, swapping and prefix caching in a KV budget smaller than contiguous "
        "reservation would need.\n\n"
    )
    return text + table(["", "demo"], body)


def read_limit_text(data: dict) -> str:
    """How a decode JSON's read limit was measured, in a sentence."""
    memory = data.get("read_limit", {}).get("memory")
    if memory is None:  # a run from before the read limit: its limit was a sum() of the row's size
        return "the limit is a streaming `sum()` over a buffer of as many bytes on the same machine"
    llc = data["read_limit"].get("last_level_cache_bytes")
    times = f", {memory['buffer_bytes'] / llc:.1f}x the last-level cache" if llc else ""
    return (
        "the read limit of a row is the fastest streaming read of as many bytes with all "
        f"{memory['threads']} threads the kernels use (a float32 `sum()`, an int32 `amax()` and "
        "a float32 matrix-vector product, each over a buffer of the row's size and over one of "
        f"{memory['buffer_bytes'] / 2**30:.2f} GiB{times}, measured in the same run; memory: "
        f"{num(memory['bytes_per_s'] / 1e9)} GB/s by `{memory['reader']}`). No method can read "
        "the bytes faster, so a figure above 100% would be a measurement error, which the "
        "benchmark and this page refuse"
    )


def refuse_measurement_errors(name: str, data: dict) -> None:
    """Stop (SystemExit naming the file and the row) when ``data`` holds a figure above its read
    limit: that is a measurement error, never a result to publish."""
    errors = list(data.get("measurement_errors") or [])
    rows = [*data.get("rows", []), *data.get("from_memory", [])]
    for r in rows:
        fraction = r.get("fraction_of_limit")
        if (fraction is not None and fraction > 1.0) or r.get("limit_error"):
            where = f"{r.get('dtype')} {r.get('batch')} x {r.get('context')} {r.get('method', '')}"
            errors.append(f"{where.strip()}: above the read limit")
    if errors:
        raise SystemExit(
            f"docs/results/{name}: {'; '.join(dict.fromkeys(errors))}. A figure above the read "
            "limit is a measurement error: run the benchmark again on a quieter machine"
        )


def decode_section(data: dict) -> str:
    rows = data["rows"]
    shape = data.get("shape", {})
    methods = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "limit"))
    keys = list(dict.fromkeys((r["dtype"], r["batch"], r["context"]) for r in rows))
    by = {(r["dtype"], r["batch"], r["context"], r["method"]): r for r in rows}
    body = []
    for key in keys:
        limit = by.get((*key, "limit"), {})
        cells = [key[0], f"{key[1]} x {key[2]}", num(limit.get("kv_bytes", 0) / 2**20, 0)]
        for method in methods:
            r = by.get((*key, method))
            if r is None or r.get("time_s") is None:
                cells.append("n/a")
                continue
            cell = f"{ms(r['time_s'])}, {num(r['bytes_per_s'] / 1e9)} GB/s"
            if r.get("fraction_of_limit") is not None and method in ("v1", "v2"):
                cell += f" ({pct(r['fraction_of_limit'])})"
            cells.append(cell)
        where = {"memory": ", memory", "same-size buffer": ""}.get(limit.get("bound"), "")
        cells.append(f"{num(limit.get('bytes_per_s', 0) / 1e9)} GB/s{where}" if limit else "")
        body.append(cells)
    header = ["dtype", "batch x context", "KV MiB", *methods, "read limit"]
    text = (
        f"One decode step of {shape.get('num_heads')} query heads over "
        f"{shape.get('num_kv_heads')} KV heads, head size {shape.get('head_size')}, block size "
        f"{shape.get('block_size')}, scattered block tables; every method reads the same paged "
        "cache. GB/s is the bytes of K and V the step must read divided by its time; "
        + read_limit_text(data)
        + "; the percentage is of that limit"
        + (" (caches on 2 MiB huge pages)" if data.get("huge_pages") else "")
        + ".\n\n"
    )
    return text + table(header, body, "llr" + "r" * (len(methods) + 1))


def prefill_section(data: dict) -> str:
    rows = [r for r in data["rows"] if r.get("query_len") is not None]
    methods = [
        m for m in dict.fromkeys(r["method"] for r in rows) if "limit" not in m
    ]  # the limits are summarised in the ours column
    keys = list(dict.fromkeys((r["row"], r["dtype"]) for r in rows))
    body = []
    for row_name, dtype in keys:
        group = [r for r in rows if r["row"] == row_name and r["dtype"] == dtype]
        first = group[0]
        cells = [
            f"({row_name}) {first['batch']} x {first['context']}, {first['query_len']} new",
            dtype,
        ]
        for method in methods:
            r = next((g for g in group if g["method"] == method), None)
            cells.append("n/a" if r is None or r.get("time_s") is None else ms(r["time_s"]))
        ours = next((g for g in group if g["method"] == "ours" and g.get("time_s")), {})
        cells.append(num(ours.get("speedup_vs_gather_sdpa"), 2, "x"))
        cells.append(pct(ours.get("fraction_of_roof")))
        body.append(cells)
    header = ["row", "dtype", *methods, "ours vs gather + SDPA", "ours: % of roof"]
    text = (
        "Causal attention of new query rows over a paged context (`paged_attention_varlen`), "
        "beside gathering the blocks and calling SDPA, and SDPA over contiguous K/V. The roof is "
        "the slower of a streaming read of the step's K and V and a float32 matrix product of as "
        "many operations, measured in the same run.\n\n"
    )
    return text + table(header, body, "ll" + "r" * (len(methods) + 2))


def cpu_core_section(data: dict) -> str:
    memory = data["memory"]
    reader = (
        f" (`{memory['reader']}`, {memory['bytes'] / 2**30:.2f} GiB)" if "reader" in memory else ""
    )
    label = "memory: read limit" if "reader" in memory else "memory: streaming `sum()`"
    body = [[label + reader, "", num(memory["bytes_per_s"] / 1e9, 1), ""]]
    for r in data["compute"]:
        body.append(
            [
                f"compute: v1 over a cache in L2 ({r['dtype']})",
                ms(r["time_s"]),
                num(r["bytes_per_s"] / 1e9, 1),
                "",
            ]
        )
    for r in data["from_memory"]:
        body.append(
            [
                f"v1 from memory, {r['batch']} x {r['context']} ({r['dtype']})",
                ms(r["time_s"]),
                num(r["bytes_per_s"] / 1e9, 1),
                pct(r.get("fraction_of_limit")),
            ]
        )
    text = (
        "One core's compute rate against the rate one core streams from memory. The read limit "
        "is the fastest of the streaming readers of `paged_attention.cli.machine` on one thread "
        "(for the rows from memory: the faster of that and the readers over a buffer of the "
        "row's size), measured in the same run.\n\n"
    )
    header = ["measure (one thread)", "time", "GB/s", "% of the read limit"]
    return text + table(header, body, "lrrr")


def serving_section(data: dict) -> str:
    body = []
    for r in data["rows"]:
        computed = r.get("prompt_tokens_computed")
        prompt = r.get("prompt_tokens")
        body.append(
            [
                f"{r.get('workload', '')} ({r.get('requests', '')})",
                r.get("dtype", ""),
                r.get("arrivals", ""),
                r["config"],
                num(r.get("tokens_per_s"), 1),
                " / ".join(num(r.get(k), 1) for k in ("ttft_p50_ms", "ttft_p99_ms"))
                if r.get("ttft_p50_ms") is not None
                else "",
                " / ".join(num(r.get(k), 1) for k in ("itl_p50_ms", "itl_p99_ms"))
                if r.get("itl_p50_ms") is not None
                else "",
                f"{computed} of {prompt}" if computed is not None else "",
                str(r["peak_blocks"]) if r.get("peak_blocks") is not None else "",
            ]
        )
    header = [
        "workload (requests)",
        "dtype",
        "arrivals",
        "config",
        "tokens/s",
        "TTFT p50 / p99 ms",
        "ITL p50 / p99 ms",
        "prompt tokens computed",
        "peak KV blocks",
    ]
    models = ", ".join(
        f"{label}: `{data[key]}`"
        for key, label in (("chat_model", "chat model"), ("token_model", "token-id model"))
        if data.get(key)
    )
    text = (
        f"The engine beside transformers' own batching on the same model and prompts ({models}; "
        f"block size {data.get('block_size')}). Tokens/s is generated tokens over the wall time "
        "from the first arrival to the last token.\n\n"
    )
    return text + table(header, body, "llllrrrrr")


def server_section(data: dict) -> str:
    info = data["info"]
    body = [
        [
            r["load"],
            num(r.get("output_tokens_per_s"), 1),
            " / ".join(num(r.get(k), 1) for k in ("ttft_p50_ms", "ttft_p99_ms")),
            " / ".join(num(r.get(k), 1) for k in ("itl_p50_ms", "itl_p99_ms")),
            num(r.get("e2e_p50_ms"), 1),
            str(r.get("errors", 0)),
        ]
        for r in data["rows"]
    ]
    header = [
        "load",
        "output tokens/s",
        "TTFT p50 / p99 ms",
        "ITL p50 / p99 ms",
        "end-to-end p50 ms",
        "errors",
    ]
    text = (
        f"Streaming chat completions over HTTP against `paged-attention serve` (model "
        f"`{info.get('model')}`, {info.get('requests_per_run')} requests of "
        f"{info.get('max_tokens')} tokens per load), with Poisson arrivals and closed-loop "
        "clients.\n\n"
    )
    return text + table(header, body, "lrrrrr")


COMPARE_METRICS = (
    ("output_tokens_per_s", "output tok/s", 1),
    ("ttft_p50_ms", "TTFT p50 ms", 0),
    ("ttft_p90_ms", "TTFT p90 ms", 0),
    ("itl_p50_ms", "ITL p50 ms", 1),
    ("itl_p90_ms", "ITL p90 ms", 1),
    ("server_cores", "CPU cores used by the server", 2),
    ("other_cores", "cores used by other processes meanwhile", 2),
    ("steal_cores", "cores stolen by the VM meanwhile", 2),
)


def spread_cell(stats: dict | None, digits: int) -> str:
    """A median over rounds, with the range where the rounds differ."""
    if stats is None:
        return "n/a"
    text = f"{stats['median']:.{digits}f}"
    low, high = f"{stats['min']:.{digits}f}", f"{stats['max']:.{digits}f}"
    return text if low == high else f"{text} ({low}-{high})"


def compare_table_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """bench_server.py --compare's summary as a header (the servers) and rows: each load's
    metrics, then peak memory and start time."""
    servers = list(summary)
    loads = list(dict.fromkeys(load for s in summary.values() for load in s["loads"]))
    rows = []
    for load in loads:
        for metric, label, digits in COMPARE_METRICS:
            cells = [summary[s]["loads"].get(load, {}).get(metric) for s in servers]
            rows.append([f"{load}: {label}", *(spread_cell(c, digits) for c in cells)])
    memory = [summary[s]["peak_rss_bytes"] for s in servers]
    memory = [m and {key: value / 1e9 for key, value in m.items()} for m in memory]
    rows.append(["peak resident memory GB", *(spread_cell(m, 2) for m in memory)])
    rows.append(
        ["start until /health s", *(spread_cell(summary[s]["start_s"], 1) for s in servers)]
    )
    return ["", *servers], rows


def as_typed(command: str) -> str:
    """A recorded command line as a reader would type it from the repository's root: this
    Python as ``python``, the JSON and the plot where they are committed, the llama-server binary
    from the script that builds it, ports as PORT, other files by their names (an argument that
    is itself a command line, e.g. ``--serve-command``, likewise)."""
    words = shlex.split(command)
    out = []
    for i, word in enumerate(words):
        before = words[i - 1] if i else ""
        if " " in word:
            word = as_typed(word)
        elif before == "--llama-server":
            word = "LLAMA_SERVER"
        elif before == "--port":
            word = "PORT"
        elif re.search(r"(^|/)python3?(\.\d+)?$", word):
            word = "python"
        elif before in ("--json", "--plot") or word.startswith("/"):
            folder = {".json": "docs/results/", ".png": "docs/img/"}.get(Path(word).suffix, "")
            word = folder + Path(word).name
        out.append(word)
    if out and out[0].startswith("benchmarks/"):
        out.insert(0, "python")
    built = '"$(bash benchmarks/build_llama_server.sh | tail -1)"'
    return shlex.join(out).replace("LLAMA_SERVER", built)


def server_compare_section(data: dict) -> str:
    info = data["info"]
    header, rows = compare_table_rows(data["summary"])
    loads = "; ".join(
        f"{load['name']} ({load['clients']} client{'s' if load['clients'] != 1 else ''}, "
        f"{load['requests']} requests)"
        for load in info["loads"]
    )
    commands = {r["server"]: as_typed(r["command"]) for r in data["runs"] if r["round"] == 1}
    starts = "; ".join(f"{server}: `{command}`" for server, command in commands.items())
    others = [
        row["other_cores"] + row["steal_cores"] for run in data["runs"] for row in run["loads"]
    ]
    before, after = info["loadavg_before"], info["loadavg_after"]
    text = (
        f"`paged-attention serve` and llama.cpp's `llama-server` on the same GGUF "
        f"(`{info['gguf']}`), started alternately ({info['rounds']} rounds of A B, never both "
        f"loaded), with the same streaming OpenAI client, greedy: {loads}. Each cell is the "
        "median over the rounds (the range in brackets). Tokens are the server's usage counts "
        "(llama-server's streamed chunks where it sends none); cores are CPU seconds over the "
        "wall time, of the server's process tree and of everything else on the machine. The "
        f"servers were started as: {starts} (the port chosen free).\n\n"
        f"The machine was shared while this ran: load average {before[0]:.1f} at the start and "
        f"{after[0]:.1f} at the end, other processes and the VM took "
        f"{min(others):.2f}-{max(others):.2f} cores during the loads. On a loaded machine the "
        "figures are indicative: compare the two servers' columns, measured in turns under the "
        "same load, rather than the absolute rates.\n\n"
    )
    return text + table(header, rows, "l" + "r" * (len(header) - 1))


def memory_section(data: dict) -> str:
    trace = data["trace"]
    util = [
        [name, pct(v["utilisation"]), pct(v["waste"])] for name, v in data["utilisation"].items()
    ]
    sharing = data["sharing"]
    share = []
    for key, label in (
        ("parallel_sampling_saving", "parallel sampling, n ="),
        ("beam_search_saving", "beam search, width"),
    ):
        values = sharing[key]
        share.append([f"{label} {' / '.join(values)}", " / ".join(pct(v) for v in values.values())])
    text = (
        f"A seeded trace of {trace['requests']} chat-shaped requests ({trace['distribution']}), "
        f"served {trace['concurrency']} at a time by the real `BlockManager`; sharing over "
        f"{sharing['requests']} requests at block size {sharing['block_size']}.\n\n"
    )
    return (
        text
        + table(["KV cache scheme", "holds tokens", "wasted"], util, "lrr")
        + "\n\n"
        + table(["decoding", "KV memory saved by sharing"], share, "lr")
    )


def hf_kv_bytes_section(data: dict) -> str:
    body = [
        [
            r["run"],
            str(r.get("prompt_len", r.get("prompt", ""))),
            f"{r['dynamic_cache_bytes'] / 2**20:.2f} MiB",
            f"{r['paged_peak_bytes'] / 2**20:.2f} MiB",
            f"{r['ratio']:.2f}",
            "yes" if r.get("same_tokens") else "no",
        ]
        for r in data["results"]
    ]
    text = (
        f"The same `generate()` with transformers' `DynamicCache` and with `PagedCache` (block "
        f"size {data.get('block_size')}): bytes of keys and values held.\n\n"
    )
    header = ["run", "prompt", "DynamicCache", "PagedCache (peak)", "ratio", "same tokens"]
    return text + table(header, body, "lrrrrl")


def mla_section(data: dict) -> str:
    sizes = [
        [
            f"`{r['model']}`",
            str(r["dims"]["num_heads"]),
            f"{r['expanded']['bytes_per_token_per_layer']:,}",
            f"{r['latent']['bytes_per_token_per_layer']:,}",
            f"{r['ratio']:.1f}",
        ]
        for r in data["kv_bytes"]
    ]
    decode = [
        [
            str(r["batch"]),
            str(r["context"]),
            num(r["expanded"]["ms_per_step_best"], 1),
            num(r["latent"]["ms_per_step_best"], 1),
            f"{r['expanded_over_latent']:.2f}",
            f"{r['expanded']['cache_bytes_in_use'] / 2**20:.1f} / "
            f"{r['latent']['cache_bytes_in_use'] / 2**20:.1f} MiB",
        ]
        for r in data["decode"]
    ]
    model = data["decode_model"]
    settings = data["settings"]
    return (
        "KV bytes per token per layer in bfloat16, read from the caches allocated for the "
        'config classes\' default dimensions (`mla="expanded"` and `mla="latent"`):\n\n'
        + table(["model", "heads", "expanded", "latent", "ratio"], sizes, "lrrrr")
        + "\n\nDecode time per step (the best of "
        f"{settings['rounds']} rounds of {settings['steps']} steps, the forms taking turns) of a "
        f"random {model['num_hidden_layers']}-layer DeepSeek-V3-like model in {model['dtype']} "
        f"({model['num_attention_heads']} heads, `kv_lora_rank` {model['kv_lora_rank']}, "
        f"hidden size {model['hidden_size']}) through `generate()`'s `PagedCache`:\n\n"
        + table(
            [
                "batch",
                "context",
                "expanded ms",
                "latent ms",
                "expanded / latent",
                "KV held (expanded / latent)",
            ],
            decode,
            "rrrrrr",
        )
    )


def block_manager_section(data: dict) -> str:
    results = data["results"]
    kinds = list(results)
    columns = list(results[kinds[0]])
    body = [[column, *(num(results[k][column], 1) for k in kinds)] for column in columns]
    workload = data.get("workload", {})
    text = (
        f"Block-manager bookkeeping per step: {workload.get('num_seqs')} sequences of "
        f"{workload.get('prompt_len')} tokens ({workload.get('shared_prefix')} shared), block "
        f"size {workload.get('block_size')}, beside a list-based manager.\n\n"
    )
    return text + table(["measure", *kinds], body, "l" + "r" * len(kinds))


GGUF_VARIANTS = {
    "vnni": "its AVX512-VNNI variant",
    "avx2": "its AVX2 variant",
    "reference": "its portable scalar loop",
}


def gguf_linear_section(data: dict) -> str:
    body = [
        [
            r["layer"],
            r["format"],
            f"{r['out']} x {r['in']}",
            str(r["batch"]),
            num(r["int4pack_us"]),
            num(r["gguf_us"]),
            num(r["int4pack_us"] / r["gguf_us"], 2, "x"),
            num(r["int8pack_us"]),
        ]
        for r in data["rows"]
    ]
    header = [
        "layer",
        "format",
        "out x in",
        "rows",
        "int4pack µs",
        "gguf µs",
        "gguf speed-up",
        "bare `_weight_int8pack_mm` µs",
    ]
    variant = GGUF_VARIANTS[data.get("gguf_variant", "vnni")]
    text = (
        f"One quantized linear layer at SmolLM2-135M's shapes, {data.get('dtype', 'bfloat16')} "
        "inputs of 1 to 32 rows: torch's int4pack kernel and the gguf kernel (int8 activations, "
        f"{variant}), each through the `QuantizedLinear` layer's `forward`, and for scale torch's "
        "`_weight_int8pack_mm` called bare (int8 weights with one scale per row: not the GGUF "
        "format, no layer around it). Each figure is the fastest of the script's `--repeats` "
        "calls (default 100; a twentieth, at least 3, for the LM head); the speed-up is "
        "int4pack's time over gguf's.\n\n"
    )
    return text + table(header, body, "lllrrrrr")


def rounds_of(rows: list[dict], group: Callable[[dict], tuple]) -> dict[tuple, list[dict]]:
    """``rows`` by ``group(row)``, each group's rows in the order they ran (round by round)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(group(r), []).append(r)
    return groups


def rounds_cell(values: list[float], digits: int) -> str:
    """The median of ``values``, then each round's value in the order they ran."""
    each = ", ".join(num(v, digits) for v in values)
    return f"{num(statistics.median(values), digits)} ({each})"


def quantized_section(data: dict) -> str:
    groups = rounds_of(data["rows"], lambda r: (r["config"], r["weights"]))
    batches = sorted(
        int(key.removeprefix("tok_s_")) for key in data["rows"][0] if key.startswith("tok_s_")
    )
    body = [
        [
            config,
            f"`{weights}`",
            *(rounds_cell([r[f"tok_s_{b}"] for r in rows], 1) for b in batches),
            rounds_cell([r["load_s"] for r in rows], 2),
            rounds_cell([r["rss_mb"] for r in rows], 0),
        ]
        for (config, weights), rows in groups.items()
    ]
    rounds = max(len(rows) for rows in groups.values())
    header = [
        "config",
        "`--weights`",
        *(f"tok/s, {b} request{'s' if b != 1 else ''}" for b in batches),
        "load s",
        "resident MB",
    ]
    text = (
        f"SmolLM2-135M-Instruct generating {data['tokens']} greedy tokens per request offline "
        "(prefill included, the end-of-sequence token never produced): float weights "
        "(`--weights bf16` or `fp32`), and "
        "`--weights auto` (the GGUF's quantized blocks) through torch's int4pack kernel and "
        "through the gguf kernel. Each measurement runs in a fresh process (its resident memory "
        f"is that model's alone), the configurations alternating A B C over {rounds} rounds. "
        "Each cell is the median over the rounds, then each round's value in the order they "
        "ran.\n\n"
    )
    return text + table(header, body, "ll" + "r" * (len(batches) + 2))


ENGINE_STEP_MEASURES = {
    "tiny64": (("step_ms_median", "step ms, median"), ("step_ms_p90", "step ms, p90")),
    "chat": (("tok_per_s", "tokens/s"),),
}


def engine_step_section(data: dict) -> str:
    groups = rounds_of(data["rows"], lambda r: (r["workload"], r["tree"]))
    body = []
    for (workload, tree), rows in groups.items():
        rows = sorted(rows, key=lambda r: r["round"])
        load = "; ".join(f"{r['load_before']:.1f} to {r['load_after']:.1f}" for r in rows)
        for key, label in ENGINE_STEP_MEASURES[workload]:
            body.append([workload, tree, label, rounds_cell([r[key] for r in rows], 2), load])
    rounds = max(len(rows) for rows in groups.values())
    header = ["workload", "tree", "measure", "median (each round)", "load average, each round"]
    text = (
        "The engine's own cost per step, source trees against one another in one run, each "
        "tree in a fresh process per workload, the trees alternating A B A B over "
        f"{rounds} round{'s' if rounds != 1 else ''}. `tiny64`: the tiny random Llama, 64 "
        "requests of 16 prompt tokens and 48 greedy new tokens each, eager; the time of every "
        "step in which all 64 sequences decode (the engine's overhead: scheduling, inputs, "
        "sampling, outputs). `chat`: SmolLM2-135M-Instruct in bfloat16, 32 chat questions, 64 "
        "greedy new tokens each, all at time 0: output tokens per second.\n\n"
    )
    return text + table(header, body, "lllrl")


START_MEASURES = (
    ("first_answer_s", "first answer on /health (503 while loading, or 200)"),
    ("health_s", "/health answers 200 (ready)"),
    ("first_completion_s", "first completion answered"),
)


def server_process_section(data: dict) -> str:
    names = list(data["checkouts"])
    header = ["round", "load average", "offline engine tok/s"]
    for name in names:
        header += [f"{name}: tok/s", f"{name} / offline", f"{name}: /health s"]
        header += [f"{name}: cores (HTTP side, engine, client)"]
    body = []
    for entry in data["rounds"]:
        offline = entry["offline"]["tok_s"]
        row = [str(entry["round"] + 1), entry["load_before"].split()[0], num(offline, 1)]
        for name in names:
            run = entry[name]
            cores = ", ".join(num(run[f"{p}_cores"], 2) for p in ("server", "engine", "client"))
            row += [num(run["tok_s"], 1), f"{100 * run['tok_s'] / offline:.0f}%"]
            row += [num(run["health_s"], 1), cores]
        body.append(row)
    args = data.get("serve_args") or "(none)"
    text = (
        "Decode tokens/s of one greedy answer streamed through `serve` (the openai client), "
        "and of the same engine offline (the engine `serve` builds from the same arguments, "
        f"built in the benchmark's process), in the same round; serve's arguments: `{args}`. "
        "Cores are CPU seconds over the wall time of the measured answer, of `serve`'s process "
        "(the HTTP side), of its engine's process and of the client.\n\n"
    )
    return text + table(header, body, "l" + "r" * (len(header) - 1))


def start_split_section(data: dict) -> str:
    groups = rounds_of(data["rows"], lambda r: (r["tree"],))
    body = [
        [tree, step, rounds_cell([r[step] for r in rows if step in r], 2)]
        for (tree,), rows in groups.items()
        for step in dict.fromkeys(key for r in rows for key in r if key != "tree")
    ]
    rounds = max(len(rows) for rows in groups.values())
    args = " ".join(data.get("serve_args") or []) or "(none)"
    text = (
        "Seconds of each step of what `serve`'s engine process does before it is ready, on "
        "one core's critical path (the HTTP side runs beside it, in the other process), in a "
        f"fresh interpreter per start, {rounds} round{'s' if rounds != 1 else ''}; serve's "
        f"arguments: `{args}`. The imports are those `serve` makes before it forks the "
        "engine's process; `build_engine` loads the compiled decode steps (when their cache "
        "is warm) and warms the engine up.\n\n"
    )
    return text + table(["tree", "step", "median s (each start)"], body, "llr")


def start_section(data: dict) -> str:
    groups = rounds_of(data["rows"], lambda r: (r["tree"],))
    body = [
        [tree, label, rounds_cell([r[key] for r in rows], 1)]
        for (tree,), rows in groups.items()
        for key, label in START_MEASURES
    ]
    rounds = max(len(rows) for rows in groups.values())
    text = (
        "Seconds from starting `python -m paged_attention serve` (the default model, already "
        "converted) until the server answers, source trees alternating A B A B over "
        f"{rounds} round{'s' if rounds != 1 else ''}, each start a fresh process.\n\n"
    )
    return text + table(["tree", "measure", "median s (each start)"], body, "llr")


def spec_decode_section(data: dict) -> str:
    groups = rounds_of(data["rows"], lambda r: (r["shape"], r["config"]))
    body = []
    for (shape, config), rows in groups.items():
        drafted = sum(r["drafted"] for r in rows)
        accepted = sum(r["accepted"] for r in rows)
        rate = f"{accepted / drafted:.0%} ({accepted} of {drafted})" if drafted else "-"
        same = (
            f"{sum(r['same_tokens_as_plain'] for r in rows)} of {sum(r['requests'] for r in rows)}"
        )
        load = "; ".join(f"{r['load_before']:.1f} to {r['load_after']:.1f}" for r in rows)
        tok_s = rounds_cell([r["tok_per_s"] for r in rows], 1)
        steps = rounds_cell([r["steps"] for r in rows], 0)
        body.append([shape, config, tok_s, steps, rate, same, load])
    first = data["rows"][0]
    rounds = max(len(rows) for rows in groups.values())
    header = ["shape", "config", "tokens/s", "steps", "drafts accepted", "same tokens as plain",
              "load average, each round"]  # fmt: skip
    drafter = ""
    if data.get("draft_weights"):
        drafter = f" and with a draft model (the same model, weights {data['draft_weights']})"
    text = (
        f"Speculative decoding with n-gram (prompt lookup) drafts{drafter} against plain "
        f"decoding, {data.get('model', 'smollm2')} in bfloat16, greedy: {first['requests']} "
        "chat requests "
        f"asking to repeat a Python function with a variable renamed ({first['prompt_tokens']} "
        f"prompt tokens in all), {first['generated'] // first['requests']} new tokens each, the "
        "end of sequence ignored. Each configuration on a fresh engine over the same model, "
        f"alternating A B A B over {rounds} round{'s' if rounds != 1 else ''}; `single`: the "
        "requests one after another (batch 1), `batch`: all at once. Medians (each round); "
        "drafts accepted over all rounds; runs of a request whose tokens equal the plain "
        "run's (a multi-token query may round differently in bfloat16, so a greedy answer may "
        "part from the plain one at a near-tie).\n\n"
    )
    return text + table(header, body, "llrrrrl")


OFFLINE_ENGINES = {
    "ours": "ours",
    "ours-compiled": "ours, compiled decode steps",
    "ours-auto": "ours, `--weights auto`",
    "ours-unpacked": "ours, float layers not packed (`PAGED_ATTENTION_PACK_LINEAR=0`)",
    "ours-unfused": "ours, sibling projections not fused (`PAGED_ATTENTION_FUSE_PROJECTIONS=0`)",
    "vllm": "vLLM",
    "limit": "limit: the matrix products alone",
}


def offline_engine_text(data: dict) -> str:
    """How each engine ran, from what the runs recorded of their settings."""
    settings = {r["config"]: r["settings"] for r in data["rows"]}
    parts = []
    ours = settings.get("ours") or settings.get("ours-auto")
    if ours:
        parts.append(
            f"ours: torch {ours['torch']}, {ours['torch_threads']} threads, "
            f"{'compiled' if ours['compile'] else 'eager'} steps (the default), block size "
            f"{ours['block_size']}, max {ours['max_num_seqs']} sequences"
        )
    compiled = settings.get("ours-compiled")
    if compiled:
        sizes = ", ".join(map(str, compiled["compile_sizes"]))
        parts.append(
            f"ours, compiled decode steps: as `serve` runs them by default once its compile "
            f"cache is warm, one step compiled by inductor per padded batch size ({sizes}; "
            f"max {compiled['max_num_seqs']} sequences), loaded from that cache before the "
            "engine is ready"
        )
    vllm = settings.get("vllm")
    if vllm:
        step = "eager" if vllm["enforce_eager"] else f"compiled by {vllm['compile_backend']}"
        parts.append(
            f"vLLM {vllm['vllm']}: torch {vllm['torch']}, its step {step} (compilation mode "
            f"{vllm['compilation_mode']}, the CPU default), OpenMP threads bound to cores "
            f"{vllm['omp_threads_bind']}, block size {vllm['block_size']}, max "
            f"{vllm['max_num_seqs']} sequences and {vllm['max_num_batched_tokens']} tokens a step"
        )
    return "; ".join(parts)


def offline_compile_cache(data: dict) -> str:
    """What the load times of the compiling engines include: loading their compiled steps, or
    compiling them; and the untimed first processes that warmed their caches."""
    parts = []
    for config, name in (("vllm", "vLLM's"), ("ours-compiled", "ours compiled")):
        rows = [r for r in data["rows"] if r["config"] == config]
        states = [r["settings"].get("compile_cache") for r in rows]
        if not states:
            continue
        if set(states) == {"warm"}:
            parts.append(f"{name}: loading its compiled steps from its compile cache, in every run")
        else:
            cold = states.count("cold")
            parts.append(f"{name}: compiling in {cold} of {len(states)} runs, else loading")
    if not parts:
        return ""
    warm_ups = data.get("compile_warm_up") or []
    text = f" ({'; '.join(parts)})"
    if warm_ups:
        found = ", ".join(
            f"{OFFLINE_ENGINES[w['config']]} {w['dtype']} {w['compile_cache']} "
            f"({w['load_s']:.0f} s)"
            for w in warm_ups
        )
        text += f"; before the first round an untimed process of each warmed its cache ({found})"
    return text


def offline_section(data: dict) -> str:
    groups = rounds_of(data["rows"], lambda r: (r["dtype"], r["config"]))
    summary = {(s["dtype"], s["config"]): s for s in data["summary"]}
    body = []
    for (dtype, config), rows in groups.items():
        entry = summary[(dtype, config)]
        ratio = entry.get("ratio_to_vllm")
        same = [r for r in rows if "same_as_vllm" in r]
        of_limit = entry.get("of_limit")
        if "target_of_limit" in entry:
            share = f"{data['target_ratio']}x vLLM: {100 * entry['target_of_limit']:.0f}%"
        else:
            share = "" if of_limit is None else f"{100 * of_limit:.0f}%"
        body.append(
            [
                dtype,
                OFFLINE_ENGINES[config],
                rounds_cell([r["tok_per_s"] for r in rows], 1),
                "" if ratio is None else f"{ratio:.2f}x" + ("" if entry["meets_target"] else " ✗"),
                share,
                rounds_cell([r["load_s"] for r in rows], 1),
                rounds_cell([r["peak_rss_mb"] for r in rows], 0),
                ", ".join(f"{r['same_as_vllm']} of {data['workload']['requests']}" for r in same),
                "; ".join(f"{r['load_before'][0]:.1f} to {r['load_after'][0]:.1f}" for r in rows),
            ]
        )
    work, settings = data["workload"], data["settings"]
    rounds = settings["rounds"]
    header = ["dtype", "engine", "output tok/s, median (each round)", "vs vLLM", "of the limit",
              "load s", "peak resident MB", "answers equal to vLLM's",
              "load average, each run"]  # fmt: skip
    text = (
        f"The offline engine against vLLM's CPU engine on one workload: {work['model']} "
        f"(SmolLM2-135M-Instruct; both engines load the same float checkpoint, the GGUF "
        f"de-quantized, in the row's dtype), {work['requests']} chat questions through its "
        f"template ({work['prompt_tokens']} prompt tokens in all), {work['new_tokens']} greedy "
        "new tokens each, the end of sequence ignored, all requests given at once. Each run is "
        f"a fresh process; the engines take turns over {rounds} round"
        f"{'s' if rounds != 1 else ''} on the same {len(settings['cores'])} cores "
        f"({offline_engine_text(data)}). Output tok/s is the "
        f"{work['requests']} x {work['new_tokens']} tokens over the wall time of `generate` "
        "after a one-request warm-up; load s from the process's start until the engine is "
        f"ready{offline_compile_cache(data)}; peak resident memory of the run's process "
        "tree. vs vLLM: the median's ratio to vLLM's in the same dtype, ✗ below the "
        f"{data['target_ratio']}x target."
        f"{offline_limit_text(data)}\n\n"
    )
    return text + table(header, body, "llrrrrrll")


def offline_limit_text(data: dict) -> str:
    """What the ``limit`` rows are, when the run has them."""
    if not any(r["config"] == "limit" for r in data["rows"]):
        return ""
    return (
        " The limit rows run no engine: the workload's matrix products alone (per layer the "
        "query/key/value projections as one product, the output projection, gate/up as one and "
        "down, over the prompts' distinct prefixes and then 32 rows at each later step, and the "
        "LM head at every step; every layer's own weights, one layer after the other, the "
        "faster of `torch.nn.Linear` and the packed oneDNN layer), timed in the same round and "
        "given as output tokens per second: an engine whose products run on this machine's "
        "matrix library cannot be faster, since it also runs the attention and the rest. Of "
        "the limit: each median as a share of the limit's, and on the limit's row the share "
        "that the target (that many times vLLM's median) would be."
    )


def agreement_remark(pairs: dict, reference: str, questions: int) -> str:
    """How our variants' first divergences from ``reference`` line up, question by question."""
    ours = [pair for name, pair in pairs.items() if name.endswith(f" vs {reference}")]
    firsts = list(zip(*(pair["first_divergence"] for pair in ours)))
    same = sum(1 for f in firsts if None not in f and len(set(f)) == 1)
    shared = sum(
        1 for f in firsts if len({p for p in f if p is not None}) < sum(p is not None for p in f)
    )
    agree = [p["mean_match_fraction"] for n, p in pairs.items() if reference not in n]
    differ = [p["mean_match_fraction"] for p in ours]
    text = (
        f"Against `{reference}`, all {len(ours)} of our variants first differ at the same "
        f"token position in {same} of {questions} questions, and at least two of them do in "
        f"{shared}."
    )
    if agree and max(differ) < min(agree):
        text += (
            f" Our variants agree with one another on {num(min(agree), 2)} to "
            f"{num(max(agree), 2)} of the tokens and each with `{reference}` on only "
            f"{num(min(differ), 2)} to {num(max(differ), 2)}: they mostly part from it at the "
            "same places, so the difference from it is shared by all our weights variants "
            "rather than one kernel's arithmetic."
        )
    return text


def greedy_agreement_section(data: dict) -> str:
    pairs = data["pairs"]
    body = [
        [
            f"{name}",
            num(pair["mean_match_fraction"], 3),
            f"{pair['questions_identical']} of {pair['questions']}",
        ]
        for name, pair in pairs.items()
    ]
    questions = max(pair["questions"] for pair in pairs.values())
    text = (
        f"Greedy tokens of SmolLM2-135M-Instruct on {questions} questions through the chat "
        f"template, {data['tokens']} tokens each, the end of sequence ignored: `--weights auto` "
        "through the gguf and the int4pack kernels and `--weights bf16`, against one another "
        "and against llama.cpp's `llama-server` on the same GGUF file where it ran. Per pair: "
        "the mean over the questions of the fraction of positions where the two tokens match, "
        "and the questions whose tokens all match.\n\n"
    )
    text += table(["pair", "mean fraction matching", "questions identical"], body, "lrr")
    if any(name.endswith(" vs llama-server") for name in pairs):
        text += "\n\n" + agreement_remark(pairs, "llama-server", questions)
    return text


SECTIONS: dict[str, tuple[str, Callable[[dict], str], str | None]] = {
    "demo": ("Serving demo", demo_section, "demo_kv_memory.png"),
    "decode": ("Decode attention", decode_section, "bench_decode_{device}.png"),
    "prefill": ("Prefill / varlen attention", prefill_section, "bench_prefill_{device}.png"),
    "decode_cpu_core": ("One CPU core: compute and memory", cpu_core_section, None),
    "serving": ("Serving: the engine and transformers", serving_section, "bench_serving.png"),
    "server": ("HTTP server under load", server_section, "bench_server.png"),
    "server_compare": (
        "`serve` and llama-server side by side",
        server_compare_section,
        "bench_server_compare.png",
    ),
    "memory": ("KV memory: paged vs. contiguous, and sharing", memory_section, "bench_memory.png"),
    "hf_kv_bytes": ("transformers `generate()`: KV bytes held", hf_kv_bytes_section, None),
    "block_manager": ("Block manager: cost per step", block_manager_section, None),
    "mla": ("Multi-head latent attention: latent and expanded caches", mla_section, None),
    "engine_step": ("Engine: cost per step, tree against tree", engine_step_section, None),
    "spec_decode": ("Speculative decoding: n-gram and model drafts", spec_decode_section, None),
    "gguf_linear": ("Quantized linear layers: gguf and int4pack", gguf_linear_section, None),
    "quantized": ("Quantized weights end to end", quantized_section, None),
    "start": ("Start: `serve` until it answers", start_section, None),
    "start_split": ("Start: where the engine's side goes", start_split_section, None),
    "server_process": ("One user: `serve` against its own engine", server_process_section, None),
    "offline": ("The offline engine against vLLM's CPU engine", offline_section, None),
    "greedy_agreement": (
        "Greedy agreement: weights variants and llama-server",
        greedy_agreement_section,
        None,
    ),
}


def admonition(text: str) -> str:
    return f'!!! note "About this run"\n    {text}'


def benchmarks_page(results: dict[str, dict], commands: dict[str, str], notes: dict) -> str:
    parts = [admonition(note) for note in notes.get(None, [])]
    for kind, (title, render, picture) in SECTIONS.items():
        for name, data in results.items():
            if kind_of(data) != kind:
                continue
            device = data.get("device", "cpu")
            heading = f"### {title}" + (f" ({device})" if kind in ("decode", "prefill") else "")
            picture_name = picture.format(device=device) if picture else None
            # A picture belongs to the JSON it was drawn from: the default file name only.
            shown = picture_name and (
                Path(picture_name).stem == Path(name).stem or (kind, name) == ("demo", "demo.json")
            )
            parts.append(
                f"{heading}\n\n"
                + provenance(machine_of(data, kind), command_of(name, data, kind, commands))
                + f" File: `docs/results/{name}`.\n\n"
                + "".join(admonition(note) + "\n\n" for note in notes.get(name, []))
                + render(data)
                + (image(picture_name, title) if shown else "")
            )
    unknown = [name for name, data in results.items() if kind_of(data) is None]
    if unknown:
        parts.append("Files of no known benchmark: " + ", ".join(f"`{n}`" for n in unknown) + ".")
    if not results:
        parts.append("No benchmark results are committed.")
    return "\n\n".join(parts)


# --------------------------------------------------------------------------------------------
# The README's headline table and the performance page


def _first(results: dict[str, dict], kind: str) -> tuple[str, dict] | None:
    return next(((n, d) for n, d in results.items() if kind_of(d) == kind), None)


def _largest(rows: list[dict]) -> tuple:
    return max((r["kv_bytes"], r["batch"], r["context"]) for r in rows)


def demo_headline(data: dict) -> tuple[str, str] | None:
    peak, contiguous = data["peak_blocks"], data["contiguous_blocks"]
    return (
        f"serving demo, `{data['model']}`, {data['requests']} requests",
        f"peak {peak} KV blocks against {contiguous} for contiguous reservation "
        f"({num(contiguous / peak)}x); {num(data['tokens_per_s'])} tokens/s; greedy outputs "
        f"equal `generate()`: {'yes' if data['greedy_matches_transformers'] else 'no'}",
    )


def decode_headline(data: dict) -> tuple[str, str] | None:
    dtypes = {r["dtype"] for r in data["rows"]}
    dtype = next((d for d in ("bfloat16", "float32") if d in dtypes), None)
    v1 = [
        r for r in data["rows"] if r["dtype"] == dtype and r.get("time_s") and r["method"] == "v1"
    ]
    if not v1:
        return None
    top = _largest(v1)
    row = next(r for r in v1 if (r["kv_bytes"], r["batch"], r["context"]) == top)
    result = (
        f"{ms(row['time_s'])}, {num(row['bytes_per_s'] / 1e9)} GB/s = "
        f"{pct(row.get('fraction_of_limit'))} of the read limit"
    )
    if row.get("speedup_vs_gather_sdpa"):
        result += f"; {num(row['speedup_vs_gather_sdpa'])}x gather + SDPA"
    return f"decode attention, {dtype}, {row['batch']} x {row['context']} tokens", result


def prefill_headline(data: dict) -> tuple[str, str] | None:
    ours = [r for r in data["rows"] if r["method"] == "ours" and r.get("time_s")]
    chunk = [r for r in ours if r["row"] == "b" and r["dtype"] == "bfloat16"] or ours[:1]
    if not chunk:
        return None
    r = chunk[0]
    return (
        f"varlen attention, {r['dtype']}, {r['batch']} x {r['context']}, "
        f"{r['query_len']} new tokens each",
        f"{ms(r['time_s'])}; {num(r.get('speedup_vs_gather_sdpa'), 2)}x gather + SDPA, "
        f"{pct(r.get('fraction_of_roof'))} of the roof",
    )


def serving_headline(data: dict) -> tuple[str, str] | None:
    rows = data["rows"]
    workloads = [r for r in rows if r.get("workload") == "chat"] or rows
    best = max(
        (r for r in workloads if r["config"].startswith("engine")),
        key=lambda r: r["tokens_per_s"],
        default=None,
    )
    if not best:
        return None
    same = (best.get("dtype"), best.get("requests"))
    peers = {
        r["config"]: r
        for r in workloads
        if r["config"].startswith("transformers") and (r.get("dtype"), r.get("requests")) == same
    }
    result = f"{num(best['tokens_per_s'])} tokens/s ({best['config']}, {best.get('dtype')})"
    for config, label in (
        ("transformers generate_batch()", "transformers `generate_batch()`"),
        ("transformers generate()", "a padded `generate()`"),
    ):
        if config in peers:
            rate = peers[config]["tokens_per_s"]
            result += f"; {label} {num(rate)} ({num(best['tokens_per_s'] / rate)}x)"
    return f"serving, {best.get('workload')} workload, {best.get('requests')} requests", result


def memory_headline(data: dict) -> tuple[str, str] | None:
    util = data["utilisation"]
    paged = util.get("paged, block 16")
    contiguous = util.get("contiguous, max length")
    if not (paged and contiguous):
        return None
    beams = data["sharing"]["beam_search_saving"].get("4")
    result = (
        f"{pct(paged['waste'])} of KV memory wasted "
        f"(contiguous max-length reservation: {pct(contiguous['waste'])})"
    )
    if beams is not None:
        result += f"; beam search width 4 shares {pct(beams)}"
    return "KV memory, paged, block 16", result


def server_headline(data: dict) -> tuple[str, str] | None:
    best = max(data["rows"], key=lambda r: r.get("output_tokens_per_s") or 0)
    return (
        f"HTTP server, {best['load']}",
        f"{num(best['output_tokens_per_s'])} output tokens/s, TTFT p50 "
        f"{num(best.get('ttft_p50_ms'))} ms",
    )


# Each kind's headline row (what, result), in the README's order; the last two only while
# fewer than six rows are taken.
HEADLINES: tuple[tuple[str, Callable[[dict], tuple[str, str] | None]], ...] = (
    ("demo", demo_headline),
    ("decode", decode_headline),
    ("prefill", prefill_headline),
    ("serving", serving_headline),
    ("memory", memory_headline),
    ("server", server_headline),
)


def headline_rows(
    results: dict[str, dict], commands: dict[str, str], notes: dict | None = None
) -> list[list[str]]:
    """At most six rows: what, result, machine, command. A row whose file has a note is
    marked with a star."""
    out = []
    notes = notes or {}
    for kind, headline in HEADLINES:
        found = _first(results, kind)
        if not found or (kind in ("memory", "server") and len(out) >= 6):
            continue
        name, data = found
        row = headline(data)
        if row is None:
            continue
        what, result = row
        star = " \\*" if notes.get(name) else ""
        command = command_of(name, data, kind, commands)
        out.append([what + star, result, machine_of(data, kind), f"`{command}`"])
    return out[:6]


def readme_section(results: dict[str, dict], commands: dict[str, str], notes: dict) -> str:
    rows = headline_rows(results, commands, notes)
    if not rows:
        return "No benchmark results are committed."
    text = table(["measured", "result", "machine", "command"], rows)
    starred = [note for name, file_notes in notes.items() if name for note in file_notes]
    marks = (
        ["\\* " + note for note in dict.fromkeys(starred)]
        if any("\\*" in r[0] for r in rows)
        else []
    )
    return "\n\n".join([text, *notes.get(None, []), *marks])


def performance_section(results: dict[str, dict], commands: dict[str, str], notes: dict) -> str:
    """Eager against compiled decode steps and bf16 against fp32, from the serving JSON."""
    found = _first(results, "serving")
    if not found:
        return "No serving benchmark results are committed."
    name, data = found
    rows = [r for r in data["rows"] if r["config"] in ("engine", "engine compiled")]
    body = []
    for r in rows:
        body.append(
            [
                f"{r.get('workload')} ({r.get('requests')})",
                r.get("dtype", ""),
                r["config"],
                num(r.get("tokens_per_s"), 1),
                num(r.get("itl_p50_ms"), 1),
                num(r.get("ttft_p50_ms"), 1),
            ]
        )
    compile_rows = []
    for r in rows:
        if r["config"] == "engine compiled" and r.get("first_step_seconds"):
            times = ", ".join(f"{n}: {num(s, 0)} s" for n, s in r["first_step_seconds"].items())
            entry = [r.get("dtype", ""), times]  # one engine per dtype compiles them all
            if entry not in compile_rows:
                compile_rows.append(entry)
    text = provenance(machine_of(data, "serving"), command_of(name, data, "serving", commands))
    text += f" File: `docs/results/{name}`.\n\n"
    text += "".join(admonition(note) + "\n\n" for note in notes.get(name, []))
    text += table(
        ["workload (requests)", "dtype", "config", "tokens/s", "ITL p50 ms", "TTFT p50 ms"],
        body,
        "lllrrr",
    )
    if compile_rows:
        text += (
            "\n\nThe first step of each padded batch size with `compile=True`, compiling it "
            "(a warm-up before the timed runs):\n\n"
        )
        text += table(["dtype", "seconds per padded batch size"], compile_rows)
    return text


# --------------------------------------------------------------------------------------------
# Writing


TARGETS: dict[str, Callable[[dict, dict, dict], str]] = {
    "README.md": readme_section,
    "docs/benchmarks.md": benchmarks_page,
    "docs/performance.md": performance_section,
}


def replace_marked(text: str, body: str, path: str) -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{path}: no '{BEGIN}' ... '{END}' markers")
    return text[: start + len(BEGIN)] + "\n" + body + "\n" + text[end:]


def render(root: Path = ROOT) -> dict[str, str]:
    """Path -> the file's text with its marked section written from docs/results/."""
    results = load_results(root / "docs" / "results")
    for name, data in results.items():
        if kind_of(data) in ("decode", "decode_cpu_core"):
            refuse_measurement_errors(name, data)
    commands = index_commands(root / "docs" / "results")
    notes = index_notes(root / "docs" / "results")
    return {
        path: replace_marked((root / path).read_text(), make(results, commands, notes), path)
        for path, make in TARGETS.items()
    }


def picture_of(json_name: str) -> str:
    """The plot a benchmark draws beside ``json_name`` (under docs/img/)."""
    return "demo_kv_memory.png" if json_name == "demo.json" else Path(json_name).stem + ".png"


def line_file(line: str) -> str | None:
    """The result file an INDEX.txt line is about (None: a note about every run)."""
    match = re.match(r"^note(?:\s+([\w.\-]+?)(?:\.json)?)?\s*:", line)
    if match:
        return match.group(1) and match.group(1) + ".json"
    match = re.match(r"^[\s\-*`]*([\w.\-/]+?)(?:\.json)?`?\s*[:|]", line)
    return match and Path(match.group(1)).name + ".json"


def take(source: Path, root: Path = ROOT) -> list[str]:
    """Copy the benchmark JSON of ``source`` into docs/results/ and each one's plot into
    docs/img/ (removing a plot of an earlier run that the new one lacks), and replace what
    docs/results/INDEX.txt says of those files (commands and notes) by ``source/INDEX.txt``'s
    lines about them. Returns the names of the JSON files taken."""
    results, images = root / "docs" / "results", root / "docs" / "img"
    taken = []
    for path in sorted(source.glob("*.json")):
        try:
            known = kind_of(json.loads(path.read_text())) is not None
        except ValueError:
            known = False
        if not known:
            print(f"{path}: not the JSON of a known benchmark, left out", file=sys.stderr)
            continue
        shutil.copy(path, results / path.name)
        taken.append(path.name)
        picture = picture_of(path.name)
        if (source / picture).exists():
            shutil.copy(source / picture, images / picture)
        else:
            (images / picture).unlink(missing_ok=True)
    index = results / "INDEX.txt"
    old = index.read_text().splitlines() if index.exists() else []
    new = (source / "INDEX.txt").read_text().splitlines() if (source / "INDEX.txt").exists() else []
    kept = [line for line in old if line_file(line) not in taken]
    index.write_text("\n".join([*kept, *(line for line in new if line_file(line) in taken)]) + "\n")
    return taken


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a section is stale")
    parser.add_argument(
        "--take",
        metavar="DIR",
        type=Path,
        help="first copy DIR's benchmark JSON, plots and INDEX.txt lines into docs/",
    )
    args = parser.parse_args(argv)
    if args.take:
        print(f"took {', '.join(take(args.take, ROOT)) or 'nothing'} from {args.take}")
    stale = []
    for path, text in render().items():
        if (ROOT / path).read_text() != text:
            stale.append(path)
            if not args.check:
                (ROOT / path).write_text(text)
    if args.check and stale:
        print(
            f"stale results in {', '.join(stale)}: run python benchmarks/publish.py",
            file=sys.stderr,
        )
        return 1
    for path in stale:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
