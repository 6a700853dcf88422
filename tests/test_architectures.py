"""Every torchvision classification CNN family, unmodified: no op without a rule (strict mode),
LRP-0 = Gradient x Input where the network is piecewise linear, and exact conservation with
zero biases. Marked slow: run in CI, skip locally with ``-m 'not slow'``."""
import pytest
import torch
import torchvision

import relprop
from conftest import gradient_times_input, randomize_batch_norms, relative_error, seed_of, zero_biases

# name -> whether every nonlinearity is ReLU-like (so LRP-0 equals Gradient x Input)
FAMILIES = {
    "vgg11_bn": True, "alexnet": True, "resnet18": True, "resnext50_32x4d": True, "wide_resnet50_2": True,
    "densenet121": True, "mobilenet_v2": True, "mnasnet0_5": True, "googlenet": True, "inception_v3": True,
    "squeezenet1_1": True, "shufflenet_v2_x0_5": True, "regnet_x_400mf": True,
    "mobilenet_v3_small": False, "efficientnet_b0": False, "efficientnet_v2_s": False, "regnet_y_400mf": False,
    "convnext_tiny": False,
}
TARGET = [1, 3]


def build(name):
    kwargs = {"num_classes": 10}
    if name in ("googlenet", "inception_v3"):
        kwargs.update(aux_logits=False, init_weights=False)
    model = getattr(torchvision.models, name)(weights=None, **kwargs)
    return randomize_batch_norms(model).double().eval()


def images(name):
    size = 75 if name == "inception_v3" else 64
    return torch.randn(2, 3, size, size, dtype=torch.float64)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_family(name):
    model, x = build(name), images(name)
    lrp0 = relprop.LRP(model, relprop.composites.Epsilon(epsilon=0.0), strict=True)
    if FAMILIES[name]:
        assert relative_error(lrp0.attribute(x, target=TARGET), gradient_times_input(model, x, TARGET)) < 1e-8
    zero_biases(model)
    expected = seed_of(model(x), TARGET).detach()
    relevance = lrp0.attribute(x, target=TARGET)
    scale = relevance.abs().sum().item() + expected.abs().max().item()
    torch.testing.assert_close(relevance.sum((1, 2, 3)), expected, rtol=1e-8, atol=1e-12 * scale)
    # z+ is not conservative where a signed signal meets only non-positive contributions, so only finiteness here
    plus = relprop.LRP(model, "epsilon-plus-flat", strict=True).attribute(x, target=TARGET)
    assert torch.isfinite(plus).all() and plus.abs().sum() > 0
