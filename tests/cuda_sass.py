"""The machine code (SASS) of the CUDA attention kernels, read without a GPU, for the tests.

``cuobjdump`` (shipped in triton's wheel, or the CUDA toolkit's) lists every kernel of the built
extension (paged_attention/_C*.so) or of a cubin with its instructions and its resources
(registers, stack frame, local memory). ``compile_cubins(arch)`` compiles the three attention
translation units (csrc/cuda/attention_<dtype>.cu, which include no torch header) to cubins of
one architecture with nvcc, into ``build/sass/<hash of the sources and flags>/sm_<arch>/``, so
that the gates cover architectures the extension was not built for. ``main_loop`` finds the loop
over KV tiles of an attention kernel in its control-flow graph.

As a script it prints every attention kernel's registers, stack frame and main loop size (`loop`:
every instruction of the loop; `tile`: one iteration along its common path, see main_loop):

    python tests/cuda_sass.py [--arch 80 86 89 90] [--extension] [--jobs N]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
UNITS = ("float", "half", "bfloat16")
# The device flags of setup.py's nvcc command that shape the machine code.
NVCC_FLAGS = ("-O3", "-std=c++20", "--expt-relaxed-constexpr")


def find_tool(name: str) -> str | None:
    """A CUDA binary tool: triton's wheel, CUDA_HOME/bin, /usr/local/cuda/bin or PATH."""
    candidates = []
    spec = importlib.util.find_spec("triton")
    if spec and spec.origin:
        candidates.append(Path(spec.origin).parent / "backends" / "nvidia" / "bin" / name)
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            candidates.append(Path(home) / "bin" / name)
    found = shutil.which(name)
    if found:
        candidates.append(Path(found))
    return next((str(c) for c in candidates if c.exists()), None)


@dataclasses.dataclass
class Instruction:
    address: int
    guard: str  # the predicate, e.g. "@!P0", or ""
    opcode: str  # with its modifiers, e.g. "HMMA.16816.F32"
    operands: str


@dataclasses.dataclass
class Kernel:
    name: str  # demangled
    instructions: list[Instruction] = dataclasses.field(default_factory=list)
    registers: int = -1
    stack: int = -1
    local: int = -1

    @property
    def opcodes(self) -> list[str]:
        return [i.opcode for i in self.instructions]

    def count(self, prefix: str, instructions: list[Instruction] | None = None) -> int:
        chosen = self.instructions if instructions is None else instructions
        return sum(i.opcode.startswith(prefix) for i in chosen)


INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def _demangle(names: list[str]) -> list[str]:
    cxxfilt = shutil.which("c++filt")
    if cxxfilt is None:
        raise RuntimeError("c++filt is not installed")
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True)
    return out.stdout.splitlines()


def read_kernels(binary: str | Path) -> dict[str, dict[str, Kernel]]:
    """Every kernel of an ELF file with CUDA machine code (the extension or a cubin): per
    architecture ("90" for sm_90), by demangled name; empty when it holds none."""
    tool = find_tool("cuobjdump")
    if tool is None:
        raise RuntimeError("no cuobjdump (triton's wheel, CUDA_HOME/bin, PATH)")
    sass = subprocess.run([tool, "-sass", str(binary)], capture_output=True, text=True).stdout
    usage = subprocess.run([tool, "-res-usage", str(binary)], capture_output=True, text=True)
    found: dict[str, dict[str, Kernel]] = {}
    arch, current = None, None
    for line in sass.splitlines():
        code = re.match(r"\s*code for sm_(\d+)", line)
        if code:
            arch = code.group(1)
            continue
        header = re.match(r"\s*Function : (\S+)", line)
        if header and arch is not None:
            kernels = found.setdefault(arch, {})
            current = kernels.setdefault(header.group(1), Kernel(header.group(1)))
            continue
        match = INSTRUCTION.match(line)
        if match and current is not None:
            address, guard, opcode, operands = match.groups()
            current.instructions.append(
                Instruction(int(address, 16), (guard or "").strip(), opcode, operands.strip())
            )
    # -res-usage names the architecture of each ELF of a fatbin (not of a lone cubin).
    arch = next(iter(found)) if len(found) == 1 else None
    name = None
    for line in usage.stdout.splitlines():
        elf = re.search(r"arch = sm_(\d+)", line)
        if elf:
            arch = elf.group(1)
            continue
        header = re.search(r"Function (\S+):", line)
        if header:
            name = header.group(1)
            continue
        resources = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", line)
        if resources and name in found.get(arch, {}):
            kernel = found[arch][name]
            kernel.registers, kernel.stack, kernel.local = map(int, resources.groups())
    for arch, kernels in found.items():
        readable = _demangle(list(kernels))
        for pretty, kernel in zip(readable, kernels.values()):
            kernel.name = pretty
        found[arch] = {kernel.name: kernel for kernel in kernels.values()}
    return found


def attention_variants(kernels: dict[str, Kernel], family: str) -> dict[tuple, Kernel]:
    """(query dtype, cache, bucket, warps of rows, ring stages) -> kernel, for
    mma_attention_kernel ("mma") or cuda_core_attention_kernel ("core", one warp of rows)."""
    caches = {0: "auto", 1: "fp8_e4m3", 2: "fp8_e5m2"}
    found = {}
    for name, kernel in kernels.items():
        mma = re.search(
            r"mma_attention_kernel<paged_attention::cuda::(\w+), \(paged_attention::"
            r"CacheDtype\)(\d), (\d+), (\d+), (\d+)>",
            name,
        )
        core = re.search(
            r"cuda_core_attention_kernel<\(paged_attention::CacheDtype\)(\d), (\d+), (\d+)>", name
        )
        if family == "mma" and mma:
            query, cache, bucket, warps, stages = mma.groups()
            found[(query, caches[int(cache)], int(bucket), int(warps), int(stages))] = kernel
        if family == "core" and core:
            cache, bucket, stages = core.groups()
            found[("Float32", caches[int(cache)], int(bucket), 1, int(stages))] = kernel
    return found


# ---- control flow -------------------------------------------------------------------------

ENDS_BLOCK = ("BRA", "BRX", "EXIT", "RET", "JMP", "JMX", "BREAK", "KILL")


def _branch_target(instruction: Instruction) -> int | None:
    if instruction.opcode.split(".")[0] not in ("BRA", "JMP"):
        return None
    target = re.search(r"0x([0-9a-f]+)\s*$", instruction.operands)
    return int(target.group(1), 16) if target else None


@dataclasses.dataclass
class Loop:
    body: list[Instruction]  # every instruction of the loop, all paths
    tile: list[Instruction]  # one iteration along its common path (see main_loop)


def _blocks(code: list[Instruction]) -> tuple[list[int], dict[int, set[int]]]:
    """The basic blocks of a kernel (their first instruction indices) and their successors."""
    index = {ins.address: i for i, ins in enumerate(code)}
    leaders = {0}
    for i, ins in enumerate(code):
        target = _branch_target(ins)
        if target is not None and target in index:
            leaders.add(index[target])
        if ins.opcode.split(".")[0] in ENDS_BLOCK and i + 1 < len(code):
            leaders.add(i + 1)
    starts = sorted(leaders)
    block_of = {start: b for b, start in enumerate(starts)}
    successors: dict[int, set[int]] = {b: set() for b in range(len(starts))}
    for b in range(len(starts)):
        last = (starts[b + 1] if b + 1 < len(starts) else len(code)) - 1
        ins = code[last]
        target = _branch_target(ins)
        if target is not None and target in index:
            successors[b].add(block_of[index[target]])
        # A guard, or a condition operand before the target (BRA.DIV UR5, 0x...), makes a
        # branch conditional.
        falls_through = (
            ins.opcode.split(".")[0] not in ENDS_BLOCK or ins.guard != "" or "," in ins.operands
        )
        if falls_through and last + 1 < len(code):
            successors[b].add(b + 1)
    return starts, successors


def _dominators(successors: dict[int, set[int]]) -> list[int]:
    """Per block, the set of blocks that dominate it (bit b for block b), from block 0."""
    count = len(successors)
    predecessors: dict[int, set[int]] = {b: set() for b in successors}
    for b, after in successors.items():
        for s in after:
            predecessors[s].add(b)
    everything = (1 << count) - 1
    dominators = [everything] * count
    dominators[0] = 1
    changed = True
    while changed:
        changed = False
        for b in range(1, count):
            meet = everything
            for p in predecessors[b]:
                meet &= dominators[p]
            new = (meet if predecessors[b] else 0) | (1 << b)
            if new != dominators[b]:
                dominators[b], changed = new, True
    return dominators


def main_loop(kernel: Kernel, marker: str) -> Loop:
    """The kernel's main loop: the natural loop of its control-flow graph that holds the most
    instructions starting with `marker` (HMMA for the tensor-core kernel, FFMA for the CUDA-core
    one), the largest of them on a tie. `tile` is one iteration along the path with the most
    `marker` instructions, then the most asynchronous copies (LDGSTS), then the fewest
    instructions: a tile whose copies are issued, for a head size equal to its bucket, without
    masks, rescaling or logit options."""
    code = kernel.instructions
    starts, successors = _blocks(code)

    def span(b: int) -> range:
        return range(starts[b], starts[b + 1] if b + 1 < len(starts) else len(code))

    predecessors: dict[int, set[int]] = {b: set() for b in successors}
    for b, after in successors.items():
        for s in after:
            predecessors[s].add(b)
    dominators = _dominators(successors)
    back_edges = {
        (u, h) for u, after in successors.items() for h in after if dominators[u] >> h & 1
    }
    loops: dict[int, set[int]] = {}  # header -> body (the back edges of one header merged)
    for source, header in back_edges:
        body, work = loops.setdefault(header, {header}), [source]
        body.add(source)
        while work:
            b = work.pop()
            if b == header:
                continue
            for pred in predecessors[b]:
                if pred not in body:
                    body.add(pred)
                    work.append(pred)
    if not loops:
        return Loop([], [])

    def weight(blocks) -> tuple[int, int]:
        chosen = [code[i] for b in blocks for i in span(b)]
        return sum(i.opcode.startswith(marker) for i in chosen), len(chosen)

    header, body = max(loops.items(), key=lambda item: weight(item[1]))
    # The common path: the body without back edges is acyclic; the best-scoring path from the
    # header to a block that jumps back to it, scored lexicographically.
    forward = {
        b: {s for s in successors[b] if s in body and (b, s) not in back_edges} for b in body
    }
    incoming = {b: 0 for b in body}
    for b in body:
        for s in forward[b]:
            incoming[s] += 1
    order, ready = [], [header]
    while ready:
        b = ready.pop()
        order.append(b)
        for s in forward[b]:
            incoming[s] -= 1
            if incoming[s] == 0:
                ready.append(s)
    best: dict[int, tuple[tuple[int, int, int], list[int]]] = {}
    for b in order:
        ins = [code[i] for i in span(b)]
        score = (
            sum(i.opcode.startswith(marker) for i in ins),
            sum(i.opcode.startswith("LDGSTS") for i in ins),
            -len(ins),
        )
        if b == header:
            best[b] = (score, [b])
        else:
            reachable = [best[p] for p in predecessors[b] if p in best and b in forward[p]]
            (a, c, n), path = max(reachable, key=lambda item: item[0])
            best[b] = ((a + score[0], c + score[1], n + score[2]), path + [b])
    latches = [best[u] for u, h in back_edges if h == header and u in best]
    tile = max(latches, key=lambda item: item[0])[1] if latches else []
    return Loop(
        [code[i] for b in sorted(body) for i in span(b)], [code[i] for b in tile for i in span(b)]
    )


def local_frame(kernel: Kernel) -> list[Instruction]:
    """Instructions that set up or use a stack frame in local memory: writes to the stack
    pointer R1 other than its load at entry, and addresses based on it. A kernel whose
    parameters were copied to local memory (or that spills) has some, whether the copy goes
    through LDL/STL or through generic loads and stores of a local address."""
    found = []
    for ins in kernel.instructions:
        # The entry's load of the stack pointer: LDC, MOV or IMAD.MOV of c[0x0][0x28].
        writes_r1 = re.match(r"R1\b", ins.operands) and not re.fullmatch(
            r"R1, (RZ, RZ, )?c\[0x0\]\[0x28\]", ins.operands
        )
        if writes_r1 or re.search(r"\[R1\b", ins.operands) or ins.opcode.startswith(("LDL", "STL")):
            found.append(ins)
    return found


# ---- cubins per architecture ----------------------------------------------------------------


def _sources() -> list[Path]:
    files = [CSRC / "cache_dtype.h", CSRC / "cuda" / "attention_kernels.cuh"]
    files += [CSRC / "cuda" / "launchers.h"]
    for directory in ("attention", "primitives"):
        files += sorted((CSRC / "cuda" / directory).iterdir())
    files += [CSRC / "cuda" / f"attention_{unit}.cu" for unit in UNITS]
    return files


def nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME")
    candidates = [Path(home) / "bin" / "nvcc"] if home else []
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    found = shutil.which("nvcc")
    if found:
        candidates.append(Path(found))
    return next((str(c) for c in candidates if c.exists()), None)


def compile_cubins(arch: str, jobs: int = 2) -> list[Path]:
    """The attention translation units compiled to cubins for sm_<arch> (cached)."""
    return compile_all([arch], jobs)[arch]


def compile_all(archs: list[str], jobs: int) -> dict[str, list[Path]]:
    """compile_cubins for several architectures, `jobs` nvcc processes at a time."""
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError("nvcc not found (CUDA_HOME, /usr/local/cuda, PATH)")
    digest = hashlib.sha256(" ".join([compiler, *NVCC_FLAGS]).encode())
    for path in _sources():
        digest.update(path.name.encode() + path.read_bytes())
    root = ROOT / "build" / "sass" / digest.hexdigest()[:16]

    def build(arch: str, unit: str) -> Path:
        out_dir = root / f"sm_{arch}"
        out_dir.mkdir(parents=True, exist_ok=True)
        cubin = out_dir / f"attention_{unit}.cubin"
        if not cubin.exists():
            tmp = out_dir / f"attention_{unit}.{os.getpid()}.tmp"
            cmd = [compiler, "-cubin", f"-arch=sm_{arch}", *NVCC_FLAGS, f"-I{CSRC}"]
            cmd += [str(CSRC / "cuda" / f"attention_{unit}.cu"), "-o", str(tmp)]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"nvcc failed for sm_{arch} {unit}:\n{result.stderr}")
            tmp.rename(cubin)
        return cubin

    pairs = [(arch, unit) for arch in archs for unit in UNITS]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        cubins = list(pool.map(lambda pair: build(*pair), pairs))
    return {arch: [c for (a, _), c in zip(pairs, cubins) if a == arch] for arch in archs}


def cubin_kernels(arch: str) -> dict[str, Kernel]:
    """The attention kernels of sm_<arch>, compiled from the sources (compile_cubins)."""
    kernels: dict[str, Kernel] = {}
    for cubin in compile_cubins(arch):
        kernels.update(read_kernels(cubin).get(arch, {}))
    return kernels


def extension_path() -> str | None:
    spec = importlib.util.find_spec("paged_attention._C")
    return spec.origin if spec else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="*", default=[], help="compile cubins for sm_<arch>")
    parser.add_argument("--extension", action="store_true", help="read the built extension")
    parser.add_argument("--jobs", type=int, default=2, help="nvcc processes at a time")
    args = parser.parse_args()
    compile_all(args.arch, args.jobs)
    sources = [(f"sm_{arch}", cubin_kernels(arch)) for arch in args.arch]
    if args.extension or not args.arch:
        for arch, kernels in read_kernels(extension_path()).items():
            sources.append((f"ext sm_{arch}", kernels))
    print(
        f"{'where':11} {'kernel':40} {'regs':>4} {'stack':>5} {'loop':>5} {'tile':>5} "
        f"{'mma':>4} {'ldsm':>4}"
    )
    for where, kernels in sources:
        for family, marker in (("mma", "HMMA"), ("core", "FFMA")):
            for key, kernel in sorted(attention_variants(kernels, family).items()):
                loop = main_loop(kernel, marker)
                print(
                    f"{where:11} {' '.join(map(str, key)):40} {kernel.registers:4} "
                    f"{kernel.stack:5} {len(loop.body):5} {len(loop.tile):5} "
                    f"{kernel.count('HMMA', loop.tile):4} {kernel.count('LDSM', loop.tile):4}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
