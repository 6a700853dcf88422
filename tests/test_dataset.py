"""Explaining whole datasets: torchrun with two processes, and an interrupted run resumed."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")
from relprop import composites as relprop_composites  # noqa: E402
from relprop.workflows.dataset import load_shard, read_index  # noqa: E402

TESTS = Path(__file__).parent
JOB = TESTS / "dataset_job.py"


def environment() -> dict[str, str]:
    """This environment, with the tests folder (for dataset_job.py) in front of the PYTHONPATH already set."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1"}


def run(*command, timeout=1800, seed=None):
    env = environment() if seed is None else {**environment(), "PYTHONHASHSEED": seed}
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
    env = environment()
    process = subprocess.Popen([sys.executable, str(JOB), str(tmp_path), "0.25"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 1800  # a hang guard: a loaded machine may take minutes
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


# --- runs that cannot mix: the fingerprint in run.json -------------------------------------------------------

from relprop.workflows.dataset import RunMismatch, explain_dataset  # noqa: E402


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(3 * 4 * 4, 4)).eval()


def tiny_data(size: int = 10) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.rand(size, 1, 6, 6, generator=generator), torch.arange(size) % 4)


class Files(torch.utils.data.Dataset):
    """A folder dataset as the CLI's: the sorted files of a folder, identified by their paths."""

    def __init__(self, folder: Path):
        self.paths = sorted(str(path) for path in folder.glob("*.pt"))

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.load(self.paths[index])


def explain(out, model=None, dataset=None, **settings):
    settings = {"composite": "epsilon-plus", "batch_size": 3, "shard_size": 4, "progress": False, **settings}
    return explain_dataset(model if model is not None else tiny_model(), dataset if dataset is not None else
                           tiny_data(), out, **settings)


@pytest.mark.parametrize("change, named", [
    ({"model": tiny_model(seed=1)}, "the model"),
    ({"composite": "epsilon-plus-flat"}, "the composite"),
    ({"composite": relprop_composites.EpsilonPlus(epsilon=0.1)}, "the composite"),
    ({"target": "label"}, "the target mode"),
    ({"dataset": tiny_data(11)}, "the list of samples"),
    ({"shard_size": 5}, "the shard size"),
    ({"reduce": lambda r: r.sum(1)}, "the reduce function"),
], ids=["weights", "preset", "epsilon", "target", "samples", "shard-size", "reduce"])
def test_resuming_a_different_run_is_refused_naming_what_differs(tmp_path, change, named):
    explain(tmp_path)
    before = {path.name: path.stat().st_mtime_ns for path in tmp_path.iterdir()}
    with pytest.raises(RunMismatch, match=f"holds a different run: {named}") as caught:
        explain(tmp_path, **change)
    assert "\n" not in str(caught.value) and "overwrite=True" in str(caught.value)
    assert {path.name: path.stat().st_mtime_ns for path in tmp_path.iterdir()} == before  # nothing touched


def test_a_file_added_to_the_folder_is_refused(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    generator = torch.Generator().manual_seed(0)
    for name in ("b", "d", "f"):
        torch.save(torch.rand(1, 6, 6, generator=generator), images / f"{name}.pt")
    explain(tmp_path / "out", dataset=Files(images))
    torch.save(torch.rand(1, 6, 6, generator=generator), images / "a.pt")  # shifts every later sample id
    with pytest.raises(RunMismatch, match=r"the list of samples \(was 3 samples, paths .*, now 4 samples"):
        explain(tmp_path / "out", dataset=Files(images))


def test_a_changed_file_is_refused_through_sample_ids(tmp_path):
    explain(tmp_path, sample_ids=[f"img{i}.png" for i in range(10)])
    with pytest.raises(RunMismatch, match="the list of samples"):
        explain(tmp_path, sample_ids=[f"img{i}.png" for i in range(9)] + ["other.png"])
    with pytest.raises(ValueError, match="sample_ids has 3 entries for a dataset of 10 samples"):
        explain(tmp_path, sample_ids=["a", "b", "c"])


def test_overwrite_starts_afresh(tmp_path):
    explain(tmp_path / "fresh", model=tiny_model(seed=1), shard_size=3)
    explain(tmp_path / "reused")  # 3 shards of 4
    (tmp_path / "reused" / ".shard-000009.safetensors.123.tmp").write_bytes(b"half")  # left by a crash
    (tmp_path / "reused" / "notes.txt").write_text("mine")
    explain(tmp_path / "reused", model=tiny_model(seed=1), shard_size=3, overwrite=True)  # 4 shards of 3
    assert sorted(path.name for path in (tmp_path / "reused").iterdir()) == sorted(
        [path.name for path in (tmp_path / "fresh").iterdir()] + ["notes.txt"])
    assert samples(tmp_path / "reused").keys() == samples(tmp_path / "fresh").keys()
    for sample_id, (target, prediction, relevance) in samples(tmp_path / "fresh").items():
        assert samples(tmp_path / "reused")[sample_id][:2] == (target, prediction)
        assert torch.equal(samples(tmp_path / "reused")[sample_id][2], relevance)


def test_shards_without_a_run_record_are_refused(tmp_path):
    explain(tmp_path)
    (tmp_path / "run.json").unlink()
    with pytest.raises(RunMismatch, match="holds shards but no run.json"):
        explain(tmp_path)


def test_resume_skips_finished_shards_says_so_and_gives_the_same_result(tmp_path, capsys):
    explain(tmp_path)
    whole = samples(tmp_path)
    (tmp_path / "shard-000001.safetensors").unlink()
    (tmp_path / "index.jsonl").unlink()
    explain(tmp_path, progress=True)
    assert "2 of 3 shards already done, skipped" in capsys.readouterr().err
    resumed = samples(tmp_path)
    assert resumed.keys() == whole.keys()
    assert all(resumed[i][:2] == whole[i][:2] and torch.equal(resumed[i][2], whole[i][2]) for i in whole)


def test_labels_are_targets_only_when_asked(tmp_path):
    dataset = tiny_data()
    with torch.no_grad():
        prediction = tiny_model()(dataset.tensors[0]).argmax(1).tolist()
    explain(tmp_path / "prediction")
    explain(tmp_path / "label", target="label")
    assert [line["target"] for line in read_index(tmp_path / "prediction")] == prediction
    assert [line["target"] for line in read_index(tmp_path / "label")] == dataset.tensors[1].tolist()
    assert prediction != dataset.tensors[1].tolist()  # else the test could not tell the two apart
    with pytest.raises(ValueError, match="target='label' needs a dataset of \\(input, label\\) items"):
        explain(tmp_path / "bare", dataset=[x for x, _ in dataset], target="label")
    with pytest.raises(ValueError, match="target must be 'prediction', 'label' or a class index"):
        explain(tmp_path / "bad", target="labels")


def channel_sums(relevance: torch.Tensor) -> torch.Tensor:
    return relevance.sum(1)


def fingerprints() -> str:
    """The fingerprints of a run with every preset (but the one that needs bounds), as JSON."""
    from relprop.workflows.dataset import fingerprint

    return json.dumps([fingerprint(tiny_model(), tiny_data(), name, "label", reduce=channel_sums)
                       for name in relprop_composites.PRESETS if name != "epsilon-gamma-box"])


@pytest.mark.slow
def test_the_fingerprint_is_the_same_in_another_process():
    """No memory address, hash seed or object identity may enter it, else every resume would be refused."""
    other = run(sys.executable, "-c", "import test_dataset; print(test_dataset.fingerprints())", seed="12345")
    assert other.returncode == 0, other.stderr
    assert other.stdout.strip() == fingerprints() and len(other.stdout) > 1000
