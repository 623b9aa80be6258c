"""paged_attention/cli/machine.py: what the benchmarks and the demo record about the machine."""

import pytest
import torch

from paged_attention.cli import machine


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


def test_every_reader_reads_every_byte_of_the_buffer():
    """A value written at the end of the buffer changes every reader's result: none stops early."""
    buffer = torch.zeros(3 * machine.ROW_BYTES, dtype=torch.uint8)
    buffer.view(torch.float32)[-1] = 2.0
    results = {name: make(buffer)() for name, make in machine.STREAM_READERS.items()}
    assert results["sum"].item() == 2.0
    assert results["amax"].item() == torch.tensor(2.0).view(torch.int32).item()
    assert results["gemv"].tolist() == [0.0, 0.0, 2.0]


def test_the_read_limit_is_the_fastest_reader_with_all_threads():
    limit = machine.measure_read_limit(5 * machine.ROW_BYTES + 100, reps=3)
    assert limit.buffer_bytes == 5 * machine.ROW_BYTES  # whole rows
    assert set(limit.rates) == set(machine.STREAM_READERS)
    assert limit.bytes_per_s == max(limit.rates.values()) == limit.rates[limit.reader]
    assert limit.threads == torch.get_num_threads()
    assert limit.seconds(2 * limit.buffer_bytes) == 2 * limit.buffer_bytes / limit.bytes_per_s
    assert machine.ReadLimit(**limit.as_dict()) == limit


def test_a_cpu_sample_is_one_call_timed_by_the_wall_clock(monkeypatch):
    clock = iter([10.0, 10.25])
    monkeypatch.setattr(machine.time, "perf_counter", lambda: next(clock))
    calls = []
    assert machine.seconds_per_call(lambda: calls.append(1), torch.device("cpu")) == 0.25
    assert calls == [1] and machine.calls_per_sample(torch.device("cpu")) == 1
    assert machine.calls_per_sample(torch.device("cuda")) == machine.CUDA_CALLS_PER_SAMPLE


def test_the_best_call_time_is_the_fastest_sample_within_the_budget(monkeypatch):
    """One warm-up call, then samples until at least 3 are taken and the budget is spent."""
    samples = iter([3.0, 1.0, 2.0, 0.5, 0.1])
    taken = []

    def fake_sample(fn, device):
        taken.append(fn)
        return next(samples)

    monkeypatch.setattr(machine, "seconds_per_call", fake_sample)
    calls = []
    best = machine.best_call_seconds(lambda: calls.append(1), "cpu", reps=5, budget_s=2.0)
    assert best == 1.0 and len(taken) == 3 and calls == [1]  # 6 s spent after 3 samples
    samples = iter([0.2, 0.1, 0.3, 0.05, 0.4])
    assert machine.best_call_seconds(lambda: None, "cpu", reps=5, budget_s=2.0) == 0.05


def test_the_faster_of_two_read_limits():
    slow = machine.ReadLimit(1e9, "sum", 4096, 2, {"sum": 1e9})
    fast = machine.ReadLimit(2e9, "gemv", 4096, 2, {"gemv": 2e9})
    assert slow.faster(fast) is fast and fast.faster(slow) is fast and slow.faster(None) is slow


def test_the_read_limit_refuses_bad_arguments():
    with pytest.raises(ValueError, match="nbytes must be a positive int"):
        machine.measure_read_limit(0)
    with pytest.raises(ValueError, match="reps must be a positive int"):
        machine.measure_read_limit(4096, reps=0)
    with pytest.raises(ValueError, match="allocate must return 4096 uint8 elements"):
        machine.measure_read_limit(4096, allocate=lambda n, device: torch.empty(n // 4))


def test_the_memory_buffer_is_many_times_the_last_level_cache(tmp_path, monkeypatch):
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "260M")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert machine.last_level_cache_bytes("cpu", str(tmp_path)) == 260 << 20
    assert machine.last_level_cache_bytes("cpu", str(tmp_path / "missing")) == 0
    monkeypatch.setattr(machine, "last_level_cache_bytes", lambda device="cpu": 260 << 20)
    assert machine.memory_buffer_bytes() == 4 * (260 << 20)
    monkeypatch.setattr(machine, "last_level_cache_bytes", lambda device="cpu": 0)
    assert machine.memory_buffer_bytes() == 1 << 30
