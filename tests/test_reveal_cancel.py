"""DeepLift's RevealCancel rule: completeness on random networks, the paper's min example, equality with Rescale
where no unit sees both signs, and closed forms computed by hand. float64."""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import randomize_batch_norms
from helpers import Embedded, rms_norm, target_values, with_weights
from hypothesis import given, settings
from hypothesis import strategies as st
from test_random_networks import SPECS, RandomNet
from torch import nn

import relprop
from relprop.methods import DeepLift, DeepLiftShap, LayerDeepLift

D = torch.float64
SETTINGS = settings(max_examples=30, deadline=None)


def reveal_cancel(model, x, baseline=None, target=0, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", relprop.ConservationWarning)
        return DeepLift(model, rule="reveal_cancel", **kwargs).attribute(x, baseline, target=target)


# ------------------------------------------------------------------ completeness


@SETTINGS
@given(spec=SPECS, seed=st.integers(0, 2 ** 16))
def test_complete_on_random_networks(spec, seed):
    """Residual sums (in place too), concatenation, max and average pooling, BatchNorm, a module used twice."""
    torch.manual_seed(seed)
    model = randomize_batch_norms(RandomNet(spec)).double().eval()
    x, baseline = torch.randn(2, 3, 8, 8, dtype=D), torch.randn(2, 3, 8, 8, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("error", relprop.ConservationWarning)
        attributions, delta = DeepLift(model, rule="reveal_cancel").attribute(x, baseline, target=[0, 2],
                                                                              return_convergence_delta=True)
    explained = target_values(model, x, [0, 2]) - target_values(model, baseline, [0, 2])
    totals = attributions.flatten(1).sum(1)
    scale = attributions.abs().flatten(1).sum(1) + explained.abs()
    assert ((totals - explained).abs() <= 1e-8 * scale + 1e-300).all(), (totals, explained)
    torch.testing.assert_close(delta, totals - explained, rtol=0, atol=1e-12 * scale.max().item())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "densenet121", "efficientnet_v2_s", "convnext_tiny"])
def test_complete_on_torchvision_families(name):
    """In-place ReLU and residual sums, concatenation, squeeze-and-excitation products, layer norm and scaling."""
    import test_architectures as architectures

    model, x = architectures.build(name), architectures.images(name)
    torch.manual_seed(0)
    baseline = 0.3 * torch.randn_like(x)
    target = architectures.TARGET
    attributions = reveal_cancel(model, x, baseline, target=target)
    explained = target_values(model, x, target) - target_values(model, baseline, target)
    scale = attributions.abs().flatten(1).sum(1) + explained.abs()
    assert ((attributions.flatten(1).sum(1) - explained).abs() <= 1e-8 * scale).all()


class Functional(nn.Module):
    """Functional ops that split differences per input: a difference, a scaling of mixed signs, a mean, a sum."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.scale = torch.linspace(-1.0, 1.0, 4, dtype=D).reshape(1, 4, 1, 1)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        h = self.conv(x)
        h = torch.tanh(h - 0.5 * x.mean(1, keepdim=True)) * self.scale
        h = F.max_pool2d(F.gelu(h + h.flip(-1)), 2)
        return self.fc(torch.sigmoid(h.flatten(1) - h.flatten(1).mean(1, keepdim=True)))


def test_complete_through_functional_ops_and_the_other_classes():
    torch.manual_seed(0)
    model = Functional().double().eval()
    x, baseline = torch.randn(3, 3, 8, 8, dtype=D), torch.randn(3, 3, 8, 8, dtype=D)
    explained = target_values(model, x, 1) - target_values(model, baseline, 1)
    attributions = reveal_cancel(model, x, baseline, target=1)
    torch.testing.assert_close(attributions.flatten(1).sum(1), explained, rtol=1e-9, atol=1e-12)
    shap = DeepLiftShap(model, rule="reveal_cancel").attribute(x, baseline, target=1)  # every baseline for each input
    each = torch.stack([reveal_cancel(model, x, baseline[k:k + 1].expand_as(x), target=1) for k in range(3)]).mean(0)
    torch.testing.assert_close(shap, each, rtol=1e-10, atol=1e-12)


class Written(nn.Module):
    """Differences written in place: into a buffer, and a dense layer's output scaled and reduced in place."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.out = nn.Linear(4, 3), nn.Linear(4, 3), nn.Linear(5, 2)

    def forward(self, x):
        buffer = torch.zeros(x.shape[0], 5, dtype=x.dtype)
        buffer[:, :3] = self.first(x)
        buffer[:, 3:] = x[:, :2]
        h = self.second(x)
        h.mul_(2.0)
        h.sub_(x[:, 1:])
        return self.out(torch.tanh(buffer) + F.pad(torch.relu(h), (0, 2)))


def test_complete_through_writes_in_place():
    torch.manual_seed(0)
    model = Written().double().eval()
    x = torch.randn(4, 4, dtype=D)
    explained = target_values(model, x, 1) - target_values(model, torch.zeros_like(x), 1)
    torch.testing.assert_close(reveal_cancel(model, x, target=1).sum(1), explained, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ the paper's example: min(i1, i2)


class MinDense(nn.Module):
    """``min(i1, i2) = i1 - ReLU(i1 - i2)`` with dense layers, as in the paper's figure."""

    def __init__(self):
        super().__init__()
        self.difference = with_weights(nn.Linear(2, 1, bias=False).double(), [[1.0, -1.0]])
        self.out = with_weights(nn.Linear(2, 1, bias=False).double(), [[1.0, -1.0]])

    def forward(self, x):
        return self.out(torch.cat([x[:, :1], torch.relu(self.difference(x))], 1))


class MinFunctional(nn.Module):
    """The same, written with indexing and differences."""

    def forward(self, x):
        return x[:, :1] - F.relu(x[:, :1] - x[:, 1:])


@SETTINGS
@given(i1=st.floats(0.1, 10.0), i2=st.floats(0.1, 10.0), dense=st.booleans())
def test_min_gets_shared_as_the_paper_derives(i1, i2, dense):
    # Baseline (0, 0), i1, i2 > 0. h = i1 - i2 has the positive part P = i1 (from i1) and the negative part
    # M = -i2 (from i2), h0 = 0. If i1 > i2: dy+ = (relu(i1) - relu(0)) / 2 + (relu(i1 - i2) - relu(-i2)) / 2
    # = i1 - i2 / 2 and dy- = (relu(-i2) - 0) / 2 + (relu(i1 - i2) - relu(i1)) / 2 = -i2 / 2, so m+ = 1 - i2 / (2 i1),
    # m- = 1 / 2. The output i1 - y gives y the multiplier -1: i1 gets (1 - m+) i1 = i2 / 2, i2 gets m- i2 = i2 / 2.
    # If i2 > i1: dy+ = i1 / 2, dy- = -i1 / 2, m+ = 1 / 2, m- = i1 / (2 i2): i1 gets i1 / 2, i2 gets i1 / 2.
    # Each input gets min(i1, i2) / 2, its Shapley value. Rescale gives h one multiplier dy / dh: all of min to
    # i2 if i1 > i2 (m = 1: i1 gets i1 - i1 = 0), all to i1 if i2 > i1 (dy = 0).
    if abs(i1 - i2) < 1e-3:
        return
    model = (MinDense() if dense else MinFunctional()).double().eval()
    x = torch.tensor([[i1, i2]], dtype=D)
    low = min(i1, i2)
    torch.testing.assert_close(reveal_cancel(model, x), torch.tensor([[low / 2, low / 2]], dtype=D))
    rescale = DeepLift(model).attribute(x, target=0)
    expected = [0.0, low] if i1 > i2 else [low, 0.0]
    torch.testing.assert_close(rescale, torch.tensor([expected], dtype=D))


# ------------------------------------------------------------------ equal to Rescale where signs do not mix


def monotone_net(activation):
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), activation(), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3),
                          activation(), nn.Flatten(), nn.Linear(16, 6), activation(), nn.Linear(6, 3)).double().eval()
    with torch.no_grad():
        for module in list(model)[:-1]:
            if hasattr(module, "weight"):
                module.weight.abs_()
    return model


@SETTINGS
@given(seed=st.integers(0, 2 ** 16), activation=st.sampled_from([nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Softplus, nn.ELU]),
       sign=st.sampled_from([1.0, -1.0]))
def test_equals_rescale_where_no_unit_sees_both_signs(seed, activation, sign):
    # non-negative weights before the last layer, increasing activations and max pooling, and inputs all above
    # (or all below) the baseline: every term w * da has one sign, so every unit's negative (positive) part is 0
    torch.manual_seed(seed)
    model = monotone_net(activation)
    baseline = torch.randn(2, 3, 8, 8, dtype=D)
    x = baseline + sign * torch.rand(2, 3, 8, 8, dtype=D)
    ours = reveal_cancel(model, x, baseline, target=[0, 2])
    theirs = DeepLift(model).attribute(x, baseline, target=[0, 2])
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12 * theirs.abs().max().item())


def test_mixed_signs_differ_from_rescale():
    torch.manual_seed(0)
    model = monotone_net(nn.Tanh)
    with torch.no_grad():
        model[0].weight.neg_()[:, 0] *= -1  # the first layer mixes signs
    x, baseline = torch.rand(2, 3, 8, 8, dtype=D), torch.zeros(2, 3, 8, 8, dtype=D)
    assert not torch.allclose(reveal_cancel(model, x, baseline), DeepLift(model).attribute(x, baseline, target=0))


# ------------------------------------------------------------------ closed forms by hand


def test_one_tanh_unit():
    # y = tanh(2 x1 - x2 + 0.5) at x = (1, 1) from (0, 0): P = 2, M = -1, z0 = 0.5. x1 gets 2 m+ = dy+, x2 gets dy-.
    layer = with_weights(nn.Linear(2, 1).double(), [[2.0, -1.0]], [0.5])
    model = nn.Sequential(layer, nn.Tanh()).eval()
    t = math.tanh
    plus = (t(2.5) - t(0.5)) / 2 + (t(1.5) - t(-0.5)) / 2
    minus = (t(-0.5) - t(0.5)) / 2 + (t(1.5) - t(2.5)) / 2
    found = reveal_cancel(model, torch.ones(1, 2, dtype=D))
    torch.testing.assert_close(found, torch.tensor([[plus, minus]], dtype=D), rtol=1e-12, atol=0)


def two_units():
    # out = relu(x1 - x2) + relu(x1 + x2)
    hidden = with_weights(nn.Linear(2, 2, bias=False).double(), [[1.0, -1.0], [1.0, 1.0]])
    return nn.Sequential(hidden, nn.ReLU(), with_weights(nn.Linear(2, 1, bias=False).double(), [[1.0, 1.0]])).eval()


def test_two_relu_units_by_hand():
    # x = (2, 3) from (0, 0). Unit 1: z = x1 - x2 = -1, P = 2, M = -3: dy+ = relu(2) / 2 + (relu(-1) - relu(-3)) / 2
    # = 1, dy- = relu(-3) / 2 + (relu(-1) - relu(2)) / 2 = -1: m+ = 1/2, m- = 1/3. Unit 2: z = 5, P = 5, M = 0:
    # m+ = 1. x1: 1/2 + 1 = 3/2, attribution 3; x2: -(1/3) + 1 = 2/3, attribution 2 (the Shapley values: v(x1) = 4,
    # v(x2) = 3, v(both) = 5). Rescale: unit 1's output does not change (m = 0): x1 gets 2, x2 gets 3.
    model = two_units()
    x = torch.tensor([[2.0, 3.0]], dtype=D)
    torch.testing.assert_close(reveal_cancel(model, x), torch.tensor([[3.0, 2.0]], dtype=D))
    torch.testing.assert_close(reveal_cancel(model, x, multiply_by_inputs=False), torch.tensor([[1.5, 2 / 3]], dtype=D))
    torch.testing.assert_close(DeepLift(model).attribute(x, target=0), torch.tensor([[2.0, 3.0]], dtype=D))
    # at the hidden layer: unit 1's contributions m+ P + m- M = 1 - 1 cancel; its input is the model's
    layer = LayerDeepLift(model, model[0], rule="reveal_cancel")
    torch.testing.assert_close(layer.attribute(x, target=0), torch.tensor([[0.0, 5.0]], dtype=D))
    torch.testing.assert_close(layer.attribute(x, target=0, attribute_to_layer_input=True),
                               torch.tensor([[3.0, 2.0]], dtype=D))


def test_no_difference_gives_the_gradient():
    # x = baseline: every part is 0, and each multiplier falls back to the derivative, as under Rescale
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Sigmoid(), nn.Linear(6, 2)).double().eval()
    x = torch.randn(3, 4, dtype=D)
    multipliers = reveal_cancel(model, x, x.clone(), multiply_by_inputs=False)
    leaf = x.clone().requires_grad_()
    (gradient,) = torch.autograd.grad(model(leaf)[:, 0].sum(), leaf)
    torch.testing.assert_close(multipliers, gradient, rtol=1e-9, atol=1e-12)
    x[:, 0] += 1.0  # one input moves: the others keep finite multipliers
    assert torch.isfinite(reveal_cancel(model, x, x.clone().index_fill_(1, torch.tensor([0]), 0.0),
                                        multiply_by_inputs=False)).all()


def test_unknown_rule_is_a_clear_error():
    model = two_units()
    for make in (lambda: DeepLift(model, rule="revealcancel"), lambda: DeepLiftShap(model, rule="shapley"),
                 lambda: LayerDeepLift(model, model[0], rule="RevealCancel")):
        with pytest.raises(ValueError, match="'rescale', 'reveal_cancel'"):
            make()


def test_complete_on_a_tiny_llama(monkeypatch):
    """Attention, RMSNorm, the gated MLP's products, rotary embeddings (a difference of products with constants)."""
    pytest.importorskip("transformers")
    from test_transformers import IDS, build
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm)
    model = Embedded(build("llama", "sdpa")).eval()
    embeddings = model.model.get_input_embeddings()(IDS).detach()
    baseline = 0.5 * embeddings
    explained = target_values(model, embeddings, (-1, 5)) - target_values(model, baseline, (-1, 5))
    attributions = reveal_cancel(model, embeddings, baseline, target=(-1, 5))
    torch.testing.assert_close(attributions.flatten(1).sum(1), explained, rtol=1e-8, atol=1e-10)
    assert not torch.allclose(attributions, DeepLift(model).attribute(embeddings, baseline, target=(-1, 5)))
