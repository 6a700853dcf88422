"""Parity with zennit 0.5.1 (with its VGG / ResNet canonizers) on torchvision CNNs, float64.

relprop seeds with f_t(x), zennit with 1, so relprop / f_t(x) must equal
zennit's attribution. zennit keeps BatchNorm's eps when it merges a BN into
the previous layer (docs/design.md, section 6), so the tests set ``bn.eps = 0``.
"""
import copy

import pytest
import torch
import torchvision

zennit = pytest.importorskip("zennit")
from zennit import composites as zennit_composites  # noqa: E402
from zennit.attribution import Gradient  # noqa: E402
from zennit.torchvision import ResNetCanonizer, VGGCanonizer  # noqa: E402

import relprop  # noqa: E402
from conftest import randomize_batch_norms, relative_error  # noqa: E402

LOW = torch.full((1, 3, 1, 1), -3.0, dtype=torch.float64)
HIGH = torch.full((1, 3, 1, 1), 3.0, dtype=torch.float64)
PRESETS = {
    "epsilon-plus-flat": (zennit_composites.EpsilonPlusFlat, {}),
    "epsilon-plus": (zennit_composites.EpsilonPlus, {}),
    "epsilon-alpha2-beta1": (zennit_composites.EpsilonAlpha2Beta1, {}),
    "epsilon-gamma-box": (zennit_composites.EpsilonGammaBox, {"low": LOW, "high": HIGH}),
}
MODELS = {"vgg16_bn": VGGCanonizer, "resnet18": ResNetCanonizer, "resnet50": ResNetCanonizer}


@pytest.fixture(scope="module", params=list(MODELS))
def model_and_input(request):
    torch.manual_seed(1)
    model = getattr(torchvision.models, request.param)(weights=None).double().eval()
    randomize_batch_norms(model, eps=0.0)
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64).clamp(-3, 3)
    return request.param, model, x


@pytest.mark.parametrize("preset", PRESETS)
def test_matches_zennit(model_and_input, preset):
    name, model, x = model_and_input
    target = [3, 7]
    zennit_class, kwargs = PRESETS[preset]
    ours = relprop.LRP(model, relprop.composites.get(preset, **kwargs)).attribute(x, target=target)

    reference_model = copy.deepcopy(model)
    composite = zennit_class(canonizers=[MODELS[name]()], **kwargs)
    with Gradient(model=reference_model, composite=composite) as attributor:
        output, theirs = attributor(x, torch.eye(1000, dtype=torch.float64)[target])
    scale = output[[0, 1], target].reshape(2, 1, 1, 1)
    assert relative_error(ours / scale, theirs) < 1e-6
