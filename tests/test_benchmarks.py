"""The benchmark script (benchmarks/bench.py): its allocation count, and one small run end to end."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench


def test_new_tensors_counts_large_results_and_not_what_an_op_writes_into():
    existing = torch.zeros(2 ** 20)  # 4 MiB
    with bench._NewTensors() as counter:
        torch.ones(3 * 2 ** 18)  # 3 MiB: counted
        torch.ones(1000)  # below 1 MiB: not counted
        existing.add_(1.0)  # written in place: not counted
        torch.mul(existing, 2.0, out=existing)  # an output argument: not counted
        existing.view(-1, 2)  # a view of memory that exists: not counted
        new = torch.ones(2 ** 18)
    assert counter.total == 3 * 2 ** 20 + 2 ** 20
    # counting made no storage object: it would hold the memory, and autograd would then add gradients
    # arriving there out of place
    assert torch._C._storage_Use_Count(torch._C._storage_address(new)) == 1


@pytest.mark.parametrize("options", [[], ["--trim"]], ids=["warm-heap", "trimmed-heap"])
def test_a_small_run_prints_every_method_with_its_ratios(options):
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench.py"), "--models", "resnet18", "--batches", "1", "--size", "32",
         "--rounds", "1", "--transformers", "--with", "--allocations", "--device", "cpu", *options],
        capture_output=True, text=True, check=True).stdout
    assert ("heap trimmed before each timed run" in out.splitlines()[0]) == bool(options)
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in out.splitlines() if line.startswith("| ")}
    methods = ["gradient"] + [f"relprop {preset}" for preset in bench.PRESETS]
    assert set(methods) <= set(rows)
    assert rows["gradient"][1].strip() == "1.00"  # the time ratio of the reference to itself
    for method in methods:
        seconds, ratio, allocated, _ = (cell.strip() for cell in rows[method])
        assert float(seconds) > 0 and float(ratio) > 0 and float(allocated) >= 0
