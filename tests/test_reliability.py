"""Dtypes, threads and long runs."""
import gc
import threading
import weakref

import pytest
import torch
import torchvision

import relprop
from conftest import ResidualNet, randomize_batch_norms


def net(seed=0):
    torch.manual_seed(seed)
    return randomize_batch_norms(ResidualNet()).eval()


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 0.9), (torch.float16, 0.98)])
@pytest.mark.parametrize("preset", ["epsilon", "epsilon-plus-flat", "epsilon-alpha2-beta1"])
def test_half_precision_is_close_to_float32(dtype, tolerance, preset, device):
    model = torchvision.models.resnet18(num_classes=10).eval().to(device)
    x = torch.randn(2, 3, 32, 32, device=device)
    reference = relprop.LRP(model, preset).attribute(x, target=3)
    low = model.to(dtype)
    relevance = relprop.LRP(low, preset).attribute(x.to(dtype), target=3)
    assert relevance.dtype == dtype and torch.isfinite(relevance).all()
    assert cosine(relevance, reference) > tolerance  # documented: cosine similarity to float32 per dtype


@pytest.mark.parametrize("device", DEVICES)
def test_channels_last_and_no_grad_around_the_call(device):
    model, x = net().double().to(device), torch.randn(2, 3, 16, 16, dtype=torch.float64, device=device)
    expected = relprop.LRP(model, "epsilon-plus").attribute(x, target=1)
    channels_last = relprop.LRP(model, "epsilon-plus").attribute(x.to(memory_format=torch.channels_last), target=1)
    torch.testing.assert_close(channels_last, expected, rtol=1e-12, atol=1e-15)
    # cuDNN's convolution backward sums in a run-dependent order, so on a GPU a repeat is equal only to rounding
    if device == "cpu":
        def same(a, b):
            assert torch.equal(a, b)
    else:
        def same(a, b):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    with torch.no_grad():
        same(relprop.LRP(model, "epsilon-plus").attribute(x, target=1), expected)
    with torch.inference_mode():
        inference = relprop.LRP(model, "epsilon-plus").attribute(x, target=1)
    same(inference, expected)


def test_threads_with_two_models_and_with_one_model():
    models = [net(0).double(), net(1).double()]
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    jobs = [(models[0], "epsilon-plus"), (models[1], "epsilon"), (models[0], "epsilon-alpha2-beta1"),
            (models[0], "epsilon")]
    expected = [relprop.LRP(model, preset).attribute(x, target=2) for model, preset in jobs]
    results, start = [None] * len(jobs), threading.Barrier(len(jobs))

    def work(index):
        model, preset = jobs[index]
        start.wait()
        for _ in range(3):
            results[index] = relprop.LRP(model, preset).attribute(x, target=2)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result, reference in zip(results, expected):
        assert torch.equal(result, reference)  # one model in three threads at once, rules never mixed


def _resident_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096 / 2 ** 20


def test_long_runs_keep_memory_flat_and_keep_nothing():
    model, x = net(), torch.randn(2, 3, 16, 16)
    lrp = relprop.LRP(model, "epsilon-plus-flat")
    activations = []
    hooks = [module.register_forward_hook(lambda m, i, out: activations.append(weakref.ref(out)))
             for module in model.modules()]
    lrp.attribute(x, target=1)
    for hook in hooks:
        hook.remove()
    gc.collect()
    assert activations and all(ref() is None for ref in activations)  # nothing of the call outlives it
    for _ in range(20):
        lrp.attribute(x, target=1)
    before = _resident_mib()
    for _ in range(1000):
        lrp.attribute(x, target=1)
    assert _resident_mib() - before < 20


@pytest.mark.parametrize("preset", ["epsilon-plus-flat", "attnlrp"])
def test_an_attribution_makes_no_reference_cycles_and_restores_the_collector(preset):
    model, x = net(), torch.randn(2, 3, 16, 16)
    lrp = relprop.LRP(model, preset)
    lrp.attribute(x, target=1)
    gc.collect()
    enabled = gc.isenabled()
    try:
        gc.disable()  # the collector paused by the user stays paused
        lrp.attribute(x, target=1)
        assert not gc.isenabled()
        assert gc.collect() == 0  # the collector, paused during attributions, has nothing to free after them
        gc.enable()
        with pytest.raises(TypeError, match="positional arguments"):
            lrp.attribute(x, target=1, additional_forward_args=(1, 2, 3))  # the model raises: too many arguments
        assert gc.isenabled()
    finally:
        if not enabled:
            gc.disable()


@pytest.mark.parametrize("preset", ["epsilon", "epsilon-plus", "epsilon-alpha2-beta1", "epsilon-gamma-box"])
def test_activations_are_freed_as_the_relevance_passes(preset):
    # as autograd frees saved tensors: once the relevance reaches the first layer, no later layer's input lives
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(inplace=True), torch.nn.Conv2d(8, 8, 3, padding=1),
        torch.nn.ReLU(inplace=True), torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(512, 4),
    ).eval()
    later_inputs, alive = {}, []
    for index in (4, 6):
        model[index].register_forward_hook(
            lambda module, args, out, index=index: later_inputs.update({index: weakref.ref(args[0].untyped_storage())}))

    def check(relevance):  # runs when the relevance passes the first layer's output
        alive.append([index for index, ref in later_inputs.items() if ref() is not None])
        return relevance

    kwargs = {"low": -3.0, "high": 3.0} if preset == "epsilon-gamma-box" else {}
    layer = relprop.LayerLRP(model, model[0], relprop.composites.get(preset, **kwargs))
    layer._run(torch.randn(2, 3, 8, 8), 1, None, False, reduce=check)
    assert sorted(later_inputs) == [4, 6] and alive == [[]]


@pytest.mark.parametrize("preset", ["epsilon-plus", "epsilon-alpha2-beta1", "epsilon-gamma-box"])
def test_layers_share_one_buffer_for_their_positive_weights(preset, monkeypatch):
    # W+ of every layer goes into one buffer per forward pass: were two of them alive at once (z^B's W+ and W-,
    # AlphaBeta's W- written over W+), the later would overwrite the earlier, and the relevance would change
    model, x = net().double(), torch.randn(2, 3, 16, 16, dtype=torch.float64)
    lrp = relprop.LRP(model, relprop.composites.get(preset, **({"low": -3.0, "high": 3.0} if "box" in preset else {})))
    like, pointers = relprop.engine.Workspace.like, []

    def recorded(workspace, tensor, shape=None):
        buffer = like(workspace, tensor, shape)
        pointers.append(buffer.data_ptr())
        return buffer

    monkeypatch.setattr(relprop.engine.Workspace, "like", recorded)
    shared = lrp.attribute(x, target=1)
    monkeypatch.setattr(relprop.engine.Workspace, "like",
                        lambda workspace, tensor, shape=None: tensor.new_empty(tensor.shape if shape is None else shape))
    fresh = lrp.attribute(x, target=1)
    assert len(pointers) >= 3 and len(set(pointers)) <= 2  # four convolutions; the buffer grows once, at most
    assert torch.equal(shared, fresh)


def test_workspace_grows_without_overwriting_a_tensor_still_in_use():
    workspace = relprop.engine.Workspace()
    small = workspace.like(torch.empty(2)).fill_(1.0)
    large = workspace.like(torch.empty(3, 3)).fill_(2.0)
    assert small.tolist() == [1.0, 1.0] and large.shape == (3, 3)
    assert workspace.like(torch.empty(2, 2)).data_ptr() == large.data_ptr()
    assert workspace.like(torch.empty(2, dtype=torch.float64)).data_ptr() != large.data_ptr()


@pytest.mark.parametrize("preset", ["epsilon", "epsilon-plus", "epsilon-plus-flat", "epsilon-alpha2-beta1",
                                    "epsilon-gamma-box"])
def test_relevances_meeting_at_a_residual_connection_are_added_in_place(preset):
    # autograd adds the relevances arriving at a block's input into the first one if nothing else holds its
    # memory, as it adds gradients; a storage object made by a check (`untyped_storage()`) lives as long as the
    # memory and counts as a holder, and every such sum was a new map (5 on this ResNet18)
    model = torchvision.models.resnet18(num_classes=10).eval()
    kwargs = {"low": -3.0, "high": 3.0} if preset == "epsilon-gamma-box" else {}
    lrp = relprop.LRP(model, relprop.composites.get(preset, **kwargs))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
        lrp.attribute(torch.randn(1, 3, 32, 32), target=1)
    sums = [event.input_shapes for event in profile.events() if event.name == "aten::add"]
    # BatchNorm's var + eps, no maps (a first layer's z+ and alpha-beta add the halves of the stacked input's
    # relevance: the model input's shape, where no relevances meet)
    assert sums and not [shapes for shapes in sums if len(shapes[1]) == 4 and shapes[1] != [1, 3, 32, 32]]
