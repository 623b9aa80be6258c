"""``python -m paged_attention chat``: one-shot, many prompts, interactive, errors; and the real
model answering through it."""

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from paged_attention.__main__ import main  # noqa: E402
from paged_attention.engine import Engine  # noqa: E402
from paged_attention.modeling.models import load_model  # noqa: E402

TINY = ["--model", "tiny", "--dtype", "float32", "--threads", "1"]
QUESTIONS = ["hello", "Où est la gare ?", "2 + 2 = ?"]


def chat(capsys, *args) -> tuple[int, str]:
    code = main(["chat", *TINY, *args])
    return code, capsys.readouterr().out


def transformers_answer(question: str, max_new_tokens: int) -> str:
    """The greedy answer of transformers' own generate() on the tiny model, as text."""
    model, tokenizer = load_model("tiny", dtype="float32")
    input_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    output = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)


def test_one_shot_streams_the_greedy_answer_of_generate(capsys):
    code, out = chat(capsys, "--max-tokens", "12", QUESTIONS[1])
    assert code == 0
    assert out == transformers_answer(QUESTIONS[1], 12) + "\n"


def test_speculative_ngram_changes_no_greedy_answer(capsys):
    question = "hello hello hello hello hello hello"
    code, out = chat(capsys, "--max-tokens", "16", "--speculative-ngram", "3", question)
    assert code == 0
    assert out == transformers_answer(question, 16) + "\n"


def test_a_draft_model_changes_no_greedy_answer(capsys):
    # the tiny model drafting for itself (another instance of it): every draft is kept
    code, out = chat(capsys, "--max-tokens", "16", "--speculative-model", "tiny", QUESTIONS[1])
    assert code == 0
    assert out == transformers_answer(QUESTIONS[1], 16) + "\n"


def test_prompts_from_a_file_are_answered_together_in_order(tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(QUESTIONS[:2]) + "\n\n" + QUESTIONS[2] + "\n")
    code, out = chat(capsys, "--max-tokens", "6", "--file", str(prompts))
    assert code == 0
    expected = "".join(f"> {q}\n{transformers_answer(q, 6)}\n\n" for q in QUESTIONS)
    assert out == expected
    monkeypatch.setattr(sys, "stdin", io.StringIO(prompts.read_text()))
    assert chat(capsys, "--max-tokens", "6", "--file", "-") == (0, expected)


def test_json_lines(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(QUESTIONS))
    code, out = chat(capsys, "--max-tokens", "5", "--json", "--file", str(prompts))
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [r["prompt"] for r in records] == QUESTIONS
    for record in records:
        assert record["text"] == transformers_answer(record["prompt"], 5)
        assert record["completion_tokens"] <= 5 and record["prompt_tokens"] > 0
        assert record["finish_reason"] in ("eos", "length")


def test_stop_strings_end_the_answer(capsys):
    full = transformers_answer(QUESTIONS[0], 12)
    stop = full[1:3]  # across a multi-byte character's bytes
    assert "\ufffd" not in stop and len(stop.encode()) > 2
    options = ["--max-tokens", "12", "--stop", "never there", "--stop", stop]
    code, out = chat(capsys, *options, QUESTIONS[0])
    assert code == 0 and out == full[: full.index(stop)] + "\n"


def test_sampling_is_seeded(capsys):
    options = ["--max-tokens", "10", "--temperature", "1.0", "--top-p", "0.9"]
    first = chat(capsys, *options, "--seed", "3", QUESTIONS[0])
    assert chat(capsys, *options, "--seed", "3", QUESTIONS[0]) == first
    assert first[0] == 0 and first[1] != chat(capsys, *options, "--seed", "4", QUESTIONS[0])[1]


def test_interactive_chat_keeps_the_conversation(capsys, monkeypatch):
    prompts = []
    stream = Engine.stream

    def recording_stream(self, prompt, params):
        prompts.append(prompt)
        return stream(self, prompt, params)

    monkeypatch.setattr(Engine, "stream", recording_stream)
    turns = "first question\nsecond question\n/reset\nthird question\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(turns))
    code, out = chat(capsys, "--max-tokens", "4", "--system", "Be brief.")
    assert code == 0 and len(prompts) == 3
    first, second, third = prompts
    assert [m["role"] for m in first] == ["system", "user"]
    assert second[:2] == first and second[2]["role"] == "assistant"
    assert second[3] == {"role": "user", "content": "second question"}
    assert second[2]["content"] in out  # the answer the user saw is the history's
    assert third == [first[0], {"role": "user", "content": "third question"}]  # after /reset


def test_module_entry_point():
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "paged_attention", "chat", *TINY, "--max-tokens", "3", "hi"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n")


def usage_error(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["chat", *args])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("paged-attention chat: error: ") and "Traceback" not in error
    return error


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temperature", "-1", "hi"], "--temperature"),
        (["--top-p", "0", "hi"], "--top-p"),
        (["--max-tokens", "0", "hi"], "--max-tokens"),
        (["--speculative-ngram", "0", "hi"], "--speculative-ngram"),
        (["--num-speculative-tokens", "2", "hi"], "--num-speculative-tokens: it is the draft"),
        (["--speculative-model", "/no/such.gguf", "hi"], "--speculative-model /no/such.gguf: "),
        (["--speculative-ngram", "2", "--speculative-model", "tiny", "hi"], "not allowed with"),
        (["--seed", str(2**64), "hi"], "--seed"),
        (["--file", "/no/such/prompts.txt"], "--file /no/such/prompts.txt"),
        (["--file", "x", "hi"], "give a prompt or --file, not both"),
        (["--json"], "--json needs a prompt or --file"),
        (["--model", "/no/such/model.gguf", "hi"], "no such file or directory"),
    ],
)
def test_bad_arguments(args, message, capsys):
    assert message in usage_error(capsys, *args)


def test_a_model_without_a_tokenizer_is_a_usage_error(tmp_path, capsys):
    model, _ = load_model("tiny", dtype="float32")
    model.save_pretrained(tmp_path)
    assert "has no tokenizer" in usage_error(capsys, "--model", str(tmp_path), "hi")


def test_empty_prompt_file_is_a_usage_error(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert "no prompt in it" in usage_error(capsys, "--file", str(empty))


def test_a_prompt_that_cannot_be_served_fails_the_run(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{QUESTIONS[0]}\n{'far too long ' * 40}\n")
    code = main(["chat", *TINY, "--max-tokens", "4", "--kv-budget", "8", "--file", str(prompts)])
    out = capsys.readouterr().out
    assert code == 1
    assert out.startswith(f"> {QUESTIONS[0]}\n") and "not served" in out


def test_smollm2_answers_the_france_question(smollm2, capsys, monkeypatch):
    monkeypatch.setattr(
        "paged_attention.modeling.models.load_model", lambda *args, **kwargs: smollm2
    )
    try:
        code = main(["chat", "--max-tokens", "16", "What is the capital of France?"])
    finally:
        smollm2[0].set_attn_implementation("sdpa")
    assert code == 0 and "Paris" in capsys.readouterr().out


def test_prompt_files_split_at_line_feeds_only_and_drop_the_bom(tmp_path, monkeypatch):
    """Defects 3 and 4: a form feed, U+2028 or U+0085 inside a line stays in its prompt, and a
    UTF-8 byte-order mark is not part of the first prompt (from a file and from stdin)."""
    from paged_attention.cli.chat import read_prompts

    text = "\ufefffirst\x0cstill first\u2028and\x85more\r\nsecond\n\n"
    path = tmp_path / "prompts.txt"
    path.write_bytes(text.encode("utf-8"))
    expected = ["first\x0cstill first\u2028and\x85more", "second"]
    assert read_prompts(str(path)) == expected
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode("utf-8"))))
    assert read_prompts("-") == expected


def test_non_utf8_input_is_a_usage_error(tmp_path, capsys, monkeypatch):
    """Defect 6: bytes that are not UTF-8 (lone surrogates in a str) in the prompt argument,
    --system, --stop, a --file, --file - and the interactive input: one line, exit 2."""
    bad = "caf\udce9"
    assert "not valid UTF-8" in usage_error(capsys, bad)
    assert "not valid UTF-8" in usage_error(capsys, "--system", bad, "hi")
    assert "not valid UTF-8" in usage_error(capsys, "--stop", bad, "hi")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café\n".encode("latin-1"))
    assert "not valid UTF-8" in usage_error(capsys, "--file", str(latin1))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("café\n".encode("latin-1"))))
    assert "not valid UTF-8" in usage_error(capsys, "--file", "-")
    monkeypatch.setattr(sys, "stdin", io.StringIO(bad + "\n"))
    assert "not valid UTF-8" in usage_error(capsys, *TINY, "--max-tokens", "2")


def test_an_empty_stop_string_is_a_usage_error(capsys):
    """Defect 7: not a traceback."""
    assert "--stop" in usage_error(capsys, "--stop", "", "hi")


def test_decode_steps_run_eagerly_by_default_until_compiled(tmp_path, capsys, monkeypatch):
    # a cold compile cache: eager, with one line saying how to compile (--no-compile: silent)
    monkeypatch.setenv("PAGED_ATTENTION_CACHE", str(tmp_path))
    assert main(["chat", *TINY, "--max-tokens", "2", "Hi"]) == 0
    hint = capsys.readouterr().err
    assert main(["chat", *TINY, "--max-tokens", "2", "--no-compile", "Hi"]) == 0
    assert "--compile" in hint and str(tmp_path) in hint
    assert "compile" not in capsys.readouterr().err
