"""One quantized linear layer at SmolLM2-135M's shapes, per kernel and batch: torch's int4pack
kernel (the int4pack ``QuantizedLinear``), the gguf op (the gguf ``QuantizedLinear``: int8
activations, AVX512-VNNI), both through the layer's Python ``forward``, and for scale torch's
``_weight_int8pack_mm`` called bare (int8 weights, one scale per output row: not the GGUF
format, and without a layer's Python around it).

Shapes (out, in): the attention's query and output projections 576 x 576, its key and value
projections 192 x 576, the MLP's gate and up 1536 x 576 and down 576 x 1536 (all Q4_1 in the
GGUF), and the LM head 49152 x 576 (the tied embedding, Q8_0). Inputs are in ``--dtype``:
bfloat16 (the default; the model's dtype on a CPU with AVX512-BF16) or float32 (the model's
dtype elsewhere); each figure is the fastest of ``--repeats`` calls (the machine is shared: the
minimum is the least disturbed).

    python benchmarks/bench_gguf_linear.py --json docs/results/bench_gguf_linear.json
    python benchmarks/bench_gguf_linear.py --dtype float32 --json bench_gguf_linear_fp32.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from paged_attention.ops.cpu_info import cpu_identity

SHAPES = {
    "q_proj, o_proj": ("Q4_1", 576, 576),
    "k_proj, v_proj": ("Q4_1", 192, 576),
    "gate_proj, up_proj": ("Q4_1", 1536, 576),
    "down_proj": ("Q4_1", 576, 1536),
    "lm_head": ("Q8_0", 49152, 576),
}
BATCHES = (1, 2, 4, 8, 32)


def fastest_us(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times) * 1e6


def measure(repeats: int, dtype_name: str = "bfloat16") -> list[dict]:
    import torch
    from gguf import GGMLQuantizationType, quants

    from paged_attention.modeling.quantized import QuantizedLinear

    rows = []
    for name, (fmt, out, inp) in SHAPES.items():
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(out, inp, generator=generator) * 0.05
        blocks = quants.quantize(weight.numpy(), GGMLQuantizationType[fmt])
        layers = {
            kernel: QuantizedLinear.from_blocks(blocks, fmt, (out, inp), kernel=kernel)
            for kernel in ("int4pack", "gguf")
        }
        int8 = torch.randint(-127, 128, (out, inp), dtype=torch.int8, generator=generator)
        int8_scales = torch.rand(out, generator=generator).to(getattr(torch, dtype_name))
        count = max(3, repeats // 20) if out > 10000 else repeats
        for batch in BATCHES:
            x = torch.randn(batch, inp, generator=generator).to(getattr(torch, dtype_name))
            row = {"layer": name, "format": fmt, "out": out, "in": inp, "batch": batch}
            for kernel, layer in layers.items():
                row[f"{kernel}_us"] = fastest_us(lambda layer=layer, x=x: layer(x), count)
            row["int8pack_us"] = fastest_us(
                lambda x=x, w=int8, s=int8_scales: torch.ops.aten._weight_int8pack_mm(x, w, s),
                count,
            )
            row["speedup"] = row["int4pack_us"] / row["gguf_us"]
            rows.append(row)
            print(
                json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()})
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    load_before = Path("/proc/loadavg").read_text().strip()
    rows = measure(args.repeats, args.dtype)
    machine = {
        **cpu_identity(),
        "threads": args.threads,
        "loadavg_before": load_before,
        "loadavg_after": Path("/proc/loadavg").read_text().strip(),
    }
    if args.json:
        from paged_attention.ops.gguf_linear import usable_variants

        variant = usable_variants()[0]
        report = {"dtype": args.dtype, "gguf_variant": variant, "machine": machine, "rows": rows}
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
