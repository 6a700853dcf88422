"""The model is not changed (docs/design.md, section 1), and Epsilon re-runs nothing in the backward pass."""
import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_globals
from torch.utils._python_dispatch import TorchDispatchMode

import relprop
from conftest import ResidualNet, randomize_batch_norms


def snapshot(model: nn.Module):
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "params": [(name, p, p.requires_grad) for name, p in model.named_parameters()],
        "training": [m.training for m in model.modules()],
    }


def assert_untouched(model: nn.Module, before) -> None:
    after = model.state_dict()
    assert before["state"].keys() == after.keys()
    for key, value in before["state"].items():
        assert torch.equal(value, after[key]), key
    for (name, param, flag), (name2, param2) in zip(before["params"], model.named_parameters()):
        assert name == name2 and param is param2 and param.requires_grad == flag and param.grad is None, name
    assert [m.training for m in model.modules()] == before["training"]
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks and not module._backward_hooks
        assert not module._forward_hooks_always_called
        assert "rule" not in vars(module) or isinstance(vars(module)["rule"], relprop.rules.Rule)
    assert not module_globals._global_forward_hooks and not module_globals._global_forward_pre_hooks
    assert torch._C._len_torch_function_stack() == 0


def model():
    net = randomize_batch_norms(ResidualNet()).double().eval()
    net.conv_b.weight.requires_grad_(False)  # a frozen parameter stays frozen
    return net


@pytest.mark.parametrize("preset", ["epsilon", "epsilon-plus-flat", "epsilon-gamma-box"])
def test_model_untouched_after_attribution(preset):
    net, x = model(), torch.randn(2, 3, 16, 16, dtype=torch.float64)
    before = snapshot(net)
    kwargs = {"low": -5.0, "high": 5.0} if preset == "epsilon-gamma-box" else {}
    relprop.LRP(net, relprop.composites.get(preset, **kwargs)).attribute(x, target=1)
    assert_untouched(net, before)


def test_model_untouched_after_errors():
    net, x = model(), torch.randn(2, 3, 16, 16, dtype=torch.float64)
    before = snapshot(net)
    with pytest.raises(ValueError):
        relprop.LRP(net).attribute(x, target=99)  # raises after the forward pass
    assert_untouched(net, before)
    with pytest.raises(RuntimeError):
        relprop.LRP(net).attribute(torch.randn(2, 5, 16, 16, dtype=torch.float64), target=0)  # inside forward
    assert_untouched(net, before)
    net.fc.rule = relprop.rules.Pass()
    before = snapshot(net)
    with pytest.raises(relprop.RuleError):
        relprop.LRP(net).attribute(x, target=0)
    assert_untouched(net, before)


def test_training_mode_is_explained_in_eval_mode_and_restored():
    net, x = model(), torch.randn(2, 3, 16, 16, dtype=torch.float64)
    expected = relprop.LRP(net).attribute(x, target=1)
    net.train()
    before = snapshot(net)
    with pytest.warns(UserWarning, match="training mode"):
        relevance = relprop.LRP(net).attribute(x, target=1)
    assert torch.equal(relevance, expected)
    assert_untouched(net, before)  # running statistics were not updated


def test_a_module_class_that_watches_its_training_flag_sees_each_change():
    """Eval mode is set past nn.Module.__setattr__ only where the class keeps that one."""
    seen = []

    class Watched(nn.Linear):
        def __setattr__(self, name, value):
            if name == "training":
                seen.append(value)
            super().__setattr__(name, value)

    net = nn.Sequential(Watched(4, 3), nn.ReLU()).double().train()
    seen.clear()
    with pytest.warns(UserWarning, match="training mode"):
        relprop.LRP(net).attribute(torch.randn(2, 4, dtype=torch.float64), target=0)
    assert seen == [False, True]
    assert all(module.training for module in net.modules())


@pytest.mark.parametrize("preset", ["epsilon", "epsilon-plus", "epsilon-alpha2-beta1", "epsilon-gamma-box"])
def test_activations_kept_by_hooks_are_not_overwritten(preset):
    """Rules write into an op's output only where no other tensor shares its memory."""
    net, x = model(), torch.randn(2, 3, 16, 16, dtype=torch.float64)
    composite = relprop.composites.get(preset, **({"low": -5.0, "high": 5.0} if preset == "epsilon-gamma-box" else {}))
    alone = relprop.LRP(net, composite).attribute(x, target=1)
    kept = []  # every module's output, as the model leaves it (in-place ReLUs and sums included)
    handles = [m.register_forward_hook(lambda m, i, out: kept.append(out)) for m in net.modules() if m is not net]
    net(x)
    plain, kept[:] = [out.clone() for out in kept], []
    relevance = relprop.LRP(net, composite).attribute(x, target=1)
    for handle in handles:
        handle.remove()
    assert len(kept) == len(plain) == len(handles) > 5
    for output, value in zip(kept, plain):
        assert torch.equal(output.detach(), value)
    assert torch.equal(relevance, alone)


@pytest.mark.parametrize("preset", ["epsilon", "epsilon-plus", "epsilon-alpha2-beta1"])
def test_forward_output_is_bitwise_the_plain_forward(preset):
    net, x = model().float(), torch.randn(4, 3, 16, 16)
    plain = net(x)
    with relprop.LRP(net, preset).context():
        explained = net(x.clone().requires_grad_())
    assert torch.equal(explained, plain)


class ConvCounter(TorchDispatchMode):
    """Counts forward convolutions and biased dense products (addmm) at the ATen level.

    The backward of a dense layer is a plain ``mm`` and that of a convolution
    ``convolution_backward``, so neither is counted.
    """

    def __init__(self):
        super().__init__()
        self.forward_products = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.convolution.default, torch.ops.aten.addmm.default):
            self.forward_products += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("preset, reruns", [("epsilon", False), ("epsilon-plus", True)])
def test_epsilon_runs_no_layer_forward_in_the_backward_pass(preset, reruns):
    net, x = model(), torch.randn(2, 3, 16, 16, dtype=torch.float64, requires_grad=True)
    with relprop.LRP(net, preset).context():
        out = net(x)
    counter = ConvCounter()
    with counter:
        torch.autograd.grad(out, x, relprop.output_relevance(out, 0))
    # the epsilon rule only needs transposed products (convolution_backward, mm of the gradient) ...
    assert (counter.forward_products > 0) == reruns
    # ... and no parameter received a gradient buffer either way
    assert all(p.grad is None for p in net.parameters())
