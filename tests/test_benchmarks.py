"""The benchmark script (benchmarks/bench.py): its allocation count, and one small run end to end."""
import os
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


def test_the_per_op_model_calls_three_ops_a_block_and_relprop_costs_more_than_a_gradient():
    ops, times = bench.per_op(rounds=1, device="cpu", dtype=torch.float32, blocks=20)
    assert ops == 3 * 20  # linear, relu and + in every block
    assert set(times) == {"gradient", "relprop epsilon"} and min(times.values()) > 0


def test_the_profile_finds_every_part_of_the_work_per_op_within_the_attribution():
    total, shares = bench.profile_parts(runs=2, device="cpu", dtype=torch.float32, blocks=20)
    assert total > 0 and set(shares) == set(bench.parts())
    assert all(0 < share < 1 for share in shares.values())  # each part ran, inside the attributions profiled
    interception = shares["interception, forward pass (`Session.__torch_function__`)"]
    assert shares["op records (`OpCall.__init__`)"] < interception  # op records are made inside the interception


def test_references_whose_package_is_missing_are_left_out(monkeypatch, capsys):
    monkeypatch.setitem(bench.REFERENCE_PACKAGES, "zennit", "relprop_no_such_package")
    assert bench.installed(["zennit", "captum", "guard"]) == ["captum", "guard"]
    assert "relprop_no_such_package is not installed" in capsys.readouterr().err


def test_transformer_sizes_come_from_hidden_and_layers():
    model, target = bench.build_transformer("llama", hidden=128, layers=3)
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (128, 3, 2)
    assert config.num_key_value_heads == 2 and target == (-1, 42)
    with pytest.raises(SystemExit, match="unknown transformer 'gpt'"):
        bench.build_transformer("gpt")


def test_lxt_patches_come_off_after_each_run_also_on_an_error():
    import lxt_child

    class Base:
        def forward(self):
            return "base"

    class Child(Base):
        pass

    table = {"sdpa": "original"}
    changes = [(Child, "forward", lambda self: "patched"), (table, "sdpa", "wrapped")]
    with lxt_child.patched(changes):
        assert Child().forward() == "patched" and table["sdpa"] == "wrapped"
    assert Child().forward() == "base" and "forward" not in Child.__dict__ and table == {"sdpa": "original"}
    with pytest.raises(ZeroDivisionError), lxt_child.patched(changes):
        1 / 0
    assert Child().forward() == "base" and table == {"sdpa": "original"}


def test_the_gradient_loop_writes_each_samples_input_gradient_in_shards(tmp_path):
    import dataset_throughput
    from relprop import output_relevance
    from relprop.workflows import mnist as demo
    from relprop.workflows.dataset import load_shard

    torch.manual_seed(0)
    model = demo.SmallCNN().eval()
    images = torch.rand(10, 1, 28, 28)
    dataset = torch.utils.data.TensorDataset(images, torch.zeros(10, dtype=torch.long))
    dataset_throughput.gradient_loop(model, dataset, str(tmp_path), batch_size=4, shard_size=8)
    shards = [load_shard(tmp_path / name) for name in ("shard-000000.safetensors", "shard-000001.safetensors")]
    stored = torch.cat([shard["relevance"] for shard in shards])
    assert torch.cat([shard["ids"] for shard in shards]).tolist() == list(range(10))
    x = images.clone().requires_grad_()
    logits = model(x)
    (expected,) = torch.autograd.grad(logits, x, output_relevance(logits, logits.argmax(1).tolist()))
    torch.testing.assert_close(stored, expected)


@pytest.mark.slow
def test_a_small_dataset_run_prints_both_throughputs(tmp_path):
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "dataset_throughput.py"), str(tmp_path), "--case", "resnet18", "--size",
         "32", "--batch", "4", "--samples", "8", "--rounds", "1", "--device", "cpu"],
        capture_output=True, text=True, check=True).stdout
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in out.splitlines() if line.startswith("| ")}
    assert rows["gradient loop"][2].strip() == "1.00"
    seconds, per_second, ratio = (float(cell) for cell in rows["explain_dataset (epsilon-plus-flat)"])
    assert seconds > 0 and per_second > 0 and ratio > 0


@pytest.mark.slow
def test_the_gpu_script_runs_every_step_on_the_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "DEVICE": "cpu", "SMOKE": "1", "PYTHON": sys.executable}
    subprocess.run(["bash", str(BENCHMARKS / "gpu.sh")], check=True, env=env, cwd=BENCHMARKS.parent,
                   capture_output=True)
    status = (tmp_path / "status.txt").read_text()
    assert status.count(": exit 0 after") == 7, status
    assert "| relprop epsilon |" in (tmp_path / "bench-bfloat16.log").read_text()
    for dtype in ("float32", "bfloat16"):
        assert "| Llama h64, 2 layers, 16 tokens, AttnLRP | eager forward+backward |" in (
            tmp_path / f"compiled-{dtype}.log").read_text()
    assert not (tmp_path / "scratch").exists()


def test_the_profile_prints_the_costliest_ops_of_each_run(capsys):
    import dataset_throughput

    x = torch.rand(64, 64)
    dataset_throughput.profile({"matmul": lambda: x @ x, "sum": lambda: x.sum()}, rows=1)
    out = capsys.readouterr().out
    assert out.count("| op | input shapes | calls per batch | self CPU (ms) |") == 2
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| aten::")]
    assert [row[0].strip() for row in rows] == ["aten::mm", "aten::sum"]
    assert [row[1].strip() for row in rows] == ["[64, 64], [64, 64]", "[64, 64]"]
    assert [float(row[2]) for row in rows] == [1.0, 1.0]  # one call per run, averaged over five


class _ConvolutionWeights(torch.utils._python_dispatch.TorchDispatchMode):
    """Inside the block, a copy of the weight of each convolution run (W+ is written into one buffer, layer by
    layer, so the copy is taken as it runs)."""

    def __init__(self):
        super().__init__()
        self.weights = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution.default:
            self.weights.append(args[1].clone())
        return func(*args, **(kwargs or {}))


def test_the_z_plus_floor_adds_one_convolution_with_w_plus_at_every_convolution_but_the_first():
    model, x, target = bench.setup("resnet18", 1, 32, "cpu")
    runs = bench.zplus_floor(model, x, target)
    convolutions = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    for key in ("gradient", "gradient + conv(x, W+)", "gradient + conv(x, kept W+)"):
        with _ConvolutionWeights() as recorded:
            runs[key][1]()
        weights = recorded.weights
        if key == "gradient":
            assert len(weights) == len(convolutions)
            continue
        # the model's own, then W+ of each convolution after the first
        assert len(weights) == 2 * len(convolutions) - 1
        products = weights[2::2]
        assert all(torch.equal(w, m.weight.clamp(min=0)) for w, m in zip(products, convolutions[1:]))
        assert not any(m._forward_hooks for m in model.modules())  # the hooks came off


def test_the_unchecked_floor_follows_its_plan_unchecked_with_the_checked_relevance(monkeypatch):
    from relprop.engine import plan, session

    runs = bench.unchecked_floor("cpu", torch.float32)
    checked = runs["relprop AttnLRP"][1]()
    counted = {"checks": 0, "interceptions": 0}
    key, intercept = plan._key, session.Session.intercept

    def counting_key(*args):
        counted["checks"] += 1
        return key(*args)

    def counting_intercept(*args):
        counted["interceptions"] += 1
        return intercept(*args)

    monkeypatch.setattr(plan, "_key", counting_key)
    monkeypatch.setattr(session.Session, "intercept", counting_intercept)
    unchecked = runs["relprop AttnLRP, unchecked (not sound)"][1]()
    assert counted == {"checks": 0, "interceptions": 0}  # replayed, every op unchecked
    assert torch.equal(unchecked, checked)
    runs["relprop AttnLRP"][1]()
    assert counted["checks"] > 0  # the checks are back after it


def test_the_decoy_benchmarks_sensitivity_is_the_squared_weight_of_a_linear_model_on_the_mask():
    import decoy_mnist

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3)).double()
    images, labels = torch.rand(4, 1, 3, 4, dtype=torch.float64), torch.tensor([0, 2, 1, 2])
    masks = torch.zeros(4, 1, 3, 4, dtype=torch.float64)
    masks[:, :, :2, :2] = 1
    rows = model[1].weight[labels].detach().reshape(4, 1, 3, 4)  # df_y/dx of a linear model: its row y
    expected = (rows * masks).pow(2).flatten(1).sum(1)
    torch.testing.assert_close(decoy_mnist.sensitivity(model, images, labels, masks), expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("preset", ["epsilon-plus-flat", "epsilon-gamma-box"])
def test_the_floor_with_precomputed_weights_convolves_with_the_floors_modified_weights(preset):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 3, 3)).eval()
    x = torch.rand(1, 2, 7, 7)
    seen = {}
    for precomputed in (False, True):
        floor = bench.compiled_floor(model, preset, precomputed)
        with _ConvolutionWeights() as recorded:
            floor(x)
        seen[precomputed] = recorded.weights
    count = 1 + bench.EXTRA_PRODUCTS[preset][0]  # the layer's own and its extra products (first and later alike)
    assert len(seen[True]) == len(seen[False]) == 2 * count
    assert all(torch.equal(a, b) for a, b in zip(seen[True], seen[False]))
    weight = model[2].weight.detach()
    assert torch.equal(seen[True][count + 1], weight + 0.25 * weight.clamp(min=0))  # the second layer's W + 0.25 W+
