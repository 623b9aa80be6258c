#!/usr/bin/env bash
# One-GPU check of the CUDA kernels and the engine on them, made for the H200 machine (16 cores,
# torch + nvcc, no network), within 9 minutes. It records the device (name, architecture, SMs,
# shared memory and registers: what the launch plan fits each kernel to; docs/cuda.md). Stages,
# each with its own timeout (a failing one does not stop the later ones); the default stages'
# budgets add up to 535 s:
#   build      120 s  the extension for sm_90 with 16 jobs; meanwhile, in the background, the
#                     attention units compiled to cubins for sm_80, sm_86 and sm_89 (the SASS
#                     gates' other architectures; tests/cuda_sass.py, its table into tests.log)
#   tests      120 s  tests/test_cuda_ops.py, test_cache_ops.py, test_cuda_sass.py (sm_80, 86, 89,
#                     90), test_cuda_varlen.py (every kernel variant as this GPU plans it and as a
#                     99 KiB GPU plans it, PAGED_ATTENTION_SHARED_LIMIT; this GPU's limits
#                     against the plan's model of its architecture), and the emulated kernels of
#                     the varlen op (test_cuda_emulated_varlen.py, on the CPUs), with 8
#                     pytest-xdist workers
#   memcheck    35 s  compute-sanitizer --tool memcheck on small cases of every op (the varlen
#                     op in each row tiling, scheduled, split and on CUDA cores)
#   racecheck   35 s  compute-sanitizer --tool racecheck (shared-memory hazards) on the same,
#               25 s  and on the variants with a compact ring, planned as a 99 KiB GPU plans them
#   bench       35 s  benchmarks/bench_decode.py --device cuda: v1, v2, gather+SDPA and FlashInfer
#                     (tensor-core and CUDA-core decode) on the same cache values, bf16/fp16/fp32,
#                     batch 8 and 64 x 4096
#   reduce      20 s  v1 and v2 on one 131072-token sequence (bf16): v2's 256 partitions make
#                     the split reduce kernel's work long
#   prefill     35 s  varlen rows (the rows of bench_prefill.py: a 4 new tokens over 32 x 4096, b a
#                     512-token chunk of 4 x 2048, c a 4096-token prompt, d decode over 32 x 4096):
#                     ours, gather + SDPA and FlashInfer's paged prefill (the bundle's tensor-core
#                     module: BatchPrefillWithPagedKVCacheWrapper, fa2, bf16, head size 128),
#                     beside the streaming-read limit (a, d) and a bf16 matmul's rate (b, c)
#   ncu         30 s  Nsight Compute, --launch-count 1, on our decode kernel and FlashInfer's
#                     tensor-core decode (bf16, batch 64 x 4096): dram throughput, achieved
#                     occupancy, issue activity, instructions executed, tensor-pipe utilisation,
#                     warp stall reasons
#   serving     80 s  the engine on the GPU: python -m paged_attention demo --device cuda (CUDA
#                     graphs), the same with --no-cuda-graphs (20 s each), and
#                     benchmarks/bench_serving.py --device cuda --workloads B --modes offline (40 s)
# Optional stages (GPU_CHECK_STAGES=...): smoke (every op against reference.py without pytest),
# flex (v1/v2 against compiled FlexAttention), kernels (benchmarks/bench_cuda_kernels.cu: the
# decode and varlen kernels timed without torch; its build compiles every variant, about a
# minute).
#
# FlashInfer cannot be pip-installed there (no network): the bundle of ../shared/peers/flashinfer
# (FlashInfer 0.7.2.post1 prebuilt for sm_90a, bf16 head size 128; see its README) travels in a
# git-ignored folder of the checkout. Once, in the repository's root:
#     echo /.peers/ >> "$(git rev-parse --git-common-dir)/info/exclude"
#     cp -r ../shared/peers .peers
# and name `.peers` in the device call's `carry`. Without it the FlashInfer rows say why.
#
# Usage: [GPU_CHECK_STAGES=tests,bench,...] benchmarks/gpu_check.sh OUTDIR
# OUTDIR receives at most 8 files (what a device call brings back): summary.txt build.log
# tests.log (pytest, sanitizers, smoke, demos) bench.log (every benchmark's table, ncu excepted)
# bench_decode_cuda.json bench_prefill_cuda.json bench_serving_cuda.json ncu.log
set -u -o pipefail

if [ $# -ne 1 ]; then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi
mkdir -p "$1"
OUT=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
# The extension is built in place: scripts outside the repository root import it from here.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
SUMMARY="$OUT/summary.txt"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
: > "$SUMMARY"
FAILED=0
SCRIPT_START=$(date +%s)

note() { echo "$*" | tee -a "$SUMMARY"; }

ALL_STAGES="smoke,tests,memcheck,racecheck,bench,reduce,prefill,flex,ncu,kernels,serving"
DEFAULT_STAGES="tests,memcheck,racecheck,bench,reduce,prefill,ncu,serving"
STAGES=",${GPU_CHECK_STAGES:-$DEFAULT_STAGES},"
want() { [[ $STAGES == *",$1,"* ]]; }
for stage in ${STAGES//,/ }; do
  if [[ ",$ALL_STAGES," != *",$stage,"* ]]; then
    echo "GPU_CHECK_STAGES: unknown stage '$stage' (known: $ALL_STAGES)" >&2
    exit 2
  fi
done

# run_stage NAME TIMEOUT_S LOG COMMAND...: runs COMMAND with a timeout, appending to LOG, and
# records its exit status and duration in the summary.
run_stage() {
  local name=$1 limit=$2 log=$3
  shift 3
  local start rc
  start=$(date +%s)
  timeout --kill-after=3 "$limit" "$@" >> "$log" 2>&1
  rc=$?
  local seconds=$(( $(date +%s) - start ))
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    note "[$name] TIMEOUT after ${limit}s (log: $(basename "$log"))"
  elif [ $rc -ne 0 ]; then
    note "[$name] FAILED rc=$rc in ${seconds}s (log: $(basename "$log"))"
  else
    note "[$name] ok in ${seconds}s"
  fi
  [ $rc -eq 0 ] || FAILED=1
  return $rc
}

COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
note "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $COMMIT"
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null)
note "gpu: ${GPU:-nvidia-smi unavailable}"
note "torch: $($PY -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda,
  "available", torch.cuda.is_available())' 2>&1)"
note "device: $($PY - 2>&1 <<'PYEOF'
import torch

if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    print(f"{p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, shared memory "
          f"{p.shared_memory_per_block_optin} B per CTA (opt-in) and "
          f"{p.shared_memory_per_multiprocessor} B per SM, {p.regs_per_multiprocessor} registers "
          f"and {p.max_threads_per_multi_processor} threads per SM, L2 {p.L2_cache_size >> 20} "
          f"MiB, {p.total_memory / 2**30:.0f} GiB")
else:
    print("torch sees no CUDA device")
PYEOF
)"
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
note "nvcc: $("$NVCC" --version 2>/dev/null | tail -1 || echo 'not found')"
if ! $PY -c 'import ninja' 2>/dev/null && ! command -v ninja >/dev/null; then
  note "warning: ninja not found: torch builds serially, MAX_JOBS has no effect"
fi

# ---- 1. build ------------------------------------------------------------------------------
# The SASS gates' other architectures compile meanwhile (cached in build/sass/ for the tests).
SASS_PID=
if want tests; then
  timeout 200 $PY tests/cuda_sass.py --arch 80 86 89 --jobs 6 > "$WORK/sass.txt" 2>&1 &
  SASS_PID=$!
fi
export PAGED_ATTENTION_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
# The system compiler, not $CXX/$CC: the H200 image sets CXX=/opt/gcc/bin/g++, a wrapper around
# another build of GCC 13.3, and an extension it builds (even a one-op repro without flags)
# segfaults as soon as an op formats a number into its error message; built by /usr/bin/g++, the
# same repro raises normally.
run_stage build 120 "$OUT/build.log" env -u CXX -u CC $PY setup.py build_ext --inplace
BUILD_RC=$?
unset PAGED_ATTENTION_CUDA MAX_JOBS

# ---- FlashInfer from the carried bundle (its README) ---------------------------------------
PEERS=.peers/flashinfer
if ls $PEERS/apache_tvm_ffi-*.whl $PEERS/flashinfer-trim-*.tar.xz >/dev/null 2>&1; then
  mkdir -p "$WORK/flashinfer"
  if $PY -m pip install -q --no-index --no-deps --target "$WORK/flashinfer" \
      $PEERS/apache_tvm_ffi-*.whl >> "$OUT/build.log" 2>&1 \
      && tar -C "$WORK/flashinfer" -xJf $PEERS/flashinfer-trim-*.tar.xz; then
    export PYTHONPATH="$WORK/flashinfer:$PYTHONPATH" FLASHINFER_DISABLE_JIT=1
    note "flashinfer: $($PY -c 'import flashinfer; print(flashinfer.__version__)' 2>&1 | tail -1)"
  else
    note "flashinfer: the bundle in $PEERS did not install (see build.log)"
  fi
else
  note "flashinfer: no bundle in $PEERS (carry it: see the header); its rows will say so"
fi

# ---- the smoke / memcheck script (every op against reference.py, no pytest needed) ----------
cat > "$WORK/smoke.py" <<'PYEOF'
"""Every CUDA op against reference.py on small inputs.

`--tiny` is the compute-sanitizer case: fewer cases, and the reference (which would load cuBLAS
under the sanitizer, slowly) is skipped: only our kernels run and nothing is compared.
`--compact-rings` takes the attention cases whose variants have a compact ring (docs/cuda.md),
for a run planned as for 99 KiB per CTA (PAGED_ATTENTION_SHARED_LIMIT).
"""
import math
import sys

import torch

import paged_attention.ops.bindings as pa
from paged_attention.ops import reference

ops = torch.ops.paged_attention
tiny = "--tiny" in sys.argv
dev = torch.device("cuda")
gen = torch.Generator().manual_seed(0)
failures = []


def check(name, ok, detail=""):
    if tiny:
        print("RAN  " + name, flush=True)
        return
    print(("PASS " if ok else "FAIL ") + name + (f"  {detail}" if detail else ""), flush=True)
    if not ok:
        failures.append(name)


def close(a, b, tol):
    err = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    return err <= tol, f"max abs err {err:.3g}"


def make_cache(dtype, kv, num_blocks, heads, head_size, block_size):
    fp8 = kv != "auto"
    cdt = torch.uint8 if fp8 else dtype
    x = 16 // torch.empty((), dtype=cdt).element_size()
    scale = torch.tensor([0.5], device=dev)
    k = torch.randn(num_blocks, heads, head_size // x, block_size, x, generator=gen).to(dev)
    v = torch.randn(num_blocks, heads, head_size, block_size, generator=gen).to(dev)
    if fp8:
        return reference.quantize(k, kv, scale), reference.quantize(v, kv, scale), scale
    return k.to(dtype), v.to(dtype), scale


cases = [(torch.bfloat16, "auto", 128, 16), (torch.float32, "fp8_e4m3", 64, 8),
         (torch.float16, "fp8_e5m2", 256, 32)]
if tiny:
    cases = cases[:2]
if "--compact-rings" in sys.argv:  # two stages (bf16, 128), one stage (fp16 and fp32, 256)
    cases = [(torch.bfloat16, "auto", 128, 16), (torch.float16, "auto", 256, 16),
             (torch.float32, "auto", 256, 8)]
seq_lens = [0, 1, 37, 300] if tiny else [0, 1, 37, 700, 1500]
for dtype, kv, head_size, block_size in cases:
    num_heads, num_kv_heads = 8, 2
    max_len = max(seq_lens)
    max_blocks = math.ceil(max_len / block_size)
    num_blocks = len(seq_lens) * max_blocks + 3
    key_cache, value_cache, scale = make_cache(
        dtype, kv, num_blocks, num_kv_heads, head_size, block_size)
    tables = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * max_blocks]
    tables = tables.view(len(seq_lens), max_blocks).to(torch.int32).to(dev)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=gen).to(dev, dtype)
    slopes = torch.linspace(0.01, 0.2, num_heads, device=dev)
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    for window, cap, alibi in [(0, 0.0, None), (300, 15.0, slopes)]:
        common = (query, key_cache, value_cache, num_kv_heads, head_size**-0.5, tables, lens,
                  block_size, max_len, alibi, kv, scale, scale, window, cap)
        want = torch.empty_like(query)
        if not tiny:
            reference.paged_attention_v1(want, *common)
        got = torch.empty_like(query)
        ops.paged_attention_v1(got, *common)
        name = f"attention_v1 {dtype} {kv} d{head_size} b{block_size} w{window}"
        check(name, *close(got, want, tol))
        parts = pa.num_partitions(max_len)
        sums = torch.empty(len(seq_lens), num_heads, parts, device=dev)
        maxes = torch.empty_like(sums)
        tmp = torch.empty(len(seq_lens), num_heads, parts, head_size, dtype=dtype, device=dev)
        got2 = torch.empty_like(query)
        ops.paged_attention_v2(got2, sums, maxes, tmp, *common)
        check(name.replace("v1", "v2"), *close(got2, want, tol))

# paged_attention_varlen, (new query rows, cached context) per sequence: short queries (16-row
# CTAs), long ones (64-row CTAs listed by the schedule kernel), one long context (split, reduce),
# fp32 on CUDA cores; plain, and with a window, soft-cap, ALiBi and sinks
batches = [[(1, 40), (4, 30), (0, 5)], [(1, 60), (0, 5), (70, 20), (200, 0)], [(8, 3000)]]
if not tiny:
    batches = [[(1, 600), (4, 1000), (0, 9)], [(1, 600), (37, 20), (130, 150), (700, 0)],
               [(40, 9000)]]
for dtype, kv, head_size, block_size in cases:
    num_heads, num_kv_heads = 8, 2
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    for batch in batches:
        q_lens = [q for q, _ in batch]
        lens_list = [q + c for q, c in batch]
        max_len = max(lens_list)
        max_blocks = math.ceil(max_len / block_size)
        num_blocks = len(batch) * max_blocks + 3
        key_cache, value_cache, scale = make_cache(
            dtype, kv, num_blocks, num_kv_heads, head_size, block_size)
        tables = torch.randperm(num_blocks, generator=gen)[: len(batch) * max_blocks]
        tables = tables.view(len(batch), max_blocks).to(torch.int32).to(dev)
        lens = torch.tensor(lens_list, dtype=torch.int32, device=dev)
        starts = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                              device=dev)
        query = torch.randn(sum(q_lens) + 2, num_heads, head_size, generator=gen).to(dev, dtype)
        slopes = torch.linspace(0.01, 0.2, num_heads, device=dev)
        sinks = torch.linspace(-1.0, 2.0, num_heads, device=dev)
        for window, cap, alibi, sink in [(0, 0.0, None, None), (100, 15.0, slopes, sinks)]:
            args = (query, key_cache, value_cache, num_kv_heads, head_size**-0.5, tables, lens,
                    starts, max(q_lens), max_len, alibi, kv, scale, scale, window, cap, sink)
            want = torch.full_like(query, 7.0)
            if not tiny:
                reference.paged_attention_varlen(want, *args)
            got = torch.full_like(query, 7.0)
            ops.paged_attention_varlen(got, *args)
            name = (f"varlen {dtype} {kv} d{head_size} b{block_size} q{max(q_lens)} "
                    f"ctx{max_len} w{window}")
            check(name, *close(got, want, tol))

# reshape_and_cache: bit-exact, fp8 included, strided key/value, negative slots skipped
for dtype, kv in [(torch.bfloat16, "auto"), (torch.float16, "fp8_e4m3"),
                  (torch.float32, "fp8_e5m2")]:
    key_cache, value_cache, scale = make_cache(dtype, kv, 6, 2, 64, 16)
    qkv = torch.randn(20, 6, 64, generator=gen).to(dev, dtype)
    key, value = qkv[:, 2:4], qkv[:, 4:]
    slots = torch.randperm(96, generator=gen)[:20].to(dev)
    slots[::5] = -1
    want = (key_cache.clone(), value_cache.clone())
    if not tiny:
        reference.reshape_and_cache(key, value, *want, slots, kv, scale, scale)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots, kv, scale, scale)
    check(f"reshape_and_cache {dtype} {kv}",
          torch.equal(key_cache, want[0]) and torch.equal(value_cache, want[1]))

# copy_blocks: 3 layers, fan-out of one source to two destinations
caches = [torch.randn(8, 2, 64, 16, generator=gen).to(dev) for _ in range(6)]
want = [c.clone() for c in caches]
mapping = torch.tensor([[1, 5], [1, 6], [2, 0]], device=dev)
if not tiny:
    reference.copy_blocks(want[:3], want[3:], mapping)
ops.copy_blocks(caches[:3], caches[3:], mapping)
check("copy_blocks", all(torch.equal(a, b) for a, b in zip(caches, want)))

# swap_blocks in every direction, pinned and pageable host memory
mapping = torch.tensor([[0, 3], [4, 1]])
shape = (5, 2, 64, 16)
for label, src, dst in [
    ("d2d", torch.randn(shape, device=dev), torch.zeros(shape, device=dev)),
    ("d2h pinned", torch.randn(shape, device=dev), torch.zeros(shape).pin_memory()),
    ("h2d pinned", torch.randn(shape).pin_memory(), torch.zeros(shape, device=dev)),
    ("d2h pageable", torch.randn(shape, device=dev), torch.zeros(shape)),
    ("h2d pageable", torch.randn(shape), torch.zeros(shape, device=dev)),
]:
    want = dst.clone()
    if not tiny:
        reference.swap_blocks(src, want, mapping)
    ops.swap_blocks(src, dst, mapping)
    torch.cuda.synchronize()
    check(f"swap_blocks {label}", torch.equal(dst, want))

torch.cuda.synchronize()
print(f"{len(failures)} failure(s)" + (": " + ", ".join(failures) if failures else ""))
sys.exit(1 if failures else 0)
PYEOF

if [ $BUILD_RC -ne 0 ]; then
  [ -n "$SASS_PID" ] && kill "$SASS_PID" 2>/dev/null
  note "build failed: skipping the GPU stages (see build.log)"
  note "total $(( $(date +%s) - SCRIPT_START ))s; RESULT: FAILED"
  exit 1
fi

# ---- 2. CUDA tests and the smoke check ----------------------------------------------------
if want smoke; then
  echo "== smoke check (plain python, every op vs reference.py) ==" >> "$OUT/tests.log"
  run_stage smoke 40 "$OUT/tests.log" $PY "$WORK/smoke.py"
  grep -E "failure\(s\)" "$OUT/tests.log" | tail -1 | sed 's/^/  smoke: /' >> "$SUMMARY"
fi
if ! want tests; then
  :
elif $PY -c 'import pytest' 2>/dev/null; then
  TEST_FILES="tests/test_cuda_ops.py tests/test_cache_ops.py tests/test_cuda_sass.py
    tests/test_cuda_varlen.py tests/test_cuda_emulated_varlen.py"
  echo "== pytest $TEST_FILES ==" >> "$OUT/tests.log"
  # Eight workers when pytest-xdist is there: the tests are many small launches plus reference.py.
  # The emulated kernels' library (tests/cuda_emulator.py) is built once first, by the system
  # compiler (see the build stage), instead of by every worker.
  WORKERS=$($PY -c 'import xdist' 2>/dev/null && echo "-n 8" || true)
  [ -n "$SASS_PID" ] && wait "$SASS_PID"
  {
    echo "== tests/cuda_sass.py: registers, stack, main loop (all paths) and one tile =="
    cat "$WORK/sass.txt"
    $PY tests/cuda_sass.py --extension 2>&1 | tail -n +2
  } >> "$OUT/tests.log"
  run_stage tests 120 "$OUT/tests.log" env -u CXX -u CC bash -c "
    $PY -c 'import sys; sys.path.insert(0, \"tests\"); import cuda_emulator; cuda_emulator.library()' &&
    $PY -m pytest $TEST_FILES -q -rfE -p no:cacheprovider --durations=10 $WORKERS"
  grep -E "[0-9]+ (passed|failed|skipped|errors?)" "$OUT/tests.log" | tail -1 \
    | sed 's/^/  pytest: /' >> "$SUMMARY"
  grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | cut -c1-300 | sed 's/^/    /' >> "$SUMMARY"
else
  note "[tests] SKIPPED: pytest is not importable by $PY"
fi

# ---- 3. compute-sanitizer: memcheck and racecheck on small cases of every op -----------------
# On PATH, in a CUDA toolkit, or in the nvidia-cuda-sanitizer-api wheel next to torch's CUDA libs.
SANITIZER=$(command -v compute-sanitizer || true)
WHEELS=$($PY -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))' 2>/dev/null)
for candidate in /usr/local/cuda/bin/compute-sanitizer \
    /usr/local/cuda/compute-sanitizer/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer \
    $( [ -n "$WHEELS" ] && find "$WHEELS/nvidia" -maxdepth 4 -type f -name compute-sanitizer \
       2>/dev/null ); do
  [ -n "$SANITIZER" ] && break
  [ -x "$candidate" ] && SANITIZER=$candidate
done
for tool in memcheck racecheck; do
  want $tool || continue
  if [ -z "$SANITIZER" ]; then
    note "[$tool] SKIPPED: compute-sanitizer not found (PATH, /usr/local/cuda*, nvidia wheels)"
    continue
  fi
  # Without the caching allocator every tensor is its own allocation, so an out-of-bounds access
  # cannot hide inside a pooled segment.
  echo "== compute-sanitizer --tool $tool ==" >> "$OUT/tests.log"
  limit=35
  run_stage $tool $limit "$OUT/tests.log" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" \
    --tool $tool --error-exitcode 9 --print-limit 20 $PY "$WORK/smoke.py" --tiny
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/tests.log" | tail -1 \
    | sed "s/^/  $tool: /" >> "$SUMMARY"
  [ $tool = racecheck ] || continue
  # The compact rings of 99 KiB GPUs (the one-stage rings wait and refill differently), planned
  # so on this GPU; the emulated tests check their bounds, not their hazards.
  echo "== compute-sanitizer --tool racecheck, the 99 KiB plan ==" >> "$OUT/tests.log"
  run_stage racecheck-99k 25 "$OUT/tests.log" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
    PAGED_ATTENTION_SHARED_LIMIT=101376 "$SANITIZER" --tool racecheck --error-exitcode 9 \
    --print-limit 20 $PY "$WORK/smoke.py" --tiny --compact-rings
  grep -E "RACECHECK SUMMARY" "$OUT/tests.log" | tail -1 | sed "s/^/  racecheck-99k: /" \
    >> "$SUMMARY"
done

# ---- 4. decode benchmark: ours, gather + SDPA and FlashInfer on the same cache values --------
if want bench; then
  run_stage bench 35 "$OUT/bench.log" $PY benchmarks/bench_decode.py --device cuda \
    --batches 8,64 --contexts 4096 --dtypes bfloat16,float16,float32 \
    --methods v1,v2,gather+sdpa --cuda-methods flashinfer,flashinfer-cc \
    --json "$OUT/bench_decode_cuda.json" --plot "$WORK/bench_decode_cuda.png"
fi
if want reduce; then
  echo "== v1 and v2 over one 131072-token sequence (v2: 256 partitions to reduce) ==" \
    >> "$OUT/bench.log"
  run_stage reduce 20 "$OUT/bench.log" $PY benchmarks/bench_decode.py --device cuda \
    --batches 1 --contexts 131072 --dtypes bfloat16 --methods v1,v2 --reps 5 \
    --json "$WORK/bench_decode_cuda_long.json"
fi
if want flex; then
  echo "== v1 and v2 against compiled FlexAttention ==" >> "$OUT/bench.log"
  run_stage bench-flex 60 "$OUT/bench.log" $PY benchmarks/bench_decode.py --device cuda \
    --batches 64 --contexts 4096 --dtypes bfloat16,float32 --methods v1,v2,flex \
    --json "$WORK/bench_decode_cuda_flex.json"
fi

# ---- 5. varlen benchmark: ours, gather + SDPA and FlashInfer's paged prefill --------------------
cat > "$WORK/bench_varlen.py" <<'PYEOF'
"""The rows of benchmarks/bench_prefill.py on the GPU: paged_attention_varlen (ours), per-sequence
gather + SDPA (PagedAttention's prefill path before the varlen op) and FlashInfer's paged prefill
(BatchPrefillWithPagedKVCacheWrapper, fa2 backend: the bundle's prebuilt tensor-core module, bf16,
head size 128, causal) on the same cache values; beside the limit of the row's bound: a streaming
read of its K and V bytes (bandwidth rows), a bf16 8192^3 matmul's FLOP rate (compute rows).
Prints a table and writes JSON (argv[1])."""
import dataclasses
import json
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_decode import (  # noqa: E402
    FLASHINFER_WORKSPACE_BYTES, Shape, best_time, build_case, flashinfer_inputs, machine_info,
    read_limit,
)

import paged_attention.ops.bindings  # noqa: E402  (registers torch.ops.paged_attention)

dev = torch.device("cuda")
shape = Shape()
# name, batch, context (tokens per sequence, the new ones included), new rows, bound
ROWS = [("a", 32, 4096, 4, "bandwidth"), ("b", 4, 2048, 512, "compute"),
        ("c", 1, 4096, 4096, "compute"), ("d", 32, 4096, 1, "bandwidth")]
REPS = 10
TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-3}  # largest |difference| from ours


def flops(batch, context, q_len):
    pairs = q_len * (context - q_len) + q_len * (q_len + 1) / 2
    return 4 * shape.head_size * shape.num_heads * batch * pairs


def methods(case, query, batch, context, q_len):
    starts = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=dev)
    out = torch.empty_like(query)

    def ours():
        return paged_attention.paged_attention_varlen(
            query, case["key_cache"], case["value_cache"], case["block_tables"],
            case["seq_lens"], starts, max_query_len=q_len, max_seq_len=context, out=out)

    blocks = -(-context // shape.block_size)
    keys_rows = torch.arange(context, device=dev)
    mask = keys_rows[None] <= (context - q_len + torch.arange(q_len, device=dev))[:, None]

    def gather_sdpa():
        result = torch.empty_like(query)
        for s in range(batch):
            table = case["block_tables"][s, :blocks].long()
            k = case["key_cache"][table].permute(0, 3, 1, 2, 4).reshape(-1, shape.num_kv_heads,
                                                                      shape.head_size)
            v = case["value_cache"][table].permute(0, 3, 1, 2).reshape(-1, shape.num_kv_heads,
                                                                     shape.head_size)
            rows = slice(s * q_len, (s + 1) * q_len)
            result[rows] = torch.nn.functional.scaled_dot_product_attention(
                query[rows].transpose(0, 1), k[:context].transpose(0, 1),
                v[:context].transpose(0, 1), attn_mask=mask, enable_gqa=True).transpose(0, 1)
        return result

    made = {"ours": ours, "gather+sdpa": gather_sdpa}
    if query.dtype == torch.bfloat16:
        try:
            import flashinfer

            k_pages, v_pages, indptr, indices, last = flashinfer_inputs(case)
            workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                workspace, kv_layout="HND", backend="fa2")
            wrapper.plan(starts, indptr, indices, last, shape.num_heads, shape.num_kv_heads,
                         shape.head_size, shape.block_size, causal=True,
                         pos_encoding_mode="NONE", sm_scale=shape.head_size ** -0.5,
                         q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)

            def flashinfer_prefill():
                return wrapper.run(query, (k_pages, v_pages))

            made["flashinfer"] = flashinfer_prefill
        except Exception as error:  # reported instead of a number
            made["flashinfer"] = error
    return made


matmul = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
matmul_s = best_time(lambda: matmul @ matmul, dev, REPS)
peak_flops = 2 * 8192**3 / matmul_s
entries, disagreements = [], []
print(f"{'dtype':9} {'row':3} {'batch':>5} {'ctx':>5} {'q':>5} {'method':12} {'us':>10} "
      f"{'TB/s':>7} {'TFLOP/s':>8} {'% limit':>8} {'vs ours':>8}")
for dtype in (torch.bfloat16, torch.float32):
    for name, batch, context, q_len, bound in ROWS:
        case = build_case(dev, dtype, batch, context, shape)
        query = torch.randn(batch * q_len, shape.num_heads, shape.head_size, device=dev,
                            dtype=dtype)
        kv_bytes = 2 * batch * context * shape.num_kv_heads * shape.head_size * query.itemsize
        row = dict(dtype=str(dtype).removeprefix("torch."), row=name, batch=batch,
                   context=context, query_len=q_len, bound=bound, kv_bytes=kv_bytes,
                   flops=flops(batch, context, q_len))
        made = methods(case, query, batch, context, q_len)
        expected = made["ours"]().float()
        limit_s = (read_limit(kv_bytes, dev, REPS).seconds(kv_bytes) if bound == "bandwidth"
                   else row["flops"] / peak_flops)
        times = {}
        for method, fn in made.items():
            entry = dict(row, method=method)
            if isinstance(fn, Exception):
                entry.update(time_s=None, error=f"{type(fn).__name__}: {str(fn)[:200]}")
            else:
                err = (fn().float() - expected).abs().max().item()
                entry.update(time_s=best_time(fn, dev, REPS), max_abs_diff_vs_ours=err)
                times[method] = entry["time_s"]
                if not err <= TOLERANCE[dtype]:
                    disagreements.append(f"{method} {row['dtype']} row {name}: {err:.3g}")
            entries.append(entry)
        entries.append(dict(row, method="limit", time_s=limit_s))
        for entry in entries[-len(made) - 1:]:
            t = entry["time_s"]
            if t is None:
                print(f"{row['dtype']:9} {name:3} {batch:5} {context:5} {q_len:5} "
                      f"{entry['method']:12} {entry['error']}")
                continue
            entry.update(bytes_per_s=kv_bytes / t, flops_per_s=row["flops"] / t,
                         fraction_of_limit=limit_s / t, speed_vs_ours=times["ours"] / t)
            print(f"{row['dtype']:9} {name:3} {batch:5} {context:5} {q_len:5} "
                  f"{entry['method']:12} {t * 1e6:10.1f} {kv_bytes / t / 1e12:7.2f} "
                  f"{row['flops'] / t / 1e12:8.1f} {100 * limit_s / t:7.1f}% "
                  f"{times['ours'] / t:8.2f}")
result = dict(device="cuda", machine=machine_info(dev), shape=dataclasses.asdict(shape),
              bf16_matmul_flops_per_s=peak_flops, rows=entries)
with open(sys.argv[1], "w") as f:
    json.dump(result, f, indent=1)
if disagreements:
    sys.exit("results differ from ours: " + "; ".join(disagreements))
PYEOF
if want prefill; then
  echo "== varlen rows: ours, gather + SDPA, FlashInfer's paged prefill ==" >> "$OUT/bench.log"
  run_stage prefill 35 "$OUT/bench.log" $PY "$WORK/bench_varlen.py" \
    "$OUT/bench_prefill_cuda.json"
fi
if want kernels; then
  echo "== the attention kernels without torch (benchmarks/bench_cuda_kernels.cu) ==" \
    >> "$OUT/bench.log"
  run_stage kernels-build 90 "$OUT/bench.log" $PY benchmarks/build_bench_cuda_kernels.py \
    "$WORK/bench_cuda_kernels" --nvcc "$NVCC" \
    && run_stage kernels 20 "$OUT/bench.log" "$WORK/bench_cuda_kernels" \
      --json "$WORK/bench_cuda_kernels.json"
fi
if want bench || want reduce || want prefill || want flex || want kernels; then
  echo "  bench (last lines of bench.log):" >> "$SUMMARY"
  tail -n 70 "$OUT/bench.log" | sed 's/^/    /' >> "$SUMMARY"
fi

# ---- 6. the engine on the GPU: the demo (PagedCache, transformers adapter, greedy outputs checked
# against transformers' own generate()) with and without CUDA graphs, and the serving benchmark ---
if want serving; then
  echo "== python -m paged_attention demo --device cuda ==" >> "$OUT/tests.log"
  run_stage demo 20 "$OUT/tests.log" $PY -m paged_attention demo --device cuda
  echo "== python -m paged_attention demo --device cuda --no-cuda-graphs ==" >> "$OUT/tests.log"
  run_stage demo-eager 20 "$OUT/tests.log" $PY -m paged_attention demo --device cuda \
    --no-cuda-graphs
  echo "== benchmarks/bench_serving.py --device cuda --workloads B --modes offline ==" \
    >> "$OUT/bench.log"
  run_stage serving-bench 40 "$OUT/bench.log" $PY benchmarks/bench_serving.py --device cuda \
    --workloads B --modes offline --json "$OUT/bench_serving_cuda.json" \
    --plot "$WORK/bench_serving_cuda.png"
  tail -n 20 "$OUT/bench.log" | sed 's/^/    /' >> "$SUMMARY"
fi

# ---- 7. Nsight Compute: one launch of our decode kernel and one of FlashInfer's ---------------
# Batch 64 x 4096 tokens, bf16, 32/8 heads, d128 (the target row). The metrics say where the time
# goes: dram throughput against its peak, achieved occupancy, issue-slot activity, instructions
# executed, tensor-pipe (HMMA) activity, and the warp stall reasons (WarpStateStats).
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null \
  | head -1)
NCU_METRICS=dram__throughput.avg.pct_of_peak_sustained_elapsed
NCU_METRICS+=,sm__warps_active.avg.pct_of_peak_sustained_active
NCU_METRICS+=,smsp__issue_active.avg.pct_of_peak_sustained_active
NCU_METRICS+=,smsp__inst_executed.sum,sm__inst_executed_pipe_tensor_op_hmma.sum
NCU_METRICS+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
NCU_METRICS+=,gpu__time_duration.sum,dram__bytes_read.sum
if ! want ncu; then
  :
elif [ -n "$NCU" ]; then
  cat > "$WORK/profile_decode.py" <<'PYEOF'
import sys

import torch

sys.path.insert(0, "benchmarks")
import bench_decode  # noqa: E402

case = bench_decode.build_case(torch.device("cuda"), torch.bfloat16, 64, 4096)
method = sys.argv[1]
fn = bench_decode.method_ours(case, 1) if method == "ours" else bench_decode.make_method(method, case)
fn(), fn()
torch.cuda.synchronize()
PYEOF
  for target in ours:'regex:mma_attention_kernel' \
      flashinfer:'regex:BatchPrefillWithPagedKVCache|BatchDecodeWithPagedKVCache'; do
    method=${target%%:*}
    echo "== ncu: $method, bf16 64 x 4096 ==" >> "$OUT/ncu.log"
    ncu_args=(--clock-control none --kernel-name "${target#*:}" --launch-skip 1 --launch-count 1
      --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats)
    if ! run_stage ncu-$method 15 "$OUT/ncu.log" "$NCU" "${ncu_args[@]}" \
        --metrics "$NCU_METRICS" $PY "$WORK/profile_decode.py" "$method" \
        && grep -q "Failed to find metric" "$OUT/ncu.log"; then
      # A metric this ncu does not know: the sections alone (their own metric names).
      run_stage ncu-$method-sections 15 "$OUT/ncu.log" "$NCU" "${ncu_args[@]}" \
        $PY "$WORK/profile_decode.py" "$method"
    fi
  done
  grep -E "dram__throughput|sm__warps_active|smsp__issue_active|pipe_tensor_op_hmma_cycles" \
    "$OUT/ncu.log" | sed 's/^ */    /' >> "$SUMMARY"
else
  note "[ncu] SKIPPED: Nsight Compute (ncu) not found"
fi

RESULT=$([ $FAILED -eq 0 ] && echo ok || echo FAILED)
note "total $(( $(date +%s) - SCRIPT_START ))s; RESULT: $RESULT"
exit $FAILED
