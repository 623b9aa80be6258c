"""The FlashInfer method of benchmarks/bench_decode.py gets the same cache values as ours.

FlashInfer runs only on the GPU machine; what can go wrong before it is called, the conversion
of this project's cache into FlashInfer's HND pages and CSR page table, is checked here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_decode
    finally:
        sys.path.pop(0)
    return bench_decode


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_flashinfer_pages_hold_the_same_keys_and_values(bench, block_size):
    shape = bench.Shape(num_heads=8, num_kv_heads=2, head_size=64, block_size=block_size)
    case = bench.build_case(torch.device("cpu"), torch.bfloat16, 3, 100, shape)
    case["seq_lens"] = torch.tensor([100, 37, 1], dtype=torch.int32)  # partial last pages
    k_pages, v_pages, indptr, indices, last_page_len = bench.flashinfer_inputs(case)
    assert k_pages.shape == (case["key_cache"].shape[0], 2, block_size, 64)
    assert all(t.dtype == torch.int32 for t in (indptr, indices, last_page_len))
    for s, length in enumerate(case["seq_lens"].tolist()):
        pages = indices[indptr[s] : indptr[s + 1]].long()
        assert 0 < int(last_page_len[s]) <= block_size
        assert (len(pages) - 1) * block_size + int(last_page_len[s]) == length
        # [kv_heads, tokens, head_size] from the pages, cut at the sequence length
        keys = k_pages[pages].permute(1, 0, 2, 3).reshape(2, -1, 64)[:, :length]
        values = v_pages[pages].permute(1, 0, 2, 3).reshape(2, -1, 64)[:, :length]
        one = dict(case, block_tables=case["block_tables"][s : s + 1], context=length)
        want_keys, want_values = bench.gather_kv(one)
        assert torch.equal(keys, want_keys[0]) and torch.equal(values, want_values[0])


def test_cuda_methods_are_noted_and_skipped_on_the_cpu(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_decode.py"),
            *("--batches", "1", "--contexts", "64", "--dtypes", "float32", "--reps", "2"),
            *("--methods", "v1", "--cuda-methods", "flashinfer,flashinfer-cc", "--json", str(out)),
            *("--memory-buffer-mib", "32"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert [r["method"] for r in report["rows"]] == ["v1", "limit"]
    assert any("flashinfer,flashinfer-cc: not run on the CPU" in n for n in report["notes"])
