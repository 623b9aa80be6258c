"""paged_attention/machine.py: what the benchmarks and the demo record about the machine."""

import torch

from paged_attention import machine


def test_cpu_identity_reads_the_first_processor(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14\n"
        "flags\t\t: fpu avx2 fma avx512f avx512_bf16 sha_ni\n\n"
        "processor\t: 1\nmodel name\t: other\nflags\t\t: amx_tile\n"
    )
    identity = machine.cpu_identity(str(cpuinfo))
    assert identity == dict(
        cpu_model="AMD EPYC 9R14",
        cpu_vendor="AuthenticAMD",
        cpu_isa_flags=["avx2", "fma", "avx512f", "avx512_bf16"],
    )


def test_cpu_identity_without_cpuinfo(tmp_path):
    identity = machine.cpu_identity(str(tmp_path / "missing"))
    assert identity["cpu_model"] and identity["cpu_isa_flags"] == []


def test_machine_info_names_the_cpu_its_features_and_the_kernel_variants():
    info = machine.machine_info("cpu")
    assert info["threads"] == torch.get_num_threads() and info["cores"] >= 1
    assert len(info["load_average"]) == 3 and info["torch"] == torch.__version__
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    variants = info["kernel_variants"]
    assert variants["vector"] in ("avx512", "avx2", "default")
    assert variants["bf16_matmuls_usable"][-1] == "reference"
    assert "gpu" not in info
    line = machine.describe_machine(info)
    assert info["cpu_model"] in line and f"{info['threads']} threads" in line
