"""The speculative decoding benchmark at tiny sizes: its A B A B order, its rows and record."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_spec_decode  # noqa: E402


def test_configurations_alternate_and_the_record_holds_every_row(tmp_path, capsys):
    out = tmp_path / "spec.json"
    argv = ["--model", "tiny", "--k", "2,4", "--draft-k", "3", "--rounds", "2", "--requests", "2"]
    bench_spec_decode.main([*argv, "--new-tokens", "6", "--json", str(out)])
    record = json.loads(out.read_text())
    rows = record["rows"]
    configs = ["plain", "ngram k=2", "ngram k=4", "draft k=3"]
    assert [(r["shape"], r["round"], r["config"]) for r in rows] == [
        (shape, round_index, config)
        for shape in ("single", "batch")
        for round_index in (0, 1)
        for config in configs
    ]
    for row in rows:
        assert row["generated"] == 2 * 6 and row["tok_per_s"] > 0  # no end tokens
        assert (row["config"] == "plain") == (row["acceptance_rate"] is None and not row["drafted"])
        assert 0 <= row["same_tokens_as_plain"] <= 2
    assert record["machine"]["cores"] and record["model"] == "tiny"
    assert record["draft_weights"] == "auto"
    # The tiny model as shipped is its float model: a perfect draft, every token the plain one.
    for row in rows:
        if row["config"] == "draft k=3":
            assert row["accepted"] == row["drafted"] > 0 and row["same_tokens_as_plain"] == 2
    assert "ngram k=4" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--k", "0"], "--k"),
        (["--k", "x"], "--k"),
        (["--draft-k", "0"], "--draft-k"),
        (["--draft-weights", "int3"], "--draft-weights"),
        (["--shapes", "wide"], "--shapes"),
        (["--rounds", "0"], "--rounds"),
        (["--new-tokens", "0"], "--new-tokens"),
    ],
)
def test_bad_arguments_name_the_option(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_spec_decode.parse_args(argv)
    assert message in capsys.readouterr().err


def test_prompts_ask_to_repeat_code_with_a_variable_renamed():
    from paged_attention.modeling.models import load_model

    _, tokenizer = load_model("tiny")
    prompts = bench_spec_decode.code_edit_prompts(tokenizer, 5)
    assert len(prompts) == 5 and prompts[0] == prompts[4]  # four snippets, in turn
    text = tokenizer.decode(prompts[1])
    assert "renamed to `frequencies`" in text and "def count_words" in text
