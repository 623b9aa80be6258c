#!/usr/bin/env bash
# One-GPU check of the CUDA kernels, made for the H200 machine (16 cores, torch + nvcc, no
# network), within 8 minutes. Stages, each with its own timeout (a failing one does not stop the
# later ones); the budgets add up to 470 s:
#   build      130 s  the extension for sm_90 with 16 jobs
#   tests      100 s  tests/test_cuda_ops.py, test_cache_ops.py, test_cuda_sass.py (pytest-xdist if
#                     there)
#   memcheck    40 s  compute-sanitizer --tool memcheck on small cases of every op
#   racecheck   45 s  compute-sanitizer --tool racecheck (shared-memory hazards) on the same
#   bench       70 s  benchmarks/bench_decode.py --device cuda: v1, v2, gather+SDPA and FlashInfer
#                     (tensor-core and CUDA-core decode) on the same cache values, bf16/fp16/fp32
#   ncu         45 s  Nsight Compute, --launch-count 1, on our v1 decode kernel and FlashInfer's
#                     tensor-core decode (bf16, batch 64 x 4096): dram throughput, achieved
#                     occupancy, issue activity, instructions executed, tensor-pipe utilisation,
#                     warp stall reasons
#   kernels     40 s  benchmarks/bench_cuda_kernels.cu: the decode kernels timed without torch
# Optional stages (GPU_CHECK_STAGES=...): smoke (every op against reference.py without pytest),
# demo (the serving demo on the GPU), flex (v1/v2 against compiled FlexAttention).
#
# FlashInfer cannot be pip-installed there (no network): the bundle of ../shared/peers/flashinfer
# (FlashInfer 0.7.2.post1 prebuilt for sm_90a, bf16 head size 128; see its README) travels in a
# git-ignored folder of the checkout. Once, in the repository's root:
#     echo /.peers/ >> "$(git rev-parse --git-common-dir)/info/exclude"
#     cp -r ../shared/peers .peers
# and name `.peers` in the device call's `carry`. Without it the FlashInfer rows say why.
#
# Usage: [GPU_CHECK_STAGES=tests,bench,...] benchmarks/gpu_check.sh OUTDIR
# OUTDIR receives at most 8 files: summary.txt build.log tests.log (pytest, sanitizers, smoke,
# demo) bench.log bench_decode_cuda.json bench_decode_cuda.png bench_cuda_kernels.json ncu.log
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

ALL_STAGES="smoke,tests,memcheck,racecheck,bench,flex,ncu,kernels,demo"
DEFAULT_STAGES="tests,memcheck,racecheck,bench,ncu,kernels"
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
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
note "nvcc: $("$NVCC" --version 2>/dev/null | tail -1 || echo 'not found')"
if ! $PY -c 'import ninja' 2>/dev/null && ! command -v ninja >/dev/null; then
  note "warning: ninja not found: torch builds serially, MAX_JOBS has no effect"
fi

# ---- 1. build ------------------------------------------------------------------------------
export PAGED_ATTENTION_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
# The system compiler, not $CXX/$CC: the H200 image sets CXX=/opt/gcc/bin/g++, a wrapper around
# another build of GCC 13.3, and an extension it builds (even a one-op repro without flags)
# segfaults as soon as an op formats a number into its error message; built by /usr/bin/g++, the
# same repro raises normally.
run_stage build 130 "$OUT/build.log" env -u CXX -u CC $PY setup.py build_ext --inplace
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
"""
import math
import sys

import torch

import paged_attention._ops as pa
from paged_attention import reference

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
  echo "== pytest tests/test_cuda_ops.py tests/test_cache_ops.py tests/test_cuda_sass.py ==" \
    >> "$OUT/tests.log"
  # Eight workers when pytest-xdist is there: the tests are many small launches plus reference.py.
  WORKERS=$($PY -c 'import xdist' 2>/dev/null && echo "-n 8" || true)
  run_stage tests 100 "$OUT/tests.log" $PY -m pytest tests/test_cuda_ops.py \
    tests/test_cache_ops.py tests/test_cuda_sass.py -q -rfE -p no:cacheprovider --durations=10 \
    $WORKERS
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
  limit=$([ $tool = memcheck ] && echo 40 || echo 45)
  run_stage $tool $limit "$OUT/tests.log" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" \
    --tool $tool --error-exitcode 9 --print-limit 20 $PY "$WORK/smoke.py" --tiny
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/tests.log" | tail -1 \
    | sed "s/^/  $tool: /" >> "$SUMMARY"
done

# ---- 4. decode benchmark: ours, gather + SDPA and FlashInfer on the same cache values --------
if want bench; then
  run_stage bench 70 "$OUT/bench.log" $PY benchmarks/bench_decode.py --device cuda \
    --batches 8,64 --contexts 2048,4096,8192 --dtypes bfloat16,float16,float32 \
    --methods v1,v2,gather+sdpa --cuda-methods flashinfer,flashinfer-cc \
    --json "$OUT/bench_decode_cuda.json" --plot "$OUT/bench_decode_cuda.png"
fi
if want flex; then
  echo "== v1 and v2 against compiled FlexAttention ==" >> "$OUT/bench.log"
  run_stage bench-flex 60 "$OUT/bench.log" $PY benchmarks/bench_decode.py --device cuda \
    --batches 64 --contexts 4096 --dtypes bfloat16,float32 --methods v1,v2,flex \
    --json "$WORK/bench_decode_cuda_flex.json"
fi
if want kernels; then
  echo "== the decode kernels without torch (benchmarks/bench_cuda_kernels.cu) ==" \
    >> "$OUT/bench.log"
  run_stage kernels-build 25 "$OUT/bench.log" "$NVCC" -O3 -std=c++20 --expt-relaxed-constexpr \
    -gencode=arch=compute_90,code=sm_90 -Icsrc benchmarks/bench_cuda_kernels.cu \
    -o "$WORK/bench_cuda_kernels" \
    && run_stage kernels 15 "$OUT/bench.log" "$WORK/bench_cuda_kernels" \
      --json "$OUT/bench_cuda_kernels.json"
fi
if want bench || want flex || want kernels; then
  echo "  bench (last lines of bench.log):" >> "$SUMMARY"
  tail -n 60 "$OUT/bench.log" | sed 's/^/    /' >> "$SUMMARY"
fi

# ---- 5. the serving demo on the GPU (engine, PagedCache, transformers adapter, checked against
# transformers' own generate()) -----------------------------------------------------------------
if want demo; then
  echo "== python -m paged_attention demo --device cuda ==" >> "$OUT/tests.log"
  run_stage demo 50 "$OUT/tests.log" $PY -m paged_attention demo --device cuda
fi

# ---- 6. Nsight Compute: one launch of our decode kernel and one of FlashInfer's ---------------
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
    if ! run_stage ncu-$method 22 "$OUT/ncu.log" "$NCU" "${ncu_args[@]}" \
        --metrics "$NCU_METRICS" $PY "$WORK/profile_decode.py" "$method" \
        && grep -q "Failed to find metric" "$OUT/ncu.log"; then
      # A metric this ncu does not know: the sections alone (their own metric names).
      run_stage ncu-$method-sections 22 "$OUT/ncu.log" "$NCU" "${ncu_args[@]}" \
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
