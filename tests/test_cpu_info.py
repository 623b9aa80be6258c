"""paged_attention/ops/cpu_info.py: the CPU's model, vendor and ISA flags from /proc/cpuinfo."""

from paged_attention.ops import cpu_info


def test_cpu_identity_reads_the_first_processor(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14\n"
        "flags\t\t: fpu avx2 fma avx512f avx512_bf16 sha_ni\n\n"
        "processor\t: 1\nmodel name\t: other\nflags\t\t: amx_tile\n"
    )
    identity = cpu_info.cpu_identity(str(cpuinfo))
    assert identity == dict(
        cpu_model="AMD EPYC 9R14",
        cpu_vendor="AuthenticAMD",
        cpu_isa_flags=["avx2", "fma", "avx512f", "avx512_bf16"],
    )


def test_cpu_identity_without_cpuinfo(tmp_path):
    identity = cpu_info.cpu_identity(str(tmp_path / "missing"))
    assert identity["cpu_model"] and identity["cpu_isa_flags"] == []


def test_cpu_identity_without_a_vendor_line(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: some core\n")
    assert cpu_info.cpu_identity(str(cpuinfo))["cpu_vendor"] == ""
