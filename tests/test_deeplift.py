"""DeepLift (Rescale rule) on the engine: completeness, parity with captum where captum is right, and
references computed by hand where captum is wrong. float64."""
import warnings

import pytest
import test_architectures as architectures
import torch
import torch.nn.functional as F
import torchvision
from helpers import Embedded, rms_norm, target_values, with_weights
from torch import nn

import relprop
from relprop.methods import DeepLift, DeepLiftShap, LayerDeepLift

captum_attr = pytest.importorskip("captum.attr")

D = torch.float64


def assert_complete(model, x, baseline, target, rtol=1e-8):
    """Attributions sum to f(x) - f(baseline) at the target, to ``rtol`` of the sizes involved; the delta says so."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", relprop.ConservationWarning)  # the guard stays quiet where it is exact
        attributions, delta = DeepLift(model).attribute(x, baseline, target=target, return_convergence_delta=True)
    explained, reference = target_values(model, x, target), target_values(model, baseline, target)
    totals = attributions.flatten(1).sum(1)
    scale = attributions.abs().flatten(1).sum(1) + explained.abs() + reference.abs()
    assert ((totals - (explained - reference)).abs() <= rtol * scale).all(), (totals, explained - reference)
    torch.testing.assert_close(delta, totals - (explained - reference), rtol=0, atol=1e-12 * scale.max().item())
    return attributions


# ------------------------------------------------------------------ parity with captum where it is right

SEQUENTIAL = {
    "relu": lambda: [nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Flatten(),
                     nn.Linear(256, 5)],
    # captum's max-pool rule is right where a linear op is on both sides of the pooling
    "pooling": lambda: [nn.Conv2d(3, 4, 3, padding=1), nn.ELU(), nn.Conv2d(4, 4, 3, padding=1), nn.MaxPool2d(2),
                        nn.Flatten(), nn.Linear(64, 5)],
    "saturating": lambda: [nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.AvgPool2d(2), nn.Conv2d(4, 4, 3),
                           nn.Sigmoid(), nn.Flatten(), nn.Linear(16, 6), nn.Softplus(), nn.Linear(6, 5)],
    "leaky": lambda: [nn.Conv2d(3, 4, 3, stride=2), nn.LeakyReLU(0.1), nn.Flatten(), nn.Linear(36, 5)],
}


def sequential(name):
    model = nn.Sequential(*SEQUENTIAL[name]()).to(D).eval()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            with torch.no_grad():
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
                module.weight.uniform_(-1.5, 1.5)
    return model


@pytest.mark.parametrize("name", SEQUENTIAL)
def test_parity_with_captum_on_sequential_cnns(name):
    model = sequential(name)
    x, baseline = torch.randn(3, 3, 8, 8, dtype=D), 0.3 * torch.randn(3, 3, 8, 8, dtype=D)
    ours = assert_complete(model, x, baseline, [0, 2, 4])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # captum's notes on hooks and on inputs without requires_grad
        theirs = captum_attr.DeepLift(model).attribute(x, baseline, target=[0, 2, 4]).detach()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item())


def test_deeplift_shap_matches_captum_and_averages_deeplift():
    model = sequential("saturating")
    x, distribution = torch.randn(2, 3, 8, 8, dtype=D), torch.randn(3, 3, 8, 8, dtype=D)
    ours, delta = DeepLiftShap(model).attribute(x, distribution, target=1, return_convergence_delta=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = captum_attr.DeepLiftShap(model).attribute(x, distribution, target=1).detach()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item())
    each = [DeepLift(model).attribute(x, baseline.expand_as(x), target=1) for baseline in distribution]
    torch.testing.assert_close(ours, torch.stack(each).mean(0))
    assert delta.shape == (6,) and delta.abs().max() < 1e-12  # one per (example, baseline) pair


# ------------------------------------------------------------------ where captum is wrong: references by hand

class FunctionalResidual(nn.Module):
    """``v . (relu(W x + c) + x)`` written with functional ops."""

    def __init__(self):
        super().__init__()
        self.inner = with_weights(nn.Linear(2, 2), [[1.0, -2.0], [0.5, 1.0]], [0.25, -0.5])
        self.head = with_weights(nn.Linear(2, 1), [[2.0, -1.0]], [0.1])

    def forward(self, x):
        return self.head(torch.relu(self.inner(x)) + x)


def test_functional_relu_and_residual_sum_by_hand():
    model = FunctionalResidual().to(D).eval()
    x, baseline = torch.tensor([[1.0, -2.0]], dtype=D), torch.tensor([[-0.5, 1.5]], dtype=D)
    ours = assert_complete(model, x, baseline, None)
    # by hand: z = (5.25, -2.0) and z0 = (-3.25, 0.75); the ReLU's secants are (5.25 - 0) / 8.5 and (0 - 0.75) / -2.75
    secants = torch.tensor([5.25 / 8.5, 0.75 / 2.75], dtype=D)
    w, v = model.inner.weight.detach(), model.head.weight.detach()[0]
    expected = (x - baseline) * (v * secants @ w + v)
    torch.testing.assert_close(ours, expected)
    # f(x) - f(baseline) = 17.75 = 4.6484 + 13.1016. captum takes torch.relu's gradient (a functional op has no
    # module to hook): (6.0, 17.5), which sums to 23.5 (its delta: 5.75)
    torch.testing.assert_close(ours, torch.tensor([[4.6484, 13.1016]], dtype=D), rtol=0, atol=1e-4)
    assert ours.sum().item() == pytest.approx(17.75, abs=1e-12)


class ReusedReLU(nn.Module):
    """``v . relu(B relu(A x))`` with one ReLU module called twice."""

    def __init__(self):
        super().__init__()
        self.a = with_weights(nn.Linear(2, 2), [[1.0, 1.0], [-1.0, 2.0]], [0.0, 0.5])
        self.b = with_weights(nn.Linear(2, 2), [[1.0, -1.0], [2.0, 0.5]], [-0.5, 0.0])
        self.act = nn.ReLU()
        self.head = with_weights(nn.Linear(2, 1), [[1.0, -3.0]], [0.0])

    def forward(self, x):
        return self.head(self.act(self.b(self.act(self.a(x)))))


def test_module_called_twice_by_hand():
    model = ReusedReLU().to(D).eval()
    x, baseline = torch.tensor([[2.0, 1.0]], dtype=D), torch.tensor([[0.0, -1.0]], dtype=D)
    ours = assert_complete(model, x, baseline, None)
    # by hand: A x = (3, 0.5), A x0 = (-1, -1.5) -> relu secants (3/4, 0.5/2); h = (3, 0.5), h0 = (0, 0);
    # B h - 0.5 = (2, 6.25), B h0 - 0.5 = (-0.5, 0) -> secants (2/2.5, 6.25/6.25)
    first, second = torch.tensor([0.75, 0.25], dtype=D), torch.tensor([0.8, 1.0], dtype=D)
    a, b, v = model.a.weight.detach(), model.b.weight.detach(), model.head.weight.detach()[0]
    expected = (x - baseline) * ((first * ((second * v) @ b)) @ a)
    torch.testing.assert_close(ours, expected)
    # captum refuses: "A Module ReLU() was detected that does not contain some of the input/output attributes
    # that are required for DeepLift computations ... used more than once"


def pooled():
    """conv 1x1 (2x + 0.5) -> ReLU -> MaxPool1d(2) -> 3 y_0 - y_1 + 0.25."""
    model = nn.Sequential(nn.Conv1d(1, 1, 1), nn.ReLU(), nn.MaxPool1d(2), nn.Flatten(), nn.Linear(2, 1)).to(D)
    with_weights(model[0], [[[2.0]]], [0.5])
    with_weights(model[4], [[3.0, -1.0]], [0.25])
    return model.eval()


def test_layer_attribution_after_max_pooling_by_hand():
    model = pooled()
    x = torch.tensor([[[1.0, 3.0, -2.0, 0.5]]], dtype=D)
    baseline = torch.tensor([[[2.0, 0.0, 1.0, -1.0]]], dtype=D)
    # by hand: relu(conv) = (2.5, 6.5, 0, 1.5) and (4.5, 0.5, 2.5, 0); windows y = (6.5, 1.5), y0 = (4.5, 2.5).
    # Window 1: max(y, y0) - y0 = 2 to the input's winner (entry 1), times 3. Window 2: y - max(y, y0) = -1 to the
    # baseline's winner (entry 2), times -1. f(x) - f(baseline) = 18.25 - 11.25 = 7 = 6 + 1.
    expected = torch.tensor([[[0.0, 6.0, 1.0, 0.0]]], dtype=D)
    for layer in (model[0], model[1]):  # the convolution's output, and the ReLU's that the pooling reads
        ours, delta = LayerDeepLift(model, layer).attribute(x, baseline, return_convergence_delta=True)
        torch.testing.assert_close(ours, expected)
        assert delta.abs().max() < 1e-12
    torch.testing.assert_close(assert_complete(model, x, baseline, None), expected)  # the 1x1 conv is linear
    # captum's LayerDeepLift at the convolution: (0, 18, 0, -1.5), summing to 16.5 (delta 9.5); its DeepLift on
    # the input gives the same
    assert not ours.requires_grad


# ------------------------------------------------------------------ the rules, exactly

class Bilinear(nn.Module):
    """``(a . x) * (b . x)``."""

    def __init__(self):
        super().__init__()
        self.u = with_weights(nn.Linear(3, 1, bias=False), [[1.0, -2.0, 0.5]])
        self.v = with_weights(nn.Linear(3, 1, bias=False), [[0.5, 1.0, 3.0]])

    def forward(self, x):
        return self.u(x) * self.v(x)


def test_product_of_two_activations_takes_the_midpoint_rule():
    model = Bilinear().to(D).eval()
    x, baseline = torch.randn(4, 3, dtype=D), torch.randn(4, 3, dtype=D)
    ours = assert_complete(model, x, baseline, None, rtol=1e-12)
    a, b = model.u.weight.detach()[0], model.v.weight.detach()[0]
    middle = (x + baseline) / 2
    expected = (x - baseline) * (a * (middle @ b).unsqueeze(1) + b * (middle @ a).unsqueeze(1))
    torch.testing.assert_close(ours, expected)


class Products(nn.Module):
    def __init__(self):
        super().__init__()
        self.u, self.v, self.w = (nn.Linear(3, 4) for _ in range(3))

    def forward(self, x):
        quotient = self.u(x) / (self.v(x).exp() + 1.0)
        matrix = self.u(x).unsqueeze(2) @ self.w(x).unsqueeze(1)  # (N, 4, 4), two activation factors
        three = torch.einsum("bi,bi,bi->b", self.u(x), self.v(x), self.w(x)).unsqueeze(1)  # degree 3
        return torch.cat([quotient, matrix.flatten(1), three], 1)


@pytest.mark.parametrize("target", [0, 3, 7, 20])
def test_quotients_matrix_products_and_three_factors_are_exact(target):
    model = Products().to(D).eval()
    assert_complete(model, torch.randn(3, 3, dtype=D), torch.randn(3, 3, dtype=D), target, rtol=1e-12)


def test_quotient_by_hand():
    class Quotient(nn.Module):
        def forward(self, x):
            return x[:, :1] / x[:, 1:]

    x, baseline = torch.tensor([[3.0, 2.0]], dtype=D), torch.tensor([[1.0, 4.0]], dtype=D)
    ours = assert_complete(Quotient().eval(), x, baseline, None, rtol=1e-12)
    # u / v = u * (1 / v): d(u) * mean(1/v) + mean(u) * d(1/v), d(1/v) = -d(v) / (v v0)
    expected = torch.tensor([[2.0 * (1 / 2 + 1 / 4) / 2, 2.0 * (-2.0) * -1 / (2 * 4)]], dtype=D)
    torch.testing.assert_close(ours, expected)


class Attention(nn.Module):
    def __init__(self, softmax):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(4, 4) for _ in range(3))
        self.softmax = softmax

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(1, 2) / 2.0
        return (self.softmax(scores) @ self.v(x)).flatten(1)


def test_softmax_is_exact_where_captums_rule_is_not():
    x, baseline = torch.randn(2, 5, 4, dtype=D), torch.randn(2, 5, 4, dtype=D)
    for softmax in (lambda s: F.softmax(s, -1), nn.Softmax(-1)):
        torch.manual_seed(0)
        model = Attention(softmax).to(D).eval()
        assert_complete(model, x, baseline, 7, rtol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, delta = captum_attr.DeepLift(model).attribute(x, baseline, target=7, return_convergence_delta=True)
    # captum's nn.Softmax rule (elementwise Rescale, minus the mean over the whole batch) misses: its delta is
    # (-0.2314, 0.1564) for f(x) - f(baseline) = (-0.6093, 0.1625)
    torch.testing.assert_close(delta, torch.tensor([-0.2314, 0.1564], dtype=D), rtol=0, atol=1e-4)


def test_fused_attention_with_a_mask_and_grouped_heads():
    class Fused(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.kv = nn.Linear(4, 8), nn.Linear(4, 8)
            self.mask = (torch.rand(5, 5) > 0.3).logical_or(torch.eye(5, dtype=torch.bool))

        def forward(self, x):
            q = self.q(x).unflatten(-1, (4, 2)).transpose(1, 2)  # 4 query heads
            k, v = self.kv(x).unflatten(-1, (2, 4)).transpose(1, 2).chunk(2, -1)  # 2 key/value heads
            causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            masked = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=True)
            return (causal + masked).flatten(1)

    model = Fused().to(D).eval()
    assert_complete(model, torch.randn(2, 5, 4, dtype=D), torch.randn(2, 5, 4, dtype=D), 3, rtol=1e-12)


def test_normalisations_are_exact():
    class Norms(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.group = nn.GroupNorm(2, 4)
            self.layer = nn.LayerNorm(4)
            self.fc = nn.Linear(4 * 36, 3)

        def forward(self, x):
            h = self.group(self.conv(x)).permute(0, 2, 3, 1)
            h = F.rms_norm(self.layer(h), (4,), torch.linspace(0.5, 2.0, 4, dtype=x.dtype))
            return self.fc(F.gelu(h).flatten(1))

    model = Norms().to(D).eval()
    assert_complete(model, torch.randn(2, 3, 8, 8, dtype=D), torch.randn(2, 3, 8, 8, dtype=D), 1, rtol=1e-12)


def test_in_place_ops_and_casts():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out = nn.Linear(4, 6), nn.Linear(6, 2)

        def forward(self, x):
            h = torch.tanh(self.fc(x))
            h.relu_()  # overwrites the tanh's output, which its rule reads
            h = F.elu(h - 0.2, inplace=True)
            h += self.fc(x).sigmoid_()
            narrow = h.float().exp().double()  # a float32 region: its rounding is a function too
            return self.out(narrow)

    model = InPlace().to(D).eval()
    x, baseline = torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D)
    # exact up to the float32 arithmetic of the multipliers in the float32 region
    assert_complete(model, x, baseline, 1, rtol=1e-6)


def test_multipliers_tuple_inputs_and_batch_arguments():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 3)

        def forward(self, a, b, scale):
            return self.fc(torch.cat([torch.sigmoid(a), b], 1)) * scale

    model = Two().to(D).eval()
    a, b, scale = torch.randn(2, 3, dtype=D), torch.randn(2, 2, dtype=D), torch.tensor([[1.0], [-2.0]], dtype=D)
    base = (torch.zeros(2, 3, dtype=D), 0.5)
    found, delta = DeepLift(model).attribute((a, b), base, target=2, additional_forward_args=(scale,),
                                            return_convergence_delta=True)
    multipliers = DeepLift(model, multiply_by_inputs=False).attribute((a, b), base, target=2,
                                                                      additional_forward_args=(scale,))
    torch.testing.assert_close(found[0], multipliers[0] * a)
    torch.testing.assert_close(found[1], multipliers[1] * (b - 0.5))
    explained = model(a, b, scale)[:, 2] - model(torch.zeros_like(a), torch.full_like(b, 0.5), scale)[:, 2]
    torch.testing.assert_close(found[0].sum(1) + found[1].sum(1), explained.detach())
    assert delta.abs().max() < 1e-12
    assert torch.equal(DeepLift(model).compute_convergence_delta(found, base, (a, b), 2, (scale,)), delta)


# ------------------------------------------------------------------ layers

def test_layer_deeplift_on_a_cut_and_on_a_module_called_twice():
    model = ReusedReLU().to(D).eval()
    x, baseline = torch.randn(3, 2, dtype=D), torch.randn(3, 2, dtype=D)
    explained = (target_values(model, x, None) - target_values(model, baseline, None))
    at_b, delta = LayerDeepLift(model, "b").attribute(x, baseline, return_convergence_delta=True)
    torch.testing.assert_close(at_b.sum(1), explained)  # every path crosses b
    assert delta.abs().max() < 1e-12
    first, second = LayerDeepLift(model, model.act).attribute(x, baseline)  # one result per call
    torch.testing.assert_close(first.sum(1), explained)
    torch.testing.assert_close(second.sum(1), explained)


def test_layer_deeplift_on_a_resnet_stage():
    model = torchvision.models.resnet18(weights=None, num_classes=4).to(D).eval()
    x, baseline = torch.randn(2, 3, 32, 32, dtype=D), torch.zeros(2, 3, 32, 32, dtype=D)
    stage = LayerDeepLift(model, "layer3").attribute(x, baseline, target=1)
    explained = target_values(model, x, 1) - target_values(model, baseline, 1)
    torch.testing.assert_close(stage.flatten(1).sum(1), explained, rtol=0, atol=1e-10)
    inputs = assert_complete(model, x, baseline, 1)
    torch.testing.assert_close(inputs.flatten(1).sum(1), stage.flatten(1).sum(1), rtol=0, atol=1e-10)


# ------------------------------------------------------------------ never silently wrong

class Extremum(nn.Module):
    def __init__(self, reduce):
        super().__init__()
        self.fc = with_weights(nn.Linear(4, 4), torch.eye(4), torch.zeros(4))
        self.reduce = reduce

    def forward(self, x):
        return self.reduce(self.fc(x))


def test_maxima_and_minima_along_a_dimension_by_hand():
    x, baseline = torch.tensor([[1.0, 0.0, -1.0, 3.0]], dtype=D), torch.tensor([[0.0, 2.0, 1.0, -1.0]], dtype=D)
    # max: y = 3 (entry 3), y0 = 2 (entry 1): max(y, y0) - y0 = 1 to entry 3, y - max(y, y0) = 0 to entry 1
    for reduce in (lambda h: h.amax(1, keepdim=True), lambda h: torch.max(h, 1).values.unsqueeze(1),
                   lambda h: h.max(dim=1, keepdim=True)[0]):
        ours = assert_complete(Extremum(reduce).to(D).eval(), x, baseline, None)
        torch.testing.assert_close(ours, torch.tensor([[0.0, 0.0, 0.0, 1.0]], dtype=D))
    # min: y = -1 (entry 2), y0 = -1 (entry 3), both shares 0; and a difference that goes to the baseline's winner
    ours = assert_complete(Extremum(lambda h: h.amin(1, keepdim=True)).to(D).eval(), x, baseline, None)
    torch.testing.assert_close(ours, torch.zeros(1, 4, dtype=D))
    ours = assert_complete(Extremum(lambda h: h.min(1, keepdim=True).values).to(D).eval(), x + 1.5, baseline, None)
    # y = 0.5 (entry 2), y0 = -1 (entry 3): min(y, y0) - y0 = 0, y - min(y, y0) = 1.5 to entry 3 (x - x0 = 5.5)
    torch.testing.assert_close(ours, torch.tensor([[0.0, 0.0, 0.0, 1.5]], dtype=D))


def test_an_op_without_an_exact_rule_is_named():
    # the winners differ (entries 3 and 1) and max(x) = max(x0) = 2, but the gradient gives x_3 - x0_3 = 3
    x, baseline = torch.tensor([[1.0, 0.0, -1.0, 2.0]], dtype=D), torch.tensor([[0.0, 2.0, 1.0, -1.0]], dtype=D)
    model = Extremum(lambda h: h.sort(1).values[:, -1:]).to(D).eval()
    with pytest.warns(relprop.ConservationWarning, match=r"Tensor.sort in module '<root>'"):
        DeepLift(model).attribute(x, baseline)


def test_bad_input_and_mixed_examples_give_clear_errors():
    model = sequential("leaky")
    x = torch.randn(2, 3, 8, 8, dtype=D)
    with pytest.raises(ValueError, match="baseline of shape"):
        DeepLift(model).attribute(x, torch.zeros(3, 8, 9, dtype=D))
    with pytest.raises(TypeError, match="floating-point"):
        DeepLift(model).attribute(x.long())
    with pytest.raises(ValueError, match="one tensor of baselines per input"):
        DeepLiftShap(model).attribute(x, 0.0)

    class Mixing(nn.Module):
        def forward(self, x):
            return torch.tanh(x.mean(0, keepdim=True)).expand(x.shape[0], -1)

    with pytest.raises(relprop.RuleError, match=r"torch.tanh in module '<root>'"):
        DeepLift(Mixing().eval()).attribute(torch.randn(2, 3, dtype=D), target=0)


def test_the_model_is_left_as_it_was():
    model = sequential("relu")
    model.train()
    state = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.warns(UserWarning, match="training mode"):
        DeepLift(model).attribute(torch.randn(2, 3, 8, 8, dtype=D), target=0)
    assert all(m.training for m in model.modules())
    assert all(not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks for m in model.modules())
    assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items())


# ------------------------------------------------------------------ whole models

@pytest.mark.slow
@pytest.mark.parametrize("name", architectures.FAMILIES)
def test_completeness_on_torchvision_families(name):
    model, x = architectures.build(name), architectures.images(name)
    assert_complete(model, x, 0.3 * torch.randn_like(x), architectures.TARGET)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_completeness_on_a_tiny_llama(attention, monkeypatch):
    pytest.importorskip("transformers")
    from test_transformers import IDS, build
    from transformers.models.llama import modeling_llama

    model = build("llama", attention)
    embeddings = model.get_input_embeddings()(IDS).detach()
    # as Hugging Face writes it, RMSNorm (and the eager softmax) compute in float32, and the multipliers through
    # them are float32 too: exact up to that rounding
    assert_complete(Embedded(model).eval(), embeddings, torch.zeros_like(embeddings), (-1, 5), rtol=1e-6)

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm)
    if attention == "sdpa":  # every op in float64: exact to rounding
        assert_complete(Embedded(model).eval(), embeddings, 0.5 * embeddings, (-1, 5), rtol=1e-8)


def test_inside_captums_noise_tunnel():
    model = sequential("leaky")
    x = torch.randn(2, 3, 8, 8, dtype=D)
    method = DeepLift(model)
    assert method.has_convergence_delta() and method.get_name() == "Deep Lift"
    torch.manual_seed(5)
    smoothed, delta = captum_attr.NoiseTunnel(method).attribute(x, nt_type="smoothgrad", nt_samples=3, stdevs=0.1,
                                                                target=1, return_convergence_delta=True)
    assert smoothed.shape == x.shape and delta.shape == (6,) and delta.abs().max() < 1e-12


@pytest.mark.parametrize("norm", [lambda h: h.norm(dim=1, keepdim=True), lambda h: torch.norm(h, 3, (1,)).unsqueeze(1),
                                  lambda h: torch.linalg.vector_norm(h, 1.5, dim=-1, keepdim=True)])
def test_vector_norms_are_exact(norm):
    class Normed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x):
            h = self.fc(x)
            return self.out(h * norm(h))  # a global response normalisation's kind of gate

    model = Normed().to(D).eval()
    x, baseline = torch.randn(3, 3, dtype=D), torch.randn(3, 3, dtype=D)
    assert_complete(model, x, baseline, 1, rtol=1e-12)
    # the 2-norm by hand: m (h + h0) / (|h| + |h0|)
    two = Extremum(lambda h: h.norm(dim=1, keepdim=True)).to(D).eval()  # h = x
    x, baseline = torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D)
    expected = (x + baseline) / (x.norm(dim=1, keepdim=True) + baseline.norm(dim=1, keepdim=True)) * (x - baseline)
    torch.testing.assert_close(assert_complete(two, x, baseline, None, rtol=1e-12), expected)
