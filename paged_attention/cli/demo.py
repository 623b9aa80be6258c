"""``python -m paged_attention demo``: serve a seeded workload with the paged engine in a KV
budget too small for contiguous reservations, report memory use, and check greedy outputs
against transformers' own ``generate()``.

The default model is SmolLM2-135M-Instruct (see :mod:`paged_attention.modeling.models`), asked real
questions through its chat template: every other one after the same long system prompt (prefix
caching computes it once), some answered by parallel sampling or beam search; the report ends
with a few of the answers as text. ``--model tiny`` serves random token ids on a 2-layer Llama
with random weights instead: meaningless tokens but real attention, in a second.

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

from paged_attention.cli.arguments import positive_int, seed_int
from paged_attention.cli.machine import machine_info
from paged_attention.engine import (
    CacheConfig,
    ChatPrompt,
    Engine,
    EngineConfig,
    PromptRenderer,
    RequestOutput,
    SamplingParams,
)
from paged_attention.engine.config import KVBudgetError
from paged_attention.errors import UsageError
from paged_attention.kv.cache import HOST_SWAP_FACTOR
from paged_attention.modeling.models import (
    TINY_MODEL,
    ModelLoadError,
    add_model_arguments,
    add_weights_argument,
    load_model,
    model_source,
)

# Imported from here by tests, benchmarks and examples.
from paged_attention.modeling.tiny import TINY_LLAMA, tiny_llama_config  # noqa: F401
from paged_attention.modeling.tiny import tiny_llama as default_model  # noqa: F401

DEFAULT_PLOT = "results/demo_kv_memory.png"
DEFAULT_BUDGET_TOKENS = 1024
ANSWERS_SHOWN = 6
TIE_ULPS = 2
"""A greedy output that leaves ``generate()``'s at a token whose logit there is within this
many units in the last place of the model's dtype of the top one is a tie, not a difference:
in bfloat16 two correct computations that round differently pick different tokens of (near-)
equal logits."""
EXIT_STATUS = """exit status: 0 when every request was served and every greedy output equals
transformers' generate() (token for token, or up to a tie: a token whose logit in generate() is
within two units in the last place of the model's dtype of the top one); 1 when a request was
rejected or a greedy output differs; 2 for bad arguments (including a --model that cannot be
loaded or served, and a --kv-budget larger than the memory there is)."""


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

SYSTEM_PROMPT = """You are Atlas, the assistant at a public library's information desk. \
Visitors ask about science, history, geography, language, mathematics and everyday matters. \
Rules for every answer: answer the question asked, directly, in the first sentence. Keep it \
short, one to three sentences, unless the visitor asks for detail or a list. Use plain words a \
curious twelve-year-old would understand. When a question has one correct answer, such as a \
date, a number or a name, state it plainly. When you are not sure, say so instead of guessing. \
Never invent book titles, authors or quotations. Be friendly and patient."""
"""The long system prompt that every other chat request starts with (about 130 tokens, 10 times
a question): prefix caching computes it once."""

QUESTIONS = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What is the boiling point of water at sea level in Celsius?",
    "Who wrote Romeo and Juliet?",
    "What is the largest planet in our solar system?",
    "What gas do plants absorb from the air?",
    "What is 12 times 12?",
    "Which ocean is the largest?",
    "What is the chemical symbol for gold?",
    "How many continents are there?",
    "What is the tallest mountain in the world?",
    "Why is the sky blue?",
    "What language is spoken in Brazil?",
    "What is the speed of light?",
    "Who painted the Mona Lisa?",
    "What is the capital of Japan?",
    "How many days are in a leap year?",
    "What is photosynthesis?",
    "Name three primary colors.",
    "What is the freezing point of water in Fahrenheit?",
    "What is the square root of 81?",
    "Which animal is known as the king of the jungle?",
    "What is the longest river in Africa?",
    "Give me a tip for sleeping better.",
    "What does a thermometer measure?",
    "How many minutes are in two hours?",
    "What is the main ingredient of guacamole?",
    "Write a haiku about autumn leaves.",
    "What is the capital of Canada?",
    "Who was the first person to walk on the Moon?",
    "What is the opposite of 'ancient'?",
    "Suggest a name for a friendly robot.",
)
"""Questions of the chat workload, one per request (they repeat after the last)."""


def load(args: argparse.Namespace, device: torch.device):
    """``(model, tokenizer)`` for ``--model`` on ``device`` (with ``--tp``: this rank's shard;
    transformers places it)."""
    try:
        model, tokenizer = load_model(
            args.model,
            dtype=args.dtype,
            device="cpu" if args.tp else device,
            weights=None if args.tp else args.weights,  # the split reads float weights
        )
    except ModelLoadError as error:
        raise UsageError(f"--model {error}") from None
    if args.tp:
        model = tensor_parallel_copy(model)
    return model, tokenizer


def workload_kind(args: argparse.Namespace, tokenizer) -> str:
    """``--workload``, or its default: chat prompts for a model whose tokenizer has a chat
    template, random token ids otherwise and for the tiny model (whose byte-level prompts would
    be several times longer than a real tokenizer's)."""
    has_template = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
    if args.workload == "chat" and not has_template:
        raise UsageError(f"--workload chat: --model {args.model} has no chat template")
    if args.workload:
        return args.workload
    return "chat" if has_template and args.model != TINY_MODEL else "tokens"


def chat_workload(
    num_requests: int, tokenizer, seed: int
) -> tuple[list[list[dict]], list[tuple[list[int], SamplingParams]]]:
    """The chat conversations and, per request, the prompt's token ids (the model's chat
    template, rendered as the engine renders chat messages) and its sampling parameters. Every
    other request starts with :data:`SYSTEM_PROMPT`; every fourth samples n = 2-4 answers at
    temperature 0.8, top-p 0.95, every sixth runs beam search of width 2-4, the rest decode
    greedily; answers of 32-64 tokens at most."""
    rng = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (), generator=rng))

    renderer = PromptRenderer(tokenizer)  # the engine's and the server's rendering
    conversations, workload = [], []
    for i in range(num_requests):
        question = {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}
        messages = (
            [{"role": "system", "content": SYSTEM_PROMPT}, question] if i % 2 == 0 else [question]
        )
        prompt = renderer.chat_ids(ChatPrompt(messages))
        conversations.append(messages)
        workload.append((prompt, _params(i, randint(32, 64), randint, seed)))
    return conversations, workload


def _params(i: int, max_new_tokens: int, randint, seed: int) -> SamplingParams:
    if i % 4 == 3:
        return SamplingParams(
            max_new_tokens, temperature=0.8, top_p=0.95, n=randint(2, 4), seed=seed + i
        )
    if i % 6 == 5:
        return SamplingParams(max_new_tokens, beam_width=randint(2, 4))
    return SamplingParams(max_new_tokens)


def default_workload(
    num_requests: int, vocab_size: int, seed: int
) -> list[tuple[list[int], SamplingParams]]:
    """Random token ids: mixed prompt (8-96 tokens) and output (8-80 tokens) lengths; every
    other request starts with the same 48-token system prompt (which prefix caching computes
    once); every fourth request samples n = 2-4 completions at temperature 0.8, top-p 0.95,
    every sixth runs beam search of width 2-4, the rest decode greedily."""
    rng = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (), generator=rng))

    system = torch.randint(3, vocab_size, (SYSTEM_PROMPT_TOKENS,), generator=rng).tolist()
    workload = []
    for i in range(num_requests):
        prompt = torch.randint(3, vocab_size, (randint(8, 96),), generator=rng).tolist()
        if i % 2 == 0:
            prompt = system + prompt
        workload.append((prompt, _params(i, randint(8, 80), randint, seed)))
    return workload


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(torch.tensor(values, dtype=torch.float64).quantile(q / 100))


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature == 0 and params.n == 1 and params.beam_width == 1


def transformers_greedy(
    model, prompt: list[int], max_new_tokens: int, eos
) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding by transformers' ``generate()`` with its default cache and attention
    (the caller switches the model back to sdpa): the tokens, and the float32 logits of every
    step (one row per token)."""
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
        output_logits=True,
        return_dict_in_generate=True,
    )
    logits = torch.cat([step.float().cpu() for step in output.logits])
    return output.sequences[0, len(prompt) :].tolist(), logits


def compare_greedy(tokens: list[int], expected: list[int], logits: torch.Tensor, dtype) -> str:
    """``"equal"`` when ``tokens`` are ``expected`` token for token; ``"tie"`` when they
    agree up to a position where ``generate()``'s logits (``logits``, one row per expected
    token) put the engine's token within :data:`TIE_ULPS` units in the last place of
    ``dtype`` of the top one, and the two computations, rounded differently, chose different
    ones of (near-)equal tokens; ``"differs"`` otherwise."""
    if tokens == expected:
        return "equal"
    position = next(
        (i for i, (ours, theirs) in enumerate(zip(tokens, expected)) if ours != theirs), None
    )
    if position is None:  # one ended (EOS, a stop token) where the other went on
        return "differs"
    row = logits[position]
    top = float(row.max())
    tolerance = TIE_ULPS * torch.finfo(dtype).eps * max(abs(top), 1.0)
    return "tie" if top - float(row[tokens[position]]) <= tolerance else "differs"


def run(args: argparse.Namespace, reporting: bool = True) -> dict:
    """Serve the workload and check it; with ``reporting`` False (a tensor-parallel rank but
    the first) no progress is shown and no plot written."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was given but no CUDA device is available")
    model, tokenizer = load(args, device)
    if args.tp:  # transformers placed each rank's shard on its local device
        placed = next(model.parameters()).device
        if placed.type != device.type:
            raise UsageError(
                f"--tp placed the model's shards on {placed}, not on --device {device}"
            )
        device = placed
    kind = workload_kind(args, tokenizer)
    conversations = None
    if kind == "chat":
        conversations, workload = chat_workload(args.requests, tokenizer, args.seed)
    else:
        workload = default_workload(args.requests, model.config.vocab_size, args.seed)
    engine = build_engine(args, model, device)
    outputs = serve_workload(engine, workload, reporting)
    answers = []
    if conversations is not None:
        answers = [
            answer(messages, params, out, tokenizer)
            for messages, (_, params), out in zip(conversations, workload, outputs)
        ][:ANSWERS_SHOWN]
    if reporting:
        plot_timeline(engine.stats.timeline, engine.config.cache.num_blocks, args.plot)
    verdicts = check_greedy(engine, workload, outputs, reporting)
    report = summary(args, engine, workload, outputs, verdicts)
    return {**report, "workload": kind, "device": str(device), "answers": answers}


def build_engine(args: argparse.Namespace, model: torch.nn.Module, device: torch.device):
    """The demo's engine: ``--kv-budget`` blocks (checked against the memory there is before
    anything is allocated) and, to show preemption by swapping, the host swap space the engine
    reserves by default only on a GPU."""
    budget = args.kv_budget or DEFAULT_BUDGET_TOKENS // args.block_size
    try:
        cache = CacheConfig(
            block_size=args.block_size,
            num_blocks=budget,
            num_host_blocks=HOST_SWAP_FACTOR * budget,
        )
        config = EngineConfig(cache, cuda_graphs=device.type == "cuda" and not args.no_cuda_graphs)
        return Engine(model, config)
    except KVBudgetError as error:
        raise UsageError(f"--kv-budget {budget}: {error.detail}") from None
    except (ValueError, RuntimeError) as error:  # a model the paged cache cannot serve
        raise UsageError(f"--model {args.model}: {error}") from error


def serve_workload(engine, workload: list, reporting: bool) -> list[RequestOutput]:
    """Every request's final output, in the workload's order (a request the engine refuses
    at once gets a rejected output)."""
    from tqdm import tqdm

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
            ended = [output for output in engine.step() if output.finished]
            results.update((output.request_id, output) for output in ended)
            bar.update(len(ended))
    return [results[i] for i in ids]


def check_greedy(engine, workload: list, outputs: list[RequestOutput], reporting: bool) -> list:
    """:func:`compare_greedy`'s verdict for every greedy request served, against transformers'
    ``generate()`` of the same model (switched back to sdpa attention for it)."""
    from tqdm import tqdm

    model = engine.model
    greedy = [
        (prompt, params, out)
        for (prompt, params), out in zip(workload, outputs)
        if is_greedy(params) and out.rejected is None
    ]
    eos = sorted(engine.eos_token_ids)
    dtype = next(model.parameters()).dtype
    model.set_attn_implementation("sdpa")
    verdicts = []
    checking = tqdm(greedy, desc="checking", unit="req", file=sys.stderr, disable=not reporting)
    for prompt, params, out in checking:
        expected, logits = transformers_greedy(model, prompt, params.max_new_tokens, eos)
        verdicts.append(compare_greedy(out.outputs[0], expected, logits, dtype))
    return verdicts


def summary(args, engine, workload: list, outputs: list[RequestOutput], verdicts: list) -> dict:
    """The demo's report of a run (the workload kind, device and answers aside)."""
    model, stats = engine.model, engine.stats
    budget = engine.config.cache.num_blocks
    ranks = torch.distributed.get_world_size() if args.tp else 1
    rejected = [out.rejected for out in outputs if out.rejected is not None]
    served = [out.metrics for out in outputs if out.rejected is None]
    ttfts = [m.time_to_first_token for m in served]
    itls = [latency for m in served for latency in m.inter_token_latencies]
    tokens = json.dumps([[out.outputs, out.rejected] for out in outputs]).encode()
    return {
        "model": args.model,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
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
        "greedy_requests": len(verdicts),
        "greedy_matching": verdicts.count("equal"),
        "greedy_ties": verdicts.count("tie"),
        "greedy_matches_transformers": "differs" not in verdicts,
        "outputs_sha256": hashlib.sha256(tokens).hexdigest(),
        "plot": args.plot,
    }


def answer(messages: list[dict], params: SamplingParams, out: RequestOutput, tokenizer) -> dict:
    """A chat request's question and answers as text (every sample, the best beam)."""
    if params.n > 1:
        kind = f"{params.n} samples, temperature {params.temperature}"
    elif params.beam_width > 1:
        kind = f"beam search, width {params.beam_width}"
    else:
        kind = "greedy"
    texts = [tokenizer.decode(tokens, skip_special_tokens=True).strip() for tokens in out.outputs]
    return {
        "system_prompt": messages[0]["role"] == "system",
        "question": messages[-1]["content"],
        "decoding": kind,
        "answers": texts[:1] if params.beam_width > 1 else texts,
        "rejected": out.rejected,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


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
    """The report as a table of rows, then the chat answers shown."""
    rows = _run_rows(report) + _memory_rows(report)
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    for shown in report["answers"]:
        system = " (after the system prompt)" if shown["system_prompt"] else ""
        print(f"\n> {shown['question']}{system} [{shown['decoding']}]")
        if shown["rejected"] is not None:
            print(f"  rejected: {shown['rejected']}")
        for text in shown["answers"]:
            print("  " + text.replace("\n", "\n  "))


def _run_rows(report: dict) -> list[tuple[str, str]]:
    """The rows of what ran: model, requests, throughput and time."""
    ranks = report["tensor_parallel_ranks"]
    split = f", tensor parallel over {ranks} ranks" if ranks > 1 else ""
    return [
        (
            "model",
            f"{report['model']} ({report['dtype']}) on {report['device']}{split}"
            + (" (decode steps in CUDA graphs)" if report["cuda_graphs"] else ""),
        ),
        (
            "requests",
            f"{report['requests']} {report['workload']} requests "
            f"({report['parallel_sampling_requests']} parallel sampling, "
            f"{report['beam_search_requests']} beam search, {report['rejected']} rejected)",
        ),
        ("generated tokens", f"{report['generated_tokens']}"),
        ("tokens/s", f"{report['tokens_per_s']:.1f} ({report['steps']} steps)"),
        (
            "wall time (after imports)",
            f"{report['wall_seconds']:.1f} s (serving {report['seconds']:.1f} s, the rest is "
            "model setup and the generate() check)",
        ),
    ]


def _memory_rows(report: dict) -> list[tuple[str, str]]:
    """The rows of the KV cache, its sharing and preemption, latencies and the check."""
    ratio = report["contiguous_blocks"] / max(report["peak_blocks"], 1)
    if not report["greedy_requests"]:
        greedy = "n/a (no greedy request was served)"
    else:
        greedy = "yes" if report["greedy_matches_transformers"] else "NO"
        greedy += f" ({report['greedy_matching']}/{report['greedy_requests']} token for token"
        if report["greedy_ties"]:
            greedy += f", {report['greedy_ties']} up to a {report['dtype']} tie"
        greedy += ")"
    ranks = report["tensor_parallel_ranks"]
    per_rank = f" per rank, {ranks} ranks" if ranks > 1 else ""
    return [
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EXIT_STATUS
    add_model_arguments(parser)
    add_weights_argument(parser)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--workload",
        choices=("chat", "tokens"),
        help="chat: real questions through the model's chat template, every other one after a "
        "long shared system prompt; tokens: random token ids (default: chat when the model's "
        f"tokenizer has a chat template, except for --model {TINY_MODEL}, whose byte-level "
        "prompts would be several times longer)",
    )
    parser.add_argument("--requests", type=positive_int, default=32)
    parser.add_argument(
        "--kv-budget",
        type=positive_int,
        help=f"device KV blocks (default: {DEFAULT_BUDGET_TOKENS} tokens' worth)",
    )
    parser.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32))
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="with --device cuda: run decode steps eagerly instead of replaying CUDA graphs",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        help=f"CPU threads for torch (default: 1 for --model {TINY_MODEL}, which is too small "
        "to gain from more and stalls when idle-spinning threads share busy cores; torch's "
        "default for the others)",
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
    try:
        model_source(args.model)
    except ModelLoadError as error:
        raise UsageError(f"--model {error}") from None
    started_group = args.tp and start_process_group(args.device)
    reporting = not args.tp or torch.distributed.get_rank() == 0
    previous_threads = torch.get_num_threads()
    tiny = args.model == TINY_MODEL
    torch.set_num_threads(args.threads or (1 if tiny else previous_threads))
    started = time.perf_counter()
    try:
        report = run(args, reporting)
        report["machine"] = machine_info(args.device)  # with the demo's threads
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
            "install paged_attention from source with the tp extra (pip install "
            "--no-build-isolation '.[tp]' in its checkout)"
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
