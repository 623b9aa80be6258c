"""bench_mla.py's accounting: the KV bytes per token and layer of both forms at DeepSeek-V3's and
LongCat-Flash's real dimensions, read from the caches the code allocates, and a tiny decode run."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_mla  # noqa: E402


def test_kv_bytes_per_token_per_layer_at_deepseek_v3s_dimensions():
    """128 heads of 192 + 128 dims expanded, 512 + 64 latent; bf16."""
    row = bench_mla.kv_bytes_per_token("deepseek_v3")
    assert row["dims"] == dict(
        num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128
    )
    assert row["expanded"]["bytes_per_token_per_layer"] == 128 * (192 + 128) * 2 == 81920
    assert row["latent"]["bytes_per_token_per_layer"] == (512 + 64) * 2 == 1152
    assert row["latent"]["key_cache_shape"] == [1, 1, 64 // 8, 16, 8]
    assert row["latent"]["value_cache_shape"] == [1, 1, 512, 16]
    longcat = bench_mla.kv_bytes_per_token("longcat_flash")  # 64 heads
    assert longcat["expanded"]["bytes_per_token_per_layer"] == 64 * (192 + 128) * 2
    assert longcat["latent"]["bytes_per_token_per_layer"] == 1152


def test_a_tiny_decode_run_times_both_forms_in_turn(tmp_path):
    tiny = (
        '{"hidden_size": 128, "intermediate_size": 128, "num_attention_heads": 4, '
        '"num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 64}'
    )
    out = tmp_path / "bench_mla.json"
    report = bench_mla.main(
        ["--batches", "2", "--contexts", "40", "--steps", "2", "--rounds", "2",
         "--decode-model", tiny, "--json", str(out),
         "--threads", str(torch.get_num_threads())]
    )  # fmt: skip
    (row,) = report["decode"]
    for form in ("latent", "expanded"):
        assert len(row[form]["ms_per_step_rounds"]) == 2
        assert row[form]["ms_per_step_best"] == min(row[form]["ms_per_step_rounds"])
    # 2 sequences of 40 + 4 tokens in blocks of 16: 3 blocks each; 2 layers.
    assert row["latent"]["cache_bytes_in_use"] == 6 * 2 * (64 + 64) * 4 * 16
    assert row["expanded"]["cache_bytes_in_use"] == 6 * 2 * 4 * (192 + 128) * 4 * 16
    assert out.exists() and report["machine"]["load_average"]
