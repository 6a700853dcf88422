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
