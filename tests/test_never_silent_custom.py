"""Never silently wrong, round three (#37): custom autograd Functions, relevance that leaves the ops' account,
and a fused attention whose value is a gate.

Public API only. Each test fails on the code before #37.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import relprop

LRP0 = relprop.composites.Epsilon(0.0)


# ---------------------------------------------------------------- custom autograd Functions
class RoundSTE(torch.autograd.Function):
    """A straight-through estimator: ``round(4 x) / 4`` forward, the gradient passed on as it is."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(4 * x) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class TripledReLU(torch.autograd.Function):
    """``relu(x)`` forward, ``3 g (x > 0)`` backward: a backward that is not the forward's gradient."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.relu(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * grad * (x > 0)


class SetupContextReLU(torch.autograd.Function):
    """The same as :class:`TripledReLU`, written with ``setup_context`` (forward without ``ctx``)."""

    @staticmethod
    def forward(x):
        return torch.relu(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * grad * (x > 0)


class _Applied(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, x):
        return self.function.apply(x)


def _relu_net(function, last: bool = False) -> nn.Module:
    """A bias-free ReLU network with ``function`` as one activation (module ``act``); float64."""
    layers = [nn.Linear(6, 8, bias=False), _Applied(function), nn.Linear(8, 8, bias=False), nn.ReLU(),
              nn.Linear(8, 3, bias=False)]
    if last:  # the Function's output is the model's output
        layers = layers[:-1] + [nn.Linear(8, 3, bias=False), _Applied(function)]
    model = nn.Sequential(*layers).double().eval()
    return model


def _gradient_times_input(model, x, target=0):
    x = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(model(x)[:, target].sum(), x)
    return grad * x


def _name(function) -> str:
    return f"{function.__module__}.{function.__qualname__}"


@pytest.mark.parametrize("function", [RoundSTE, TripledReLU, SetupContextReLU])
def test_a_custom_function_is_reported_with_its_class_and_module(function):
    """Relevance that crosses a custom autograd Function is reported: the class, and the module that applied it."""
    model = _relu_net(function)
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.warns(relprop.UnhandledOpWarning) as caught:
        relprop.LRP(model, LRP0).attribute(x, target=0)
    messages = [str(w.message) for w in caught if issubclass(w.category, relprop.UnhandledOpWarning)]
    assert any(_name(function) in m and "module '1'" in m for m in messages), messages


@pytest.mark.parametrize("function", [RoundSTE, TripledReLU])
def test_a_custom_function_raises_in_strict_mode(function):
    model = _relu_net(function)
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.raises(relprop.UnsupportedOpError, match=function.__qualname__):
        relprop.LRP(model, LRP0, strict=True).attribute(x, target=0)


def test_a_custom_function_at_the_output_is_reported():
    model = _relu_net(TripledReLU, last=True)
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.warns(relprop.UnhandledOpWarning, match="TripledReLU"):
        relprop.LRP(model, LRP0).attribute(x, target=0)


def test_the_audit_counts_a_custom_function_as_an_op_without_a_rule():
    """The Function's own backward carries the relevance, as a gradient, and the audit lists it with rule "none"."""
    model = _relu_net(TripledReLU)
    x = torch.randn(4, 6, dtype=torch.float64)
    report = relprop.audit(model, x, target=0, composite=LRP0)
    (row,) = report.unhandled
    assert row.module == "1" and "TripledReLU" in row.op
    # its backward triples the relevance crossing it, and the row shows it
    assert row.relevance_out == pytest.approx(3 * row.relevance_in, rel=1e-9)
    assert abs(report.unaccounted) < 1e-9 * abs(report.seed_total)
    # the relevance is what the Function's backward makes of it: Gradient x Input of the model as autograd sees it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", relprop.UnhandledOpWarning)
        relevance = relprop.LRP(model, LRP0).attribute(x, target=0)
    torch.testing.assert_close(relevance, _gradient_times_input(model, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("function", [RoundSTE, TripledReLU, SetupContextReLU])
def test_func_map_gives_a_custom_function_a_rule(function):
    """``func_map={Function: rules.Pass()}``: the relevance crosses it unchanged, with no warning.

    On a ReLU network with the ReLU as a Function, that is LRP-0 of the plain network: Gradient x Input
    with the ReLU's true gradient (a third of what the tripled backward gives).
    """
    model = _relu_net(function)
    x = torch.randn(4, 6, dtype=torch.float64)
    composite = relprop.composites.Epsilon(0.0, func_map={function: relprop.rules.Pass()})
    relevance = relprop.LRP(model, composite, strict=True).attribute(x, target=0)
    report = relprop.audit(model, x, target=0, composite=composite)
    assert not report.unhandled
    assert any(function.__qualname__ in row.op and row.rule == "Pass()" for row in report.rows)
    if function is RoundSTE:  # not piecewise linear: Pass conserves, the bias-free network conserves
        with torch.no_grad():
            logit = model(x)[:, 0]
        torch.testing.assert_close(relevance.sum(1), logit, rtol=1e-9, atol=1e-12)
        return
    plain = nn.Sequential(model[0], nn.ReLU(), *model[2:])
    torch.testing.assert_close(relevance, _gradient_times_input(plain, x), rtol=1e-10, atol=1e-12)


def test_func_map_refuses_a_rule_a_custom_function_cannot_take():
    with pytest.raises(ValueError, match="custom autograd Function .*TripledReLU.*Pass"):
        relprop.composites.Epsilon(0.0, func_map={TripledReLU: relprop.rules.ZPlus()})


def test_func_map_gradient_uses_the_functions_backward_without_a_warning():
    model = _relu_net(TripledReLU)
    x = torch.randn(4, 6, dtype=torch.float64)
    composite = relprop.composites.Epsilon(0.0, func_map={TripledReLU: relprop.rules.Gradient()})
    relevance = relprop.LRP(model, composite, strict=True).attribute(x, target=0)
    torch.testing.assert_close(relevance, _gradient_times_input(model, x), rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- the relevance's account
def test_an_op_whose_rule_conserves_but_does_not_is_named():
    """A rule that says it conserves exactly (no stabiliser) but hands on a different total is named, the
    largest imbalance first, with its module."""

    class HalfPass(relprop.rules.Pass):
        def propagate(self, call, relevance):
            return (0.5 * relevance,)

    model = nn.Sequential(nn.Linear(4, 6, bias=False), nn.Tanh(), nn.Linear(6, 2, bias=False)).double().eval()
    composite = relprop.composites.Epsilon(0.0, func_map={torch.tanh: HalfPass()})
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.warns(relprop.ConservationWarning, match=r"tanh in module '1'.*conserves exactly"):
        relprop.LRP(model, composite).attribute(x, target=0)


def test_relevance_lost_out_of_sight_is_reported():
    """Relevance that leaves the ops' account (here: a hook on the logits halves it before any op's rule sees
    it) is reported: the seed is not the inputs' relevance plus what the ops absorbed."""
    model = nn.Sequential(nn.Linear(4, 6, bias=False), nn.ReLU(), nn.Linear(6, 2, bias=False)).double().eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    for strict in (False, True):
        explained = relprop.LRP(model, LRP0, strict=strict).record(x)
        explained.logits.register_hook(lambda grad: 0.5 * grad)
        seed = relprop.output_relevance(explained.logits, 0)
        if strict:
            with pytest.raises(relprop.UnsupportedOpError, match="not accounted for"):
                explained.relevance(seed)
        else:
            with pytest.warns(relprop.ConservationWarning, match="not accounted for"):
                explained.relevance(seed)


def test_an_attribution_that_accounts_for_everything_is_quiet():
    """Biases and stabilisers absorb by design: no warning where the account balances."""
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).double().eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for preset in ("epsilon", "epsilon-plus-flat", "attnlrp", "cp-lrp"):
            relprop.LRP(model, preset).attribute(x, target=0)


# ---------------------------------------------------------------- iformer's attention (timm's SHMA)
class _ModulatedAttention(nn.Module):
    """timm iformer's single-head modulation attention, bias-free: ``v, gate = sigmoid(x W).chunk(2)``,
    ``proj(attention(q, k, v) * gate)`` in a residual, then a mean and a classifier.

    The values are sigmoid outputs; with small activations they are about 1/2 whatever the input, and the
    attention weights about uniform.
    """

    def __init__(self, fused: bool, dim: int = 8):
        super().__init__()
        self.fused = fused
        self.q, self.k = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.v_gate = nn.Linear(dim, 2 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.head = nn.Linear(dim, 3, bias=False)

    def forward(self, x):
        v, gate = torch.sigmoid(self.v_gate(x)).chunk(2, dim=-1)
        q, k = self.q(x), self.k(x)
        if self.fused:
            attended = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]
        else:
            weights = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(-1)
            attended = weights @ v
        return self.head((x + self.proj(attended * gate)).mean(1))


def _modulated(fused: bool) -> nn.Module:
    torch.manual_seed(0)
    return _ModulatedAttention(fused).double().eval()


@pytest.mark.parametrize("fused", [True, False])
def test_lrp0_conserves_on_a_bias_free_modulated_attention(fused):
    """LRP-0 on a bias-free model: the relevance sums to the logit (before #37 the fused attention handed on
    about half of what arrived, the half its uniform split gave the weights: on timm's iformer_t, 27 to 140
    times the logit at the input, no warning)."""
    model = _modulated(fused)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    with torch.no_grad():
        logit = model(x)[:, 1]
    relevance = relprop.LRP(model, LRP0, strict=True).attribute(x, target=1)
    torch.testing.assert_close(relevance.sum((1, 2)), logit, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("preset", ["epsilon", "attnlrp", "cp-lrp"])
def test_modulated_attention_eager_equals_fused(preset):
    """The fused attention takes the rules its decomposition takes (the values are sigmoid outputs)."""
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    eager, fused = (relprop.LRP(_modulated(f), preset).attribute(x, target=1) for f in (False, True))
    torch.testing.assert_close(fused, eager, rtol=1e-9, atol=1e-12)


class _AppliedInside(nn.Module):
    """Applies the Function in the middle of its forward; a child module reads the output."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return self.inner(TripledReLU.apply(x) * 2)


def test_a_custom_function_inside_a_module_is_named_after_that_module():
    model = nn.Sequential(nn.Linear(6, 8, bias=False), _AppliedInside(), nn.Linear(8, 3, bias=False)).double().eval()
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.warns(relprop.UnhandledOpWarning, match=r"TripledReLU in module '1'"):
        relprop.LRP(model, LRP0).attribute(x, target=0)
