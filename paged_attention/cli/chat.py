"""python -m paged_attention chat: talk to a model through the paged engine.

With no question it is an interactive chat: each answer streams as the model writes it, and the
conversation so far is the context of the next answer (/reset starts over, /exit or an end of
input ends it; Ctrl-C stops an answer). With a question (chat "What is the capital of
France?"), or one prompt per line of --file (-: standard input), it answers them all at once
through the engine's continuous batching and prints the answers in order. The one-shot form
decodes greedily unless --temperature says otherwise, so its answers are reproducible.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from paged_attention.cli.arguments import (
    add_compile_argument,
    add_speculative_argument,
    decode_compile_cache,
    non_negative_float,
    positive_int,
    seed_int,
    speculative_config,
    unit_interval,
)
from paged_attention.errors import UsageError
from paged_attention.modeling.models import add_model_arguments, add_weights_argument

HELP = "chat with a model (SmolLM2-135M-Instruct by default), interactively or one-shot"
DEFAULT_KV_TOKENS = 8192
MAX_NUM_SEQS = 64
INTERACTIVE_TEMPERATURE = 0.7
INTERACTIVE_TOP_P = 0.9
EXIT_STATUS = """exit status: 0 when every prompt was answered; 1 when a prompt could not be
served (too long for the model's context or the KV budget); 2 for bad arguments (including a
--model that cannot be loaded or has no tokenizer)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EXIT_STATUS
    parser.add_argument(
        "prompt",
        nargs="?",
        type=utf8_text,
        help="a question to answer and exit (default: interactive chat)",
    )
    parser.add_argument(
        "--file",
        help="answer every non-empty line of this file as a prompt of its own, all at once "
        "(-: standard input)",
    )
    add_model_arguments(parser)
    add_weights_argument(parser)
    parser.add_argument(
        "--system", type=utf8_text, help="a system prompt before every conversation"
    )
    parser.add_argument(
        "--temperature",
        type=non_negative_float,
        help="0 decodes greedily (default: 0 for one-shot prompts, "
        f"{INTERACTIVE_TEMPERATURE} in the interactive chat)",
    )
    parser.add_argument(
        "--top-p",
        type=unit_interval,
        help=f"nucleus sampling (default: 1 one-shot, {INTERACTIVE_TOP_P} interactive)",
    )
    parser.add_argument(
        "--max-tokens", type=positive_int, default=256, help="the most tokens of one answer"
    )
    parser.add_argument(
        "--seed", type=seed_int, default=0, help="seed of the sampling, in [0, 2**32)"
    )
    parser.add_argument(
        "--stop",
        type=stop_text,
        action="append",
        default=[],
        metavar="TEXT",
        help="end an answer where this text appears (left out of it); repeatable",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--kv-budget",
        type=positive_int,
        help=f"device KV blocks (default: {DEFAULT_KV_TOKENS} tokens' worth)",
    )
    parser.add_argument("--threads", type=positive_int, help="CPU threads for torch")
    add_compile_argument(parser)
    add_speculative_argument(parser)
    parser.add_argument(
        "--json",
        action="store_true",
        help="one-shot: one JSON object per prompt (prompt, text, finish_reason, token counts)",
    )


def utf8_text(text: str) -> str:
    """An argument as text; bytes that are not UTF-8 (which Python keeps as lone surrogates)
    are refused."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("it is not valid UTF-8 text") from None
    return text


def stop_text(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("a stop string must not be empty")
    return utf8_text(text)


def main(args: argparse.Namespace) -> int:
    """Run the chat; returns the exit status (see EXIT_STATUS). Raises UsageError for a bad
    argument."""
    if args.prompt is not None and args.file is not None:
        raise UsageError("give a prompt or --file, not both")
    prompts = None
    if args.prompt is not None:
        prompts = [args.prompt]
    elif args.file is not None:
        prompts = read_prompts(args.file)
    elif args.json:
        raise UsageError("--json needs a prompt or --file (it is for one-shot answers)")
    previous_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        # one conversation at a time, or every prompt at once: the decode steps to compile
        engine = build_engine(args, max_num_seqs=min(len(prompts or [None]), MAX_NUM_SEQS))
        if prompts is None:
            return interactive(engine, args, sys.stdin, sys.stdout)
        return one_shot(engine, prompts, args, sys.stdout)
    finally:
        torch.set_num_threads(previous_threads)


def read_prompts(path: str) -> list[str]:
    """The prompts of ``path`` (-: standard input), one per line: lines end at a line feed
    (or CR LF) only, so a form feed or U+2028 inside a line stays in its prompt; a UTF-8
    byte-order mark is not part of the first prompt."""
    try:
        if path == "-":
            stdin = sys.stdin
            # a text stream without bytes beneath (a test's StringIO) is encoded: its lone
            # surrogates, bytes that were not UTF-8, fail there
            data = stdin.buffer.read() if hasattr(stdin, "buffer") else stdin.read().encode()
        else:
            with open(path, "rb") as file:
                data = file.read()
        text = data.decode("utf-8-sig")
    except UnicodeError:
        raise UsageError(f"--file {path}: it is not valid UTF-8 text") from None
    except OSError as error:
        raise UsageError(f"--file {path}: {error}") from None
    prompts = [line.strip() for line in text.split("\n") if line.strip()]
    if not prompts:
        raise UsageError(f"--file {path}: no prompt in it (one per line)")
    return prompts


def build_engine(args: argparse.Namespace, max_num_seqs: int = MAX_NUM_SEQS):
    """The chat's engine: ``max_num_seqs`` sequences at once (the padded batch sizes of its
    compiled decode steps, with ``--compile``)."""
    from paged_attention.engine import (
        CacheConfig,
        Engine,
        EngineConfig,
        SchedulerConfig,
    )
    from paged_attention.engine.compile_cache import compile_decode_steps
    from paged_attention.modeling.models import ModelLoadError, load_model

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was given but no CUDA device is available")
    try:
        model, tokenizer = load_model(
            args.model, dtype=args.dtype, device=args.device, weights=args.weights
        )
    except ModelLoadError as error:
        raise UsageError(f"--model {error}") from None
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"--model {args.model}: it has no tokenizer with a chat template")
    block_size = 16
    compiled = decode_compile_cache(model, args, max_num_seqs, _say)
    speculative = speculative_config(args, model)
    try:
        cache = CacheConfig(
            block_size=block_size, num_blocks=args.kv_budget or DEFAULT_KV_TOKENS // block_size
        )
        scheduler = SchedulerConfig(max_num_seqs=max_num_seqs)
        config = EngineConfig(
            cache, scheduler, compile=compiled is not None, speculative=speculative
        )
        engine = Engine(model, config, tokenizer=tokenizer)
    except (ValueError, RuntimeError) as error:  # a model the paged cache cannot serve
        raise UsageError(f"--model {args.model}: {error}") from None
    if compiled is not None:
        compile_decode_steps(engine, compiled, _say)
    return engine


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def sampling_params(args: argparse.Namespace, interactive: bool):
    from paged_attention.engine import SamplingParams

    temperature, top_p = args.temperature, args.top_p
    if temperature is None:
        temperature = INTERACTIVE_TEMPERATURE if interactive else 0.0
    if top_p is None:
        top_p = INTERACTIVE_TOP_P if interactive and temperature > 0 else 1.0
    return SamplingParams(
        max_new_tokens=args.max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )


def conversation(system: str | None, prompt: str) -> list[dict]:
    start = [{"role": "system", "content": system}] if system else []
    return [*start, {"role": "user", "content": prompt}]


def one_shot(engine, prompts: list[str], args: argparse.Namespace, out) -> int:
    """Answer every prompt; one alone streams as it is generated, several are served together
    and printed in order once all are done."""
    params = sampling_params(args, interactive=False)
    messages = [conversation(args.system, prompt) for prompt in prompts]
    if len(prompts) == 1 and not args.json:
        try:
            return 0 if stream_answer(engine, messages[0], params, out) else 1
        except ValueError as error:  # a prompt that can never run
            print(f"chat: {error}", file=sys.stderr)
            return 1
    requests = []
    for conversation_messages in messages:
        try:
            requests.append(engine.add_request(conversation_messages, params))
        except ValueError as error:
            requests.append(error)
    results = {}
    while engine.has_unfinished():
        results.update((o.request_id, o) for o in engine.step() if o.finished)
    status = 0
    for prompt, request in zip(prompts, requests):
        output = results.get(request) if not isinstance(request, ValueError) else None
        if output is None or output.rejected is not None:
            reason = request if output is None else output.rejected
            status = 1
            if args.json:
                print(json.dumps({"prompt": prompt, "error": str(reason)}), file=out)
            else:
                print(f"> {prompt}\nchat: not served: {reason}\n", file=out)
            continue
        if args.json:
            record = {
                "prompt": prompt,
                "text": output.text,
                "finish_reason": output.finish_reasons[0],
                "prompt_tokens": len(output.prompt),
                "completion_tokens": len(output.outputs[0]),
            }
            print(json.dumps(record), file=out)
        else:
            print(f"> {prompt}\n{output.text}\n", file=out)
    return status


def stream_answer(engine, messages: list[dict], params, out) -> str | None:
    """Print the answer to ``messages`` as it is generated; returns its text, or None when the
    engine rejected the request. Ctrl-C stops the answer (closing the stream aborts the
    request) and keeps what was printed."""
    stream = engine.stream(messages, params)
    text = []
    try:
        for output in stream:
            if output.rejected is not None:
                print(f"chat: not served: {output.rejected}", file=sys.stderr)
                return None
            text.append(output.new_texts[0])
            out.write(text[-1])
            out.flush()
    except KeyboardInterrupt:
        stream.close()
    if text:
        out.write("\n")
        out.flush()
    return "".join(text)


def interactive(engine, args: argparse.Namespace, lines, out) -> int:
    """The chat loop over ``lines`` (a prompt ``> `` when they come from a terminal)."""
    params = sampling_params(args, interactive=True)
    tty = lines.isatty()
    if tty:
        print(f"chatting with {args.model}: /reset starts over, /exit or Ctrl-D ends", file=out)
    history: list[dict] = []
    turn = 0
    while True:
        if tty:
            out.write("> ")
            out.flush()
        try:
            line = lines.readline()
            line.encode("utf-8")  # lone surrogates: bytes that were not UTF-8
        except KeyboardInterrupt:
            out.write("\n")
            return 0
        except UnicodeError:
            raise UsageError("standard input: a line is not valid UTF-8 text") from None
        if not line:
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history = []
            continue
        messages = (
            conversation(args.system, line)
            if not history
            else [
                *history,
                {"role": "user", "content": line},
            ]
        )
        # A new seed per turn, so the same question asked twice may get different samples.
        turn_params = _with_seed(params, args.seed + turn)
        turn += 1
        try:
            answer = stream_answer(engine, messages, turn_params, out)
        except ValueError as error:  # the conversation no longer fits the context or budget
            print(f"chat: {error} (/reset starts a new conversation)", file=sys.stderr)
            continue
        if answer is not None:
            history = [*messages, {"role": "assistant", "content": answer}]


def _with_seed(params, seed: int):
    from dataclasses import replace

    return replace(params, seed=seed)
