"""``python -m paged_attention demo``: serve a seeded workload with the paged engine in a KV
budget too small for contiguous reservations, report memory use, and check greedy outputs
against transformers' own ``generate()``.

The default model needs no download: a small Llama built from a fixed config with seeded
random weights. Random weights make meaningless text but real attention, so the greedy check
is a real test of the cache, the kernels and the scheduler.

``torchrun --nproc-per-node N -m paged_attention demo --tp`` runs the same workload on a model
split over N processes with transformers' tensor-parallel plan: every rank runs the engine on its
own heads (SPMD) and rank 0 prints the report.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import time

import torch

from paged_attention.engine import Engine, RequestOutput, SamplingParams

DEFAULT_PLOT = "results/demo_kv_memory.png"
DEFAULT_BUDGET_TOKENS = 1024
EXIT_STATUS = """exit status: 0 when every request was served and every greedy output equals
transformers' generate(); 1 when a request was rejected or a greedy output differs; 2 for bad
arguments (including a --model that is not a loadable checkpoint)."""


class UsageError(ValueError):
    """A bad command-line argument, found after argparse (the entry point reports it as
    argparse does: one line, exit status 2)."""


TINY_LLAMA = dict(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
"""The config of the demo's embedded model; tests and benchmarks derive theirs from it."""


def tiny_llama_config(**overrides) -> dict:
    """``LlamaConfig`` keyword arguments: the demo's model with ``overrides``."""
    return {**TINY_LLAMA, **overrides}


def default_model(seed: int) -> torch.nn.Module:
    """A 2-layer Llama (hidden 256, 8 query heads and 2 KV heads of size 32, vocab 1000)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()


def tensor_parallel_copy(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` split over the ranks of the initialised ``torch.distributed`` world with its
    tensor-parallel plan (``tp_plan="auto"``): every rank calls it with the same model and keeps
    its shard."""
    from transformers import DistributedConfig

    split = DistributedConfig(tp_size=torch.distributed.get_world_size())
    shard = type(model).from_pretrained(
        None, config=model.config, state_dict=model.state_dict(), distributed_config=split
    )
    return shard.eval()


SYSTEM_PROMPT_TOKENS = 48


def default_workload(
    num_requests: int, vocab_size: int, seed: int
) -> list[tuple[list[int], SamplingParams]]:
    """Mixed prompt (8-96 tokens) and output (8-80 tokens) lengths; every other request starts
    with the same 48-token system prompt (which prefix caching computes once); every fourth
    request samples n = 2-4 completions at temperature 0.8, top-p 0.95, every sixth runs beam
    search of width 2-4, the rest decode greedily."""
    rng = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (), generator=rng))

    system = torch.randint(3, vocab_size, (SYSTEM_PROMPT_TOKENS,), generator=rng).tolist()
    workload = []
    for i in range(num_requests):
        prompt = torch.randint(3, vocab_size, (randint(8, 96),), generator=rng).tolist()
        if i % 2 == 0:
            prompt = system + prompt
        max_new_tokens = randint(8, 80)
        if i % 4 == 3:
            params = SamplingParams(
                max_new_tokens, temperature=0.8, top_p=0.95, n=randint(2, 4), seed=seed + i
            )
        elif i % 6 == 5:
            params = SamplingParams(max_new_tokens, beam_width=randint(2, 4))
        else:
            params = SamplingParams(max_new_tokens)
        workload.append((prompt, params))
    return workload


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(torch.tensor(values, dtype=torch.float64).quantile(q / 100))


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature == 0 and params.n == 1 and params.beam_width == 1


def transformers_greedy(model, prompt: list[int], max_new_tokens: int, eos) -> list[int]:
    """Greedy decoding by transformers' ``generate()`` with its default cache and attention
    (the caller switches the model back to sdpa)."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([prompt], device=device)
    output = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        eos_token_id=eos,
        pad_token_id=model.generation_config.pad_token_id,
    )
    return output[0, len(prompt) :].tolist()


def run(args: argparse.Namespace, reporting: bool = True) -> dict:
    """Serve the workload and check it; with ``reporting`` False (a tensor-parallel rank but
    the first) no progress is shown and no plot written."""
    from tqdm import tqdm

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was given but no CUDA device is available")
    ranks = torch.distributed.get_world_size() if args.tp else 1
    if args.model:
        model = load_model(args.model, tensor_parallel=args.tp)
        model_name = args.model
    else:
        model = default_model(args.seed)
        model_name = "embedded Llama (2 layers, hidden 256, 8/2 heads, vocab 1000, random)"
        if args.tp:
            model = tensor_parallel_copy(model)
    if args.tp:  # transformers placed each rank's shard on its local device
        placed = next(model.parameters()).device
        if placed.type != device.type:
            raise UsageError(
                f"--tp placed the model's shards on {placed}, not on --device {device}"
            )
        device = placed
    else:
        model.to(device)
    workload = default_workload(args.requests, model.config.vocab_size, args.seed)
    budget = args.kv_budget or DEFAULT_BUDGET_TOKENS // args.block_size

    try:
        engine = Engine(
            model,
            num_blocks=budget,
            block_size=args.block_size,
            cuda_graphs=device.type == "cuda" and not args.no_cuda_graphs,
        )
    except ValueError as error:  # a model the paged cache cannot serve
        raise UsageError(f"--model {model_name}: {error}") from error
    ids, results = [], {}
    for prompt, params in workload:
        try:
            ids.append(engine.add_request(prompt, params))
        except ValueError as error:  # a request that can never run in this KV budget
            ids.append(("refused", len(ids)))
            results[ids[-1]] = RequestOutput(-1, prompt, [], [], finished=True, rejected=str(error))
    with tqdm(
        total=len(ids),
        initial=len(results),
        desc="serving",
        unit="req",
        file=sys.stderr,
        disable=not reporting,
    ) as bar:
        while engine.has_unfinished():
            ended = [r for r in engine.step() if r.finished]
            results.update((r.request_id, r) for r in ended)
            bar.update(len(ended))
    outputs = [results[i] for i in ids]
    stats = engine.stats

    greedy = [
        (prompt, params, out)
        for (prompt, params), out in zip(workload, outputs)
        if is_greedy(params) and out.rejected is None
    ]
    rejected = [out.rejected for out in outputs if out.rejected is not None]
    served = [out.metrics for out in outputs if out.rejected is None]
    ttfts = [m.time_to_first_token for m in served]
    itls = [latency for m in served for latency in m.inter_token_latencies]
    eos = sorted(engine.eos_token_ids)
    matches = 0
    model.set_attn_implementation("sdpa")
    checking = tqdm(greedy, desc="checking", unit="req", file=sys.stderr, disable=not reporting)
    for prompt, params, out in checking:
        expected = transformers_greedy(model, prompt, params.max_new_tokens, eos)
        matches += out.outputs[0] == expected

    if reporting:
        plot_timeline(stats.timeline, budget, args.plot)
    tokens = json.dumps([[out.outputs, out.rejected] for out in outputs]).encode()
    return {
        "model": model_name,
        "device": str(device),
        "tensor_parallel_ranks": ranks,
        "cuda_graphs": engine.runner.graphs is not None,
        "requests": len(outputs),
        "rejected": len(rejected),
        "first_rejection": rejected[0] if rejected else None,
        "parallel_sampling_requests": sum(p.n > 1 for _, p in workload),
        "beam_search_requests": sum(p.beam_width > 1 for _, p in workload),
        "generated_tokens": stats.generated_tokens,
        "seconds": stats.seconds,
        "tokens_per_s": stats.generated_tokens / stats.seconds if stats.seconds else 0.0,
        "steps": stats.steps,
        "block_size": args.block_size,
        "kv_budget_blocks": budget,
        "kv_bytes_per_block": engine.kv_cache.bytes_per_block,
        "kv_bytes_per_rank": engine.kv_cache.device_bytes,
        "peak_blocks": stats.peak_blocks,
        "contiguous_blocks": stats.peak_contiguous_blocks,
        "blocks_saved_by_sharing": stats.peak_blocks_saved_by_sharing,
        "cow_copies": stats.cow_copies,
        "swaps_out": stats.swaps_out,
        "swaps_in": stats.swaps_in,
        "blocks_swapped_out": stats.blocks_swapped_out,
        "blocks_swapped_in": stats.blocks_swapped_in,
        "preemptions_by_recompute": stats.preemptions_by_recompute,
        "prompt_tokens": stats.prompt_tokens,
        "prompt_tokens_cached": stats.prompt_tokens_cached,
        "prompt_tokens_computed": stats.prompt_tokens_computed,
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "itl_p50_ms": _ms(percentile(itls, 50)),
        "itl_p99_ms": _ms(percentile(itls, 99)),
        "greedy_requests": len(greedy),
        "greedy_matching": matches,
        "greedy_matches_transformers": matches == len(greedy),
        "outputs_sha256": hashlib.sha256(tokens).hexdigest(),
        "plot": args.plot,
    }


def check_model_path(path: str) -> None:
    if not os.path.isdir(path):
        raise UsageError(f"--model {path}: no such directory (a local checkpoint is expected)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"--model {path}: not a transformers checkpoint (no config.json)")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def load_model(path: str, tensor_parallel: bool = False) -> torch.nn.Module:
    """A local transformers checkpoint (with ``tensor_parallel``: this rank's shard of it), or
    a UsageError that says in one line why not."""
    check_model_path(path)
    from transformers import AutoModelForCausalLM, DistributedConfig

    options = {}
    if tensor_parallel:
        options["distributed_config"] = DistributedConfig(
            tp_size=torch.distributed.get_world_size()
        )
    try:
        return AutoModelForCausalLM.from_pretrained(path, **options).eval()
    except (OSError, ValueError, KeyError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        raise UsageError(f"--model {path}: cannot load it: {first_line}") from error


def resolve_plot_path(path: str) -> str:
    """Where ``--plot`` writes: the path itself when it names a .png file, or demo_kv_memory.png
    inside it when it is a directory. Checked for writability before the run, not after."""
    if os.path.isdir(path) or path.endswith(os.sep):
        path = os.path.join(path, os.path.basename(DEFAULT_PLOT))
    elif not path.lower().endswith(".png"):
        raise UsageError(f"--plot {path}: give a .png file or an existing directory")
    directory = os.path.dirname(path) or "."
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        raise UsageError(f"--plot {path}: cannot create {directory}: {error.strerror}") from error
    if not os.access(directory, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"--plot {path}: not writable")
    return path


def plot_timeline(timeline: list[tuple[int, int]], budget: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paged, contiguous = zip(*timeline) if timeline else ((), ())
    steps = range(1, len(timeline) + 1)
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(steps, contiguous, label="contiguous reservation of max length", color="tab:gray")
    ax.plot(steps, paged, label="paged: blocks in use", color="tab:blue")
    ax.axhline(budget, linestyle="--", color="tab:red", label=f"KV budget ({budget} blocks)")
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV blocks")
    ax.set_title("KV cache memory while serving the demo workload")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt_ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} ms"


def print_table(report: dict) -> None:
    ratio = report["contiguous_blocks"] / max(report["peak_blocks"], 1)
    if not report["greedy_requests"]:
        greedy = "n/a (no greedy request was served)"
    else:
        greedy = "yes" if report["greedy_matches_transformers"] else "NO"
        greedy += f" ({report['greedy_matching']}/{report['greedy_requests']})"
    ranks = report["tensor_parallel_ranks"]
    split = f", tensor parallel over {ranks} ranks" if ranks > 1 else ""
    per_rank = f" per rank, {ranks} ranks" if ranks > 1 else ""
    rows = [
        (
            "model",
            f"{report['model']} on {report['device']}{split}"
            + (" (decode steps in CUDA graphs)" if report["cuda_graphs"] else ""),
        ),
        (
            "requests",
            f"{report['requests']} ({report['parallel_sampling_requests']} parallel sampling, "
            f"{report['beam_search_requests']} beam search, {report['rejected']} rejected)",
        ),
        ("generated tokens", f"{report['generated_tokens']}"),
        ("tokens/s", f"{report['tokens_per_s']:.1f} ({report['steps']} steps)"),
        (
            "wall time (after imports)",
            f"{report['wall_seconds']:.1f} s (serving {report['seconds']:.1f} s, the rest is "
            "model setup and the generate() check)",
        ),
        (
            "KV budget",
            f"{report['kv_budget_blocks']} blocks of {report['block_size']} tokens",
        ),
        (
            "KV cache bytes",
            f"{report['kv_bytes_per_rank'] / 2**20:.2f} MiB{per_rank} ({report['kv_budget_blocks']}"
            f" blocks of {report['kv_bytes_per_block']} bytes)",
        ),
        ("peak KV blocks in use (paged)", f"{report['peak_blocks']}"),
        (
            "contiguous max-length reservation",
            f"{report['contiguous_blocks']} blocks ({ratio:.1f}x the paged peak)",
        ),
        ("blocks saved by sharing (peak)", f"{report['blocks_saved_by_sharing']}"),
        (
            "prompt tokens computed / from cache",
            f"{report['prompt_tokens_computed']} / {report['prompt_tokens_cached']} (of "
            f"{report['prompt_tokens']}; prefix caching)",
        ),
        (
            "time to first token p50 / p99",
            f"{_fmt_ms(report['ttft_p50_ms'])} / {_fmt_ms(report['ttft_p99_ms'])}",
        ),
        (
            "inter-token latency p50 / p99",
            f"{_fmt_ms(report['itl_p50_ms'])} / {_fmt_ms(report['itl_p99_ms'])}",
        ),
        ("copy-on-write copies", f"{report['cow_copies']}"),
        (
            "swaps out / in (requests)",
            f"{report['swaps_out']} / {report['swaps_in']} "
            f"({report['blocks_swapped_out']} / {report['blocks_swapped_in']} blocks; "
            f"{report['preemptions_by_recompute']} recomputed)",
        ),
        ("greedy outputs == transformers generate()", greedy),
        ("outputs (sha256 of every token)", report["outputs_sha256"][:16]),
        ("KV memory plot", report["plot"]),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EXIT_STATUS
    parser.add_argument("--model", help="a local transformers checkpoint directory")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--requests", type=positive_int, default=32)
    parser.add_argument(
        "--kv-budget",
        type=positive_int,
        help=f"device KV blocks (default: {DEFAULT_BUDGET_TOKENS} tokens' worth)",
    )
    parser.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="with --device cuda: run decode steps eagerly instead of replaying CUDA graphs",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        help="CPU threads for torch (default: 1 for the embedded model, which is too small to "
        "gain from more and stalls when idle-spinning threads share busy cores; torch's "
        "default with --model)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--tp",
        action="store_true",
        help="tensor parallel: run as one rank under torchrun (torchrun --nproc-per-node N -m "
        "paged_attention demo --tp), the model split over the N ranks by transformers' "
        "tensor-parallel plan (needs accelerate); rank 0 reports",
    )
    parser.add_argument(
        "--plot",
        default=DEFAULT_PLOT,
        help="PNG of KV memory over time: a .png path, or a directory to write "
        f"{os.path.basename(DEFAULT_PLOT)} into",
    )


def main(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status (see EXIT_STATUS). Raises UsageError for a bad
    argument, before the run where it can be told in advance."""
    args.plot = resolve_plot_path(args.plot)
    if args.model:
        check_model_path(args.model)
    started_group = args.tp and start_process_group(args.device)
    reporting = not args.tp or torch.distributed.get_rank() == 0
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or (previous_threads if args.model else 1))
    started = time.perf_counter()
    try:
        report = run(args, reporting)
    finally:
        torch.set_num_threads(previous_threads)
        if started_group:
            torch.distributed.destroy_process_group()
    report["wall_seconds"] = time.perf_counter() - started
    if reporting:
        if args.json:
            print(json.dumps(report))
        else:
            print_table(report)
    return exit_status(report, reporting)


def start_process_group(device: str) -> bool:
    """Join the torchrun job this process is a rank of (gloo on the CPU, NCCL on CUDA); False
    when the process group was already initialised."""
    if importlib.util.find_spec("accelerate") is None:
        raise UsageError(
            "--tp: transformers loads tensor-parallel models only with accelerate installed: "
            "pip install 'paged_attention[tp]'"
        )
    if "WORLD_SIZE" not in os.environ:
        raise UsageError(
            "--tp runs as one rank of a torchrun job: torchrun --nproc-per-node 2 -m "
            "paged_attention demo --tp"
        )
    if torch.distributed.is_initialized():
        return False
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was given but no CUDA device is available")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo")
    return True


def exit_status(report: dict, reporting: bool) -> int:
    """0, or 1 (with the reason on stderr when ``reporting``); see EXIT_STATUS."""
    if report["rejected"]:
        if reporting:
            print(
                f"demo: {report['rejected']} of {report['requests']} requests were rejected "
                f"(the first: {report['first_rejection']}); raise --kv-budget",
                file=sys.stderr,
            )
        return 1
    return 0 if report["greedy_matches_transformers"] else 1
