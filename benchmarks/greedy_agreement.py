"""Greedy token agreement on the demo's questions: SmolLM2 with ``--weights auto`` through the
gguf kernel (int8 activations, llama.cpp's arithmetic), through torch's int4pack kernel, and
with ``--weights bf16``, against one another and against llama.cpp's ``llama-server`` on the same
GGUF file.

Every run gets the same prompt token ids (each question through the chat template) and
generates ``--tokens`` tokens greedily, never stopping at the end-of-sequence token (ours: it is
replaced by one the answers never produce; llama-server: ``ignore_eos``). Per pair and question:
the first position where the two differ (None where they agree throughout) and the fraction
of positions that match; in all, the mean of those fractions and how many questions agree in
full.

    python benchmarks/greedy_agreement.py --llama-server PATH \
        --json docs/results/greedy_agreement.json

Without ``--llama-server`` only our three runs are compared.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

CONFIGS = {"gguf": ("auto", "gguf"), "int4pack": ("auto", "int4pack"), "bf16": ("bf16", None)}


def ours(config: str, questions, tokens: int) -> list[list[int]]:
    """Our greedy tokens of each question in ``config``."""
    from paged_attention.engine import Engine, SamplingParams
    from paged_attention.modeling.models import load_model

    weights, kernel = CONFIGS[config]
    if kernel is not None:
        os.environ["PAGED_ATTENTION_QUANTIZED_KERNEL"] = kernel
    model, tokenizer = load_model("smollm2", weights=weights)
    never = model.config.vocab_size - 1  # an end-of-sequence token the answers never produce
    engine = Engine(model, tokenizer=tokenizer, num_blocks=512, eos_token_id=never)
    params = SamplingParams(max_new_tokens=tokens)  # greedy
    outputs = engine.generate(prompt_ids(tokenizer, questions), params)
    return [list(output.outputs[0]) for output in outputs]


def prompt_ids(tokenizer, questions) -> list[list[int]]:
    ids = []
    for question in questions:
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids.append(list(prompt["input_ids"] if not isinstance(prompt, list) else prompt))
    return ids


def llama_server(binary: str, gguf: Path, prompts, tokens: int) -> list[list[int]]:
    """llama-server's greedy tokens of each prompt (token ids), one at a time."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [binary, "-m", str(gguf), "--port", str(port), "-t", "2", "-c", "4096", "-np", "1"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, server)
        answers = []
        for prompt in prompts:
            body = {
                "prompt": prompt,
                "n_predict": tokens,
                "temperature": 0.0,
                "top_k": 1,
                "ignore_eos": True,
                "cache_prompt": False,
                "return_tokens": True,
            }
            answers.append(post(f"{url}/completion", body)["tokens"])
        return answers
    finally:
        server.terminate()
        server.wait(timeout=30)


def wait_for_health(url: str, server: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"llama-server exited with {server.returncode} before it answered")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"llama-server did not answer /health within {timeout_s} s")


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Per question the first differing position (None: none) and the fraction matching."""
    first, fractions = [], []
    for x, y in zip(a, b):
        length = min(len(x), len(y))
        differing = [i for i in range(length) if x[i] != y[i]]
        first.append(differing[0] if differing else None)
        fractions.append((length - len(differing)) / length if length else 1.0)
    return {
        "first_divergence": first,
        "match_fraction": fractions,
        "mean_match_fraction": sum(fractions) / len(fractions),
        "questions_identical": sum(f is None for f in first),
        "questions": len(first),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", metavar="PATH", help="the llama-server binary")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch

    from paged_attention.cli.demo import QUESTIONS
    from paged_attention.modeling.models import load_model, smollm2_gguf

    torch.set_num_threads(2)
    _, tokenizer = load_model("smollm2", weights="bf16")
    prompts = prompt_ids(tokenizer, QUESTIONS)
    runs = {config: ours(config, QUESTIONS, args.tokens) for config in CONFIGS}
    if args.llama_server:
        runs["llama-server"] = llama_server(args.llama_server, smollm2_gguf(), prompts, args.tokens)
    pairs = {f"{a} vs {b}": agreement(runs[a], runs[b]) for a, b in itertools.combinations(runs, 2)}
    for name, result in pairs.items():
        print(
            f"{name:28s} mean match {result['mean_match_fraction']:.3f}, identical "
            f"{result['questions_identical']}/{result['questions']}, first divergences "
            f"{result['first_divergence']}"
        )
    if args.json:
        report = {"tokens": args.tokens, "questions": list(QUESTIONS), "pairs": pairs, "runs": runs}
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
