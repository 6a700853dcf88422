"""Explaining whole datasets: torchrun with two processes, and an interrupted run resumed."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")
from relprop.dataset import load_shard, read_index  # noqa: E402

TESTS = Path(__file__).parent
JOB = TESTS / "dataset_job.py"


def run(*command, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(c) for c in command], capture_output=True, text=True, env=env, timeout=timeout)


def samples(out: Path) -> dict[int, tuple]:
    """Every sample's index line and relevance, by sample id."""
    found = {}
    for line in read_index(out):
        relevance = load_shard(out / line["shard"])["relevance"][line["row"]]
        assert line["id"] not in found, "duplicate sample"
        found[line["id"]] = (line["target"], line["prediction"], relevance)
    return found


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    result = run(sys.executable, JOB, out)
    assert result.returncode == 0, result.stderr
    return samples(out)


def test_single_process_covers_every_sample_once(single):
    assert sorted(single) == list(range(45))
    assert all(target == sample_id % 3 for sample_id, (target, _, _) in single.items())


@pytest.mark.parametrize("wrapping", [[], ["--wrap=ddp"], ["--wrap=fsdp"]], ids=["plain", "ddp", "fsdp2"])
def test_torchrun_with_two_processes_equals_one(tmp_path, single, wrapping):
    result = run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", JOB,
                 tmp_path, *wrapping)
    assert result.returncode == 0, result.stderr
    both = samples(tmp_path)
    assert sorted(both) == sorted(single)
    for sample_id, (target, prediction, relevance) in single.items():
        assert both[sample_id][:2] == (target, prediction)
        assert torch.equal(both[sample_id][2], relevance)


def test_killed_run_resumes_without_redoing_or_duplicating(tmp_path, single):
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    process = subprocess.Popen([sys.executable, str(JOB), str(tmp_path), "0.25"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while len(list(tmp_path.glob("shard-*.safetensors"))) < 2 and time.time() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    written = {path.name: path.stat().st_mtime_ns for path in tmp_path.glob("shard-*.safetensors")}
    assert 2 <= len(written) < 6 and not (tmp_path / "index.jsonl").exists()
    for name in written:
        load_shard(tmp_path / name)  # every file under a shard's name is complete
    result = run(sys.executable, JOB, tmp_path)
    assert result.returncode == 0, result.stderr
    assert all((tmp_path / name).stat().st_mtime_ns == mtime for name, mtime in written.items())  # not redone
    resumed = samples(tmp_path)
    assert sorted(resumed) == sorted(single)
    assert all(torch.equal(resumed[i][2], single[i][2]) for i in single)
