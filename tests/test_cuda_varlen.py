"""The CUDA paged_attention_varlen op and PagedAttention on CUDA, against reference.py and the
CPU kernel.

Every test is marked ``cuda`` and skipped when no GPU is visible; the kernels' bodies are
checked without one under the host emulation (tests/test_cuda_emulated_varlen.py). Here: the
real launch (glue, plan, schedule, attention and reduce kernels) over a grid of query lengths,
dtypes, fp8 formats and options, the op's guarantees on the device (no host synchronisation, a
step replayed in a CUDA graph, untouched spare rows, opcheck, the debug content checks), and the
module's steps: one varlen call per step, equal to the CPU's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import make_paged_kv_of_value_size

import paged_attention.ops.bindings  # registers torch.ops.paged_attention
import paged_attention.ops.bindings as pa_ops
from paged_attention.attention import PagedAttention
from paged_attention.kv.cache import PagedKVCache
from paged_attention.ops import reference

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ops = torch.ops.paged_attention
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCES = {
    torch.float32: dict(atol=5e-5, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
UNTOUCHED = 7.0
# (new query rows, cached context): decode, a chunk after a context, a whole prompt, no rows,
# speculative decoding, a long chunk, a long prompt.
MIXED = [(1, 600), (37, 20), (70, 0), (0, 9), (4, 1000), (130, 150), (700, 0)]


class Case:
    """A paged cache on the GPU holding the sequences, their new query rows and spare rows;
    values of head size ``v_head_size`` (by default ``head_size``)."""

    def __init__(
        self,
        seqs,
        *,
        num_heads=8,
        num_kv_heads=2,
        head_size=128,
        v_head_size=None,
        block_size=16,
        dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        spare_rows=3,
        seed=0,
    ):
        self.query_lens = [q for q, _ in seqs]
        seq_lens = [q + c for q, c in seqs]
        device = torch.device("cuda")
        self.v_head_size = v_head_size or head_size
        self.kv = make_paged_kv_of_value_size(len(seqs), seq_lens, num_kv_heads, head_size,
                                              self.v_head_size, block_size, dtype, kv_cache_dtype,
                                              device=device, seed=seed)  # fmt: skip
        gen = torch.Generator().manual_seed(seed + 1)
        rows = sum(self.query_lens) + spare_rows
        self.query = torch.randn(rows, num_heads, head_size, generator=gen).to(device, dtype)
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        self.starts = torch.tensor(starts, dtype=torch.int32, device=device)
        self.num_heads, self.dtype = num_heads, dtype

    def args(self, *, alibi=False, sliding_window=0, logits_soft_cap=0.0, sinks=False, chunk=0):
        h, dev = self.num_heads, self.query.device
        return (
            self.query,
            self.kv.key_cache,
            self.kv.value_cache,
            self.kv.num_kv_heads,
            self.kv.head_size**-0.5,
            self.kv.block_tables,
            self.kv.seq_lens,
            self.starts,
            max(self.query_lens, default=0),
            self.kv.max_seq_len,
            torch.linspace(0.02, 0.4, h, device=dev) if alibi else None,
            self.kv.kv_cache_dtype,
            self.kv.k_scale,
            self.kv.v_scale,
            sliding_window,
            logits_soft_cap,
            torch.linspace(-2.0, 3.0, h, device=dev) if sinks else None,
            chunk,
        )

    def untouched_out(self):
        return self.query.new_full((*self.query.shape[:2], self.v_head_size), UNTOUCHED)

    def run(self, args):
        out = self.untouched_out()
        ops.paged_attention_varlen(out, *args)
        return out

    def check(self, **options):
        args = self.args(**options)
        out = self.run(args)
        expected = self.untouched_out()
        reference.paged_attention_varlen(expected, *args)
        torch.testing.assert_close(out, expected, **TOLERANCES[self.dtype])
        assert (out[sum(self.query_lens) :] == UNTOUCHED).all()
        return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2"])
def test_mixed_batch(dtype, kv_cache_dtype):
    Case(MIXED, dtype=dtype, kv_cache_dtype=kv_cache_dtype).check()


# Values of a head size of their own (multi-head latent attention in its expanded form: keys
# 192 and values 128 in DeepSeek-V3, 128 and 64 in a tiny DeepSeek-V2-Lite like model).
@pytest.mark.parametrize("head_size,v_head_size", [(192, 128), (128, 64), (64, 128)])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_values_of_their_own_head_size(head_size, v_head_size, kv_cache_dtype, dtype):
    case = Case(MIXED, head_size=head_size, v_head_size=v_head_size, dtype=dtype,
                kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    assert case.check().shape[2] == v_head_size
    # MHA as DeepSeek's expanded MLA runs it, with every option.
    case = Case(MIXED, num_heads=4, num_kv_heads=4, head_size=head_size, v_head_size=v_head_size,
                dtype=dtype, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    case.check(alibi=True, sliding_window=300, logits_soft_cap=20.0, sinks=True, chunk=256)


@pytest.mark.parametrize("head_size", [32, 64, 80, 96, 112, 120, 128, 192, 256])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_head_and_block_sizes(head_size, block_size):
    dtype = torch.float16 if head_size % 64 else torch.bfloat16
    Case([(1, 90), (9, 30), (90, 200)], head_size=head_size, block_size=block_size,
         dtype=dtype).check()  # fmt: skip


@pytest.mark.parametrize("group", [1, 4, 5, 8, 16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_groups(group, dtype):
    num_kv_heads = 2 if group <= 8 else 1
    Case([(3, 100), (40, 40)], num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
         dtype=dtype).check()  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "options",
    [
        dict(sliding_window=1),
        dict(sliding_window=100),
        dict(alibi=True),
        dict(logits_soft_cap=5.0),
        dict(sinks=True),
        dict(alibi=True, sliding_window=64, logits_soft_cap=20.0, sinks=True),
        dict(chunk=1),
        dict(chunk=7),
        dict(chunk=16),
        dict(chunk=100),
        dict(chunk=5000),
        dict(alibi=True, sliding_window=64, logits_soft_cap=20.0, sinks=True, chunk=48),
    ],
    ids=["window1", "window100", "alibi", "softcap", "sinks", "all", "chunk1", "chunk7",
         "chunk16", "chunk100", "chunk5000", "all+chunk"],
)  # fmt: skip
def test_options(dtype, options):
    Case(MIXED, dtype=dtype).check(**options)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len", [1, 4, 40, 300])
def test_small_batch_long_context_splits(dtype, q_len):
    Case([(q_len, 9000)], dtype=dtype).check(sinks=True)
    Case([(q_len, 9000)], dtype=dtype).check(sinks=True, chunk=2048)


@pytest.mark.parametrize("chunk", [7, 64, 100])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_blocks_before_the_first_rows_chunk_are_never_read(chunk, block_size):
    seqs = [(1, 150), (20, 130), (90, 0), (130, 150)]
    case = Case(seqs, block_size=block_size, dtype=torch.bfloat16, seed=chunk)
    for s, (_, context) in enumerate(seqs):
        first = reference.first_attended_position(context, 0, chunk)
        case.kv.block_tables[s, : first // block_size] = 10**6  # released
    case.check(chunk=chunk, alibi=True)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e5m2"])
def test_cuda_and_cpu_kernels_agree(kv_cache_dtype):
    case = Case(MIXED, dtype=torch.float32, kv_cache_dtype=kv_cache_dtype)
    args = case.args(alibi=True, sliding_window=50, sinks=True, chunk=24)
    cuda_out = case.run(args)
    cpu_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    cpu_out = torch.full_like(cpu_args[0], UNTOUCHED)
    ops.paged_attention_varlen(cpu_out, *cpu_args)
    torch.testing.assert_close(cuda_out.cpu(), cpu_out, **TOLERANCES[torch.float32])


def test_wrapper_on_cuda_tensors_and_strided_query():
    case = Case([(1, 30), (25, 5)], spare_rows=0)
    qkv = torch.randn(case.query.shape[0], 3 * case.num_heads, case.kv.head_size, device="cuda")
    query = qkv.to(case.dtype)[:, case.num_heads : 2 * case.num_heads]
    kv = case.kv
    out = paged_attention.paged_attention_varlen(
        query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, case.starts,
        max_query_len=25, max_seq_len=kv.max_seq_len,
    )  # fmt: skip
    expected = torch.zeros_like(out)
    args = list(case.args())
    args[0] = query
    reference.paged_attention_varlen(expected, *args)
    torch.testing.assert_close(out, expected, **TOLERANCES[case.dtype])


def test_no_host_synchronisation():
    case = Case(MIXED)
    args = case.args(sinks=True)
    out = torch.empty_like(case.query)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.paged_attention_varlen(out, *args)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_varlen_step_in_cuda_graph():
    # One capture with the host bounds of the largest step, replayed with other query lengths and
    # contexts inside those bounds.
    num_seqs, max_query_len, max_seq_len, max_tokens = 4, 64, 512, 128
    case = Case([(max_query_len, max_seq_len - max_query_len)] * num_seqs, spare_rows=0)
    kv = case.kv
    static_query = torch.zeros(max_tokens, case.num_heads, kv.head_size, device="cuda",
                               dtype=case.dtype)  # fmt: skip
    static_starts = torch.zeros(num_seqs + 1, dtype=torch.int32, device="cuda")
    static_lens = torch.ones(num_seqs, dtype=torch.int32, device="cuda")
    static_out = torch.zeros_like(static_query)
    args = list(case.args(sinks=True))
    args[0], args[6], args[7], args[8], args[9] = (
        static_query, static_lens, static_starts, max_query_len, max_seq_len,
    )  # fmt: skip

    def step():
        ops.paged_attention_varlen(static_out, *args)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        q_lens = torch.randint(0, max_query_len + 1, (num_seqs,), generator=gen)
        q_lens = (q_lens * max_tokens // max(int(q_lens.sum()), max_tokens)).int()
        contexts = torch.randint(0, max_seq_len - max_query_len + 1, (num_seqs,), generator=gen)
        starts = torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).int()])
        static_starts.copy_(starts.cuda())
        static_lens.copy_((q_lens + contexts).int().cuda())
        static_query.normal_()
        static_out.fill_(UNTOUCHED)
        graph.replay()
        expected = torch.full_like(static_out, UNTOUCHED)
        reference.paged_attention_varlen(expected, *args)
        torch.testing.assert_close(static_out, expected, **TOLERANCES[case.dtype])


@pytest.mark.parametrize("chunk", [0, 32])
def test_opcheck(chunk):
    case = Case([(1, 20), (30, 40)], kv_cache_dtype="fp8_e4m3")
    args = case.args(sliding_window=16, logits_soft_cap=10.0, sinks=True, chunk=chunk)
    torch.library.opcheck(ops.paged_attention_varlen, (torch.empty_like(case.query), *args))


def test_debug_checks_reject_out_of_range_block_id_and_bad_starts():
    code = (
        "import torch, paged_attention.ops.bindings as o\n"
        "q = torch.randn(4, 2, 64, device='cuda', dtype=torch.float16)\n"
        "kc = torch.zeros(4, 2, 8, 16, 8, device='cuda', dtype=torch.float16)\n"
        "vc = torch.zeros(4, 2, 64, 16, device='cuda', dtype=torch.float16)\n"
        "bt = torch.tensor([[9]], dtype=torch.int32, device='cuda')\n"
        "sl = torch.tensor([3], dtype=torch.int32, device='cuda')\n"
        "for starts in ([0, 3], [1, 3]):\n"
        "    qsl = torch.tensor(starts, dtype=torch.int32, device='cuda')\n"
        "    try:\n"
        "        o.paged_attention_varlen(q, kc, vc, bt, sl, qsl, max_query_len=3, max_seq_len=3)\n"
        "    except ValueError as e:\n"
        "        print('raised:', e)\n"
    )
    env = dict(os.environ, PAGED_ATTENTION_DEBUG_CHECKS="1")
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert "block_tables[0, 0] = 9" in result.stdout, result.stdout + result.stderr
    assert "query_start_loc[0] must be 0" in result.stdout, result.stdout + result.stderr


# --------------------------------------------------------------------------------------------
# PagedAttention on CUDA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_steps_on_cuda_equal_the_cpu_and_use_one_varlen_call(dtype, monkeypatch):
    num_heads, num_kv_heads, head_size, block_size = 8, 2, 64, 16
    results = {}
    for device in ("cpu", "cuda"):
        calls = []
        original = pa_ops.paged_attention_varlen

        def counted(*args, _original=original, _calls=calls, **kwargs):
            _calls.append(1)
            return _original(*args, **kwargs)

        monkeypatch.setattr(pa_ops, "paged_attention_varlen", counted)
        module = PagedAttention(num_heads, head_size, num_kv_heads, sinks=[0.5] * num_heads,
                                sliding_window=40, attention_chunk_size=24).to(device)  # fmt: skip
        cache = PagedKVCache(1, num_kv_heads, head_size, block_size, 64, dtype=dtype,
                             device=device)  # fmt: skip
        manager = cache.make_manager(watermark=0.0)
        gen = torch.Generator().manual_seed(3)
        outputs = []
        for step in ([(0, 30), (1, 7)], [(0, 1), (1, 12), (2, 50)], [(0, 1), (1, 1), (2, 1)]):
            seq_ids, lens = [s for s, _ in step], [n for _, n in step]
            for s, n in step:
                if manager.has_seq(s):
                    cache.copy_blocks(manager.append_slots(s, n))
                else:
                    manager.allocate(s, n)
            meta = cache.metadata(manager, seq_ids, lens)
            tokens = sum(lens)
            q = torch.randn(tokens, num_heads, head_size, generator=gen).to(device, dtype)
            k = torch.randn(tokens, num_kv_heads, head_size, generator=gen).to(device, dtype)
            v = torch.randn(tokens, num_kv_heads, head_size, generator=gen).to(device, dtype)
            calls.clear()
            with torch.no_grad():
                outputs.append(module(q, k, v, cache.layer(0), meta).cpu())
            assert len(calls) == 1  # one varlen call per step (sinks: decode-only steps too)
        results[device] = outputs
        monkeypatch.undo()
    for cpu, cuda in zip(results["cpu"], results["cuda"]):
        torch.testing.assert_close(cuda, cpu, **TOLERANCES[dtype])


# --------------------------------------------------------------------------------------------
# The plan on this GPU


def check_every_variant():
    """Each compiled kernel variant the plan picks on this GPU: query dtype, cache format, head
    bucket (a padded head size among them) and row tiling (2 or 20 new rows per sequence)."""
    for dtype in DTYPES:
        for kv_cache_dtype in ("auto", "fp8_e4m3"):
            for head_size in (64, 96, 256):
                for q_len in (2, 20):
                    Case([(q_len, 300), (1, 40)], head_size=head_size, dtype=dtype,
                         kv_cache_dtype=kv_cache_dtype, seed=head_size + q_len).check()  # fmt: skip


def test_every_variant_on_this_gpu():
    check_every_variant()


def test_every_variant_as_a_99_kib_gpu_plans_it():
    # PAGED_ATTENTION_SHARED_LIMIT makes this GPU plan like an sm_86 / sm_89 / sm_120 (99 KiB of
    # shared memory per CTA): the compact rings run here, on real hardware. A child process,
    # because the limits are read once per process.
    tests = os.path.dirname(__file__)
    env = dict(os.environ, PAGED_ATTENTION_SHARED_LIMIT=str(99 * 1024))
    env["PYTHONPATH"] = os.pathsep.join([tests, env.get("PYTHONPATH", "")])
    code = "import test_cuda_varlen; test_cuda_varlen.check_every_variant()"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_this_gpus_limits_are_those_the_plan_models():
    # The plan's model of each architecture (plan.h, kTargetGpus) against what the device says.
    import cuda_emulator as emu

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    arch = f"sm_{props.major}{props.minor}"
    targets = emu.targets()
    if arch not in targets:
        pytest.skip(f"{props.name} is {arch}, not one of the modelled targets {list(targets)}")
    target = targets[arch]
    assert props.shared_memory_per_block_optin == target["shared_per_block_optin"]
    assert props.shared_memory_per_multiprocessor == target["shared_per_sm"]
    assert props.regs_per_multiprocessor == target["registers_per_sm"]
    assert props.max_threads_per_multi_processor == target["threads_per_sm"]
