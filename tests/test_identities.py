"""Identities that hold for any correct LRP (DESIGN.md section 6), float64.

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
