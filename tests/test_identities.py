"""Identities that hold for any correct LRP (docs/design.md, section 6), float64.

- LRP-0 equals Gradient x Input on ReLU networks, biases, residual sums,
  concatenations, max pooling and eval BatchNorm included.
- With every bias and BatchNorm shift zero, conservative composites conserve:
  the input relevance sums to the explained output f_t(x).
"""
import copy

import pytest
import torch
import torchvision

import relprop
from conftest import (ResidualNet, gradient_times_input, randomize_batch_norms, relative_error, seed_of,
                      zero_biases)

TARGET = [1, 3]


def torchvision_model(name):
    return randomize_batch_norms(getattr(torchvision.models, name)(weights=None, num_classes=10)).double().eval()


MODELS = {
    "residual-net": lambda: randomize_batch_norms(ResidualNet()).double().eval(),
    "resnet18": lambda: torchvision_model("resnet18"),
    "densenet121": lambda: torchvision_model("densenet121"),
}
SIZE = {"residual-net": 16, "resnet18": 32, "densenet121": 32}


def images(name):
    return torch.randn(2, 3, SIZE[name], SIZE[name], dtype=torch.float64)


@pytest.mark.parametrize("name", MODELS)
def test_lrp0_equals_gradient_times_input(name):
    model = MODELS[name]()
    x = images(name)
    relevance = relprop.LRP(model, relprop.composites.Epsilon(epsilon=0.0)).attribute(x, target=TARGET)
    assert relative_error(relevance, gradient_times_input(model, x, TARGET)) < 1e-8


CONSERVATIVE = ["epsilon", "epsilon-plus", "epsilon-alpha2-beta1"]


@pytest.mark.parametrize("preset", CONSERVATIVE)
@pytest.mark.parametrize("name", MODELS)
def test_zero_bias_models_conserve(name, preset):
    model = zero_biases(MODELS[name]())
    x = images(name)
    expected = seed_of(model(x), TARGET).detach()
    lrp = relprop.LRP(model, relprop.composites.get(preset, epsilon=1e-9))
    relevance, delta = lrp.attribute(x, target=TARGET, return_convergence_delta=True)
    torch.testing.assert_close(relevance.sum((1, 2, 3)), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(delta, expected - relevance.sum((1, 2, 3)), rtol=0, atol=1e-12)


def test_default_epsilon_absorbs_little_and_biases_absorb_their_share():
    biased = MODELS["residual-net"]()
    unbiased = zero_biases(copy.deepcopy(biased))
    x = images("residual-net")
    for model, tolerance in ((unbiased, 1e-3), (biased, None)):
        expected = seed_of(model(x), TARGET).detach()
        total = relprop.LRP(model, "epsilon").attribute(x, target=TARGET).sum((1, 2, 3))
        if tolerance is None:  # the biases take their share: totals differ from f_t(x)
            assert ((total - expected).abs() / expected.abs()).min() > 1e-2
        else:  # the default epsilon (1e-6) loses only a sliver on a bias-free model
            torch.testing.assert_close(total, expected, rtol=tolerance, atol=0)


def test_batch_norm_after_an_inplace_relu_is_not_merged_across_it():
    """Shrunk from a hypothesis example: conv -> bn -> relu_ -> bn -> conv."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1, bias=False), torch.nn.BatchNorm2d(4), torch.nn.ReLU(inplace=True),
        torch.nn.BatchNorm2d(4), torch.nn.Conv2d(4, 4, 3, padding=1, bias=False), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(4 * 8 * 8, 5, bias=False))
    model = randomize_batch_norms(model).double().eval()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    relevance = relprop.LRP(model, relprop.composites.Epsilon(epsilon=0.0)).attribute(x, target=TARGET)
    assert relative_error(relevance, gradient_times_input(model, x, TARGET)) < 1e-8


class _BranchedBatchNorms(torch.nn.Module):
    """A conv + BatchNorm whose outputs feed several branches (timm's RepGhostNet: ``cheap(y) + fusion_bn(y)``)."""

    def __init__(self, wiring: str):
        super().__init__()
        self.wiring = wiring
        self.conv, self.bn = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
        self.dw = torch.nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.bn2, self.bn3 = torch.nn.BatchNorm2d(4), torch.nn.BatchNorm2d(4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        if self.wiring == "bn-read-by-conv-and-bn":
            y = self.bn(self.conv(x))
            z = self.dw(y) + self.bn2(y)
        elif self.wiring == "bn-read-by-two-bns":
            y = self.bn(self.conv(x))
            z = self.bn2(y) + self.bn3(y)
        elif self.wiring == "bn-after-bn":
            z = self.bn2(self.bn(self.conv(x)))
        else:  # "raw-conv-read-elsewhere"
            c = self.conv(x)
            z = self.bn(c) + self.dw(c)
        return self.head(z.relu().mean((2, 3)))


BRANCHED = ("bn-read-by-conv-and-bn", "bn-read-by-two-bns", "bn-after-bn", "raw-conv-read-elsewhere")
#: the merged (layer, BatchNorms) of each wiring, as the audit names them
MERGES = {
    "bn-read-by-conv-and-bn": {"conv+bn", "conv+bn+bn2"},
    "bn-read-by-two-bns": {"conv+bn+bn2", "conv+bn+bn3"},  # relevance reaches conv+bn through them alone
    "bn-after-bn": {"conv+bn+bn2"},
    "raw-conv-read-elsewhere": {"conv+bn"},
}


@pytest.mark.parametrize("wiring", BRANCHED)
def test_batch_norm_on_a_branched_output_is_lrp0_exact_and_audited(wiring):
    """A BatchNorm merged into a layer that has one merged already composes with it (was 38% off, silently)."""
    torch.manual_seed(0)
    model = randomize_batch_norms(_BranchedBatchNorms(wiring)).double().eval()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    lrp0 = relprop.composites.Epsilon(epsilon=0.0)
    relevance = relprop.LRP(model, lrp0).attribute(x, target=[0, 0])
    assert relative_error(relevance, gradient_times_input(model, x, [0, 0])) < 1e-10
    rows = relprop.audit(model, x, target=[0, 0], composite=lrp0).rows
    assert {row.module for row in rows if row.op.endswith("+batch_norm")} == MERGES[wiring]
