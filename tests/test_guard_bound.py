"""Never silently wrong, round four (#50): stabilisers that create relevance, the relative stabiliser, and a custom
autograd Function whose forward runs no torch op.

Public API (and the guard's bound, `STABILISER_BOUND`). The tests of the bound and of the Function fail on the code
before #50.
"""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import dlpack

import relprop
from relprop import composites, rules
from relprop.engine.guard import STABILISER_BOUND

LRP0 = composites.Epsilon(0.0)


def _quiet(model, x, composite, target=0, **options):
    """The relevance, asserting that no warning was raised."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return relprop.LRP(model, composite, **options).attribute(x, target=target)


# ---------------------------------------------------------------- a residual sum that nearly cancels
DELTA = 1e-3
X = torch.tensor([[1.0, 10.0]], dtype=torch.float64)
#: the classifier's weights: their products with the sum nearly cancel (the logit is 0.01 of their absolute sum)
HEAD = torch.tensor([[-100.0, 10.1]], dtype=torch.float64)


class Cancelling(nn.Module):
    """``head(x + x * (DELTA - 1))``: a bias-free residual sum that cancels to ``DELTA * x``, and a classifier whose
    terms nearly cancel.

    The relevance of the sum's two inputs is ``1 / DELTA`` times that of its output, of both signs, and the
    epsilon rule's stabiliser at the sum shrinks the relevance of its two outputs by different factors.
    """

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(2, 1, bias=False, dtype=torch.float64)
        self.register_buffer("scale", torch.tensor(DELTA - 1, dtype=torch.float64))
        with torch.no_grad():
            self.head.weight.copy_(HEAD)

    def forward(self, x):
        return self.head(x + x * self.scale)  # the branch's constant factor passes relevance on as it is (Pass)


def _stabilised(z: torch.Tensor, epsilon: float) -> torch.Tensor:
    return z + epsilon * torch.where(z < 0, -1.0, 1.0).to(z)


def _epsilon_totals(epsilon: float) -> tuple[float, float]:
    """The logit, and the epsilon rule on :class:`Cancelling` written out: the relevance of the input, summed."""
    mixed = X[0] + X[0] * (DELTA - 1)
    logit = (HEAD[0] * mixed).sum()
    at_sum = HEAD[0] * mixed * logit / _stabilised(logit, epsilon)  # the classifier's inputs
    return logit.item(), (mixed * at_sum / _stabilised(mixed, epsilon)).sum().item()  # the sum's, both to x


@pytest.mark.parametrize("epsilon", [1e-6, 1e-5, 3e-5, 1e-4])
def test_stabilisers_that_move_the_total_beyond_the_bound_are_reported(epsilon):
    """The relevance is the epsilon rule's, written out. Both ops with a stabiliser conserve but for it, so what
    they changed is the departure of the inputs' total from the seed: reported exactly when it exceeds the bound,
    naming the residual sum."""
    logit, expected = _epsilon_totals(epsilon)
    warns = abs(expected - logit) > STABILISER_BOUND * abs(logit)
    assert warns == (epsilon > 1e-5)  # the cases cover both sides of the bound
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        relevance = relprop.LRP(Cancelling().eval(), composites.Epsilon(epsilon)).attribute(X, target=0)
    assert relevance.sum().item() == pytest.approx(expected, rel=1e-9)
    messages = [str(w.message) for w in caught if issubclass(w.category, relprop.ConservationWarning)]
    assert len(messages) == warns, messages
    if warns:
        (message,) = messages
        assert f"Epsilon(epsilon={epsilon!r}, zero_bias=False) at '<root>' (Tensor.add" in message
        assert f"for a seed of {logit:.3g}" in message and "use a larger epsilon or a conserving rule" in message


def test_strict_mode_raises_on_stabilisers_beyond_the_bound():
    with pytest.raises(relprop.UnsupportedOpError, match=r"the stabilisers of Epsilon.*changed the relevance total"):
        relprop.LRP(Cancelling().eval(), composites.Epsilon(1e-4), strict=True).attribute(X, target=0)


def test_lrp0_conserves_the_cancelling_sum_without_a_warning():
    relevance = _quiet(Cancelling().eval(), X, LRP0)
    assert relevance.sum().item() == pytest.approx(_epsilon_totals(0.0)[0], rel=1e-9)


# ---------------------------------------------------------------- sound uses stay quiet
def _mlp(bias: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32, bias=bias), nn.ReLU(), nn.Linear(32, 32, bias=bias), nn.ReLU(),
                          nn.Linear(32, 4, bias=bias)).double().eval()
    if bias:
        with torch.no_grad():
            for module in model[::2]:
                module.bias.uniform_(-0.5, 0.5)
    return model


def test_biases_that_take_most_of_the_logit_are_not_stabilisers():
    """Biases keep their share by design, of any size: not counted against the bound (the relevance sums to a small
    fraction of the logit, or to several times it, with no warning)."""
    model = _mlp(bias=True)
    x = torch.rand(64, 16, dtype=torch.float64)
    target = model(x).argmax(1)
    for preset in ("epsilon", "epsilon-plus", "epsilon-alpha2-beta1"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            relevance = relprop.LRP(model, preset).attribute(x, target=target)
        kept = relevance.sum(1) / model(x).gather(1, target[:, None])[:, 0]
        assert (kept - 1).abs().min() > 0.5  # the biases took most of every logit


def test_a_large_epsilon_absorbs_most_of_the_seed_without_a_warning():
    """A stabiliser that shrinks relevance towards 0 absorbs at most the seed, of its sign: within the bound."""
    model = _mlp(bias=False)
    x = torch.rand(8, 16, dtype=torch.float64)
    target = model(x).argmax(1)
    relevance = _quiet(model, x, composites.Epsilon(1.0), target=target)
    kept = relevance.sum() / model(x).gather(1, target[:, None]).sum()
    assert 0 < kept < 0.5


# ---------------------------------------------------------------- the case: timm's iformer_t
def _iformer(side: int):
    timm = pytest.importorskip("timm")
    from zoo import zero_biases

    torch.manual_seed(0)
    model = zero_biases(timm.create_model("iformer_t", pretrained=False).double().eval())
    x = torch.randn(2, 3, side, side, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        target = model(x).argmax(1)
    return model, x, target


def _check_iformer(side: int) -> None:
    """Biases and BatchNorm means 0, two images for their own top class: LRP-0 sums to the logits; the epsilon
    preset's stabilisers at the residual sums create many times the seed, reported, and strict mode raises."""
    model, x, target = _iformer(side)
    with torch.no_grad():
        logit = model(x).gather(1, target[:, None])[:, 0]
    relevance = relprop.LRP(model, LRP0, strict=True).attribute(x, target=target)
    torch.testing.assert_close(relevance.flatten(1).sum(1), logit, rtol=1e-6, atol=0)
    with pytest.warns(relprop.ConservationWarning, match=r"the stabilisers of Epsilon.* at 'stages\.2\.blocks\.\d+\."
                                                         r"(mixer|cpe)' \(Tensor\.add") as caught:
        relevance = relprop.LRP(model, "epsilon").attribute(x, target=target)
    assert "mixer'" in str(caught[0].message)
    assert abs(relevance.sum() - logit.sum()) > STABILISER_BOUND * logit.abs().sum()
    with pytest.raises(relprop.UnsupportedOpError, match="the stabilisers of Epsilon"):
        relprop.LRP(model, "epsilon", strict=True).attribute(x, target=target)


def test_iformer_epsilon_is_reported_at_64_px():
    _check_iformer(64)


@pytest.mark.slow
def test_iformer_epsilon_is_reported_at_224_px():
    _check_iformer(224)


# ---------------------------------------------------------------- the relative stabiliser
def _relative_reference(x, weight, bias, relevance, epsilon):
    """``R_i = sum_j x_i w_ji R_j / (z_j + eps m_j sign z_j)``, ``m_j = sum_i |x_i w_ji| + |b_j|``, per row."""
    contributions = x[:, None, :] * weight[None]                                  # (N, out, in)
    z = contributions.sum(-1) + (0 if bias is None else bias)
    m = contributions.abs().sum(-1) + (0 if bias is None else bias.abs())
    denominator = z + epsilon * m * torch.where(z < 0, -1.0, 1.0).to(z)
    return (contributions * (relevance / denominator)[..., None]).sum(1)


@pytest.mark.parametrize("bias", [True, False])
def test_relative_epsilon_on_a_dense_layer_equals_its_matrix_form(bias):
    torch.manual_seed(0)
    layer = nn.Linear(6, 3, bias=bias).double().eval()
    x = torch.randn(5, 6, dtype=torch.float64)
    rule = rules.Epsilon(0.1, relative=True)
    composite = composites.Epsilon(1e-6, dense=rule)
    relevance = relprop.LRP(layer, composite).attribute(x, target=1)
    with torch.no_grad():
        seed = torch.zeros(5, 3, dtype=torch.float64)
        seed[:, 1] = layer(x)[:, 1]
    expected = _relative_reference(x, layer.weight.detach(), None if not bias else layer.bias.detach(), seed, 0.1)
    torch.testing.assert_close(relevance, expected, rtol=1e-10, atol=1e-12)


def test_relative_epsilon_on_a_convolution_equals_the_dense_form():
    """A convolution is a dense layer on its unfolded patches: the same relative stabiliser per output."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, bias=True).double().eval()
    dense = nn.Sequential(nn.Flatten(), nn.Linear(2 * 3 * 3, 3)).double().eval()
    with torch.no_grad():
        dense[1].weight.copy_(conv.weight.flatten(1))
        dense[1].bias.copy_(conv.bias)
    x = torch.randn(4, 2, 3, 3, dtype=torch.float64)
    composite = composites.Epsilon(1e-6, conv=rules.Epsilon(0.05, relative=True),
                                   dense=rules.Epsilon(0.05, relative=True))
    by_conv = relprop.LRP(nn.Sequential(conv, nn.Flatten()).eval(), composite).attribute(x, target=2)
    by_dense = relprop.LRP(dense, composite).attribute(x, target=2)
    torch.testing.assert_close(by_conv, by_dense, rtol=1e-10, atol=1e-12)


def test_relative_epsilon_on_a_residual_sum():
    """On ``x + y``: ``R_x = x R / (z + eps (|x| + |y|) sign z)``, and ``y``'s share likewise."""

    class Sum(nn.Module):
        def __init__(self):
            super().__init__()
            self.branch = nn.Linear(2, 2, bias=False, dtype=torch.float64)

        def forward(self, x):
            return x + self.branch(x)

    model = Sum().eval()
    with torch.no_grad():
        model.branch.weight.copy_((DELTA - 1) * torch.eye(2, dtype=torch.float64))
    composite = composites.Epsilon(0.0, func_map=[(torch.add, rules.Epsilon(0.01, relative=True))])
    explained = relprop.LRP(model, composite).record(X)
    seed = torch.zeros_like(explained.logits)
    seed[0, 0] = 1.0
    (relevance,) = explained.relevance(seed)
    x, branch = X[0, 0].item(), (DELTA - 1) * X[0, 0].item()
    share = 1.0 / ((x + branch) + 0.01 * (abs(x) + abs(branch)))
    # the branch's dense layer (LRP-0, one weight per output) hands its share on to the same input
    assert relevance[0, 0].item() == pytest.approx(x * share + branch * share, rel=1e-10)
    assert relevance[0, 1:].abs().max().item() == 0


def test_relative_epsilon_keeps_zennits_repr_where_unset():
    assert repr(rules.Epsilon(0.25)) == "Epsilon(epsilon=0.25, zero_bias=False)"
    assert repr(rules.Epsilon(0.25, relative=True)) == "Epsilon(epsilon=0.25, zero_bias=False, relative=True)"


# ---------------------------------------------------------------- a custom Function that runs no torch op
class OpaqueReLU(torch.autograd.Function):
    """``relu`` computed on the input's memory through DLPack, as a compiled extension reads it: the forward runs
    no torch function on an activation. Its backward triples the gradient."""

    @staticmethod
    def forward(ctx, x):
        out = torch.relu(dlpack.from_dlpack(dlpack.to_dlpack(x)))
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return 3 * grad * (out > 0)


class _AppliedInside(nn.Module):
    """Applies the Function and reads its output within its own forward: the module does not return it."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return self.inner(OpaqueReLU.apply(x) * 2)


def _opaque_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8, bias=False), _AppliedInside(), nn.Linear(8, 3, bias=False)).double().eval()


def test_a_custom_function_whose_forward_runs_no_torch_op_is_reported():
    model, x = _opaque_net(), torch.randn(4, 6, dtype=torch.float64)
    with pytest.warns(relprop.UnhandledOpWarning, match=r"custom autograd Function .*OpaqueReLU in module '1'"):
        relevance = relprop.LRP(model, LRP0).attribute(x, target=0)
    # its own backward carried the relevance, as a gradient: Gradient x Input of the model as autograd sees it
    leaf = x.clone().requires_grad_()
    (gradient,) = torch.autograd.grad(model(leaf)[:, 0].sum(), leaf)
    torch.testing.assert_close(relevance, gradient * x, rtol=1e-10, atol=1e-12)
    with pytest.raises(relprop.UnsupportedOpError, match="OpaqueReLU"):
        relprop.LRP(model, LRP0, strict=True).attribute(x, target=0)


def test_a_custom_function_whose_forward_runs_no_torch_op_takes_its_func_map_rule():
    """``func_map={OpaqueReLU: Pass()}``: LRP-0 of the network with a plain ReLU there (the relevance crosses it
    unchanged), no warning."""
    model, x = _opaque_net(), torch.randn(4, 6, dtype=torch.float64)
    composite = composites.Epsilon(0.0, func_map={OpaqueReLU: rules.Pass()})
    relevance = _quiet(model, x, composite, strict=True)

    class Plain(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, h):
            return self.inner(F.relu(h) * 2)

    plain = nn.Sequential(model[0], Plain(copy.deepcopy(model[1].inner)), model[2]).eval()
    torch.testing.assert_close(relevance, _quiet(plain, x, LRP0), rtol=1e-10, atol=1e-12)
