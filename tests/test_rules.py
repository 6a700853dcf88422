"""Every linear rule against an explicit matrix-form reference (docs/design.md, section 2), float64.

A layer is written as z_k = sum_j a_j w_jk + b_k with W read off its Jacobian
and b off its output at zero input; the reference formulas below use only
that matrix, never the engine.
"""
import math

import pytest
import torch
from torch import nn

import relprop
from conftest import randomize_batch_norms
from relprop import rules


def stabilize(z, eps):
    return z + eps * torch.where(z >= 0, 1.0, -1.0).to(z)


def divide(numerator, denominator):
    """``numerator / denominator``, 0 where the denominator is exactly 0 (docs/design.md: never NaN)."""
    return torch.where(denominator == 0, 0.0, numerator / torch.where(denominator == 0, 1.0, denominator))


def matrix_form(layer, in_shape):
    """W (n_in x n_out) and b (n_out) of ``layer`` on inputs of shape ``in_shape``."""
    zero = torch.zeros(1, *in_shape, dtype=torch.float64)
    bias = layer(zero).detach().flatten()

    def linear_part(flat):
        return (layer(flat.reshape(1, *in_shape)).flatten() - bias)

    jacobian = torch.autograd.functional.jacobian(linear_part, zero.flatten())  # n_out x n_in
    return jacobian.T, bias


def reference(rule, a, W, b, R, low=None, high=None):
    """Relevance of the inputs ``a`` (flat) for output relevance ``R`` (flat), from the formulas."""
    Wp, Wn, ap, an = W.clamp(min=0), W.clamp(max=0), a.clamp(min=0), a.clamp(max=0)
    if isinstance(rule, rules.Epsilon):
        z = a @ W + (0 if rule.zero_bias else b)
        return a * (W @ divide(R, stabilize(z, rule.epsilon)))
    if isinstance(rule, rules.ZPlus):
        s = divide(R, stabilize(ap @ Wp + an @ Wn + b.clamp(min=0), rule.stabilizer))
        return ap * (Wp @ s) + an * (Wn @ s)
    if isinstance(rule, rules.AlphaBeta):
        sp = divide(R, stabilize(ap @ Wp + an @ Wn + b.clamp(min=0), rule.stabilizer))
        sn = divide(R, stabilize(ap @ Wn + an @ Wp + b.clamp(max=0), rule.stabilizer))
        return rule.alpha * (ap * (Wp @ sp) + an * (Wn @ sp)) - rule.beta * (ap * (Wn @ sn) + an * (Wp @ sn))
    if isinstance(rule, rules.Gamma):
        g = rule.gamma
        up, down = W + g * Wp, W + g * Wn
        b = torch.zeros_like(b) if rule.zero_bias else b  # also out of the z whose sign picks the group
        z = a @ W + b
        sp = divide(R * (z > 0), stabilize(ap @ up + an @ down + b + g * b.clamp(min=0), rule.stabilizer))
        sn = divide(R * (z < 0), stabilize(ap @ down + an @ up + b + g * b.clamp(max=0), rule.stabilizer))
        return ap * (up @ sp) + an * (down @ sp) + ap * (down @ sn) + an * (up @ sn)
    if isinstance(rule, rules.ZBox):
        s = divide(R, stabilize(a @ W - low @ Wp - high @ Wn, rule.stabilizer))
        return a * (W @ s) - low * (Wp @ s) - high * (Wn @ s)
    if isinstance(rule, rules.Flat):
        ones = (W != 0).to(W)
        return ones @ divide(R, stabilize(ones.sum(0), rule.stabilizer))
    if isinstance(rule, rules.WSquare):
        squares = W * W
        return squares @ divide(R, stabilize(squares.sum(0) + b * b, rule.stabilizer))
    raise AssertionError(rule)


def _with_batch_norm(layer: nn.Module, batch_norm: nn.Module) -> nn.Sequential:
    return randomize_batch_norms(nn.Sequential(layer, batch_norm))


def _layer_bias(layer: nn.Module) -> nn.Parameter:
    return (layer[0] if isinstance(layer, nn.Sequential) else layer).bias


LAYERS = {
    "linear": (lambda bias: nn.Linear(6, 4, bias=bias), (6,)),
    "conv1d": (lambda bias: nn.Conv1d(2, 3, 3, padding=1, bias=bias), (2, 7)),
    "conv2d": (lambda bias: nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=bias), (2, 6, 5)),
    "conv3d": (lambda bias: nn.Conv3d(2, 2, 2, padding=1, bias=bias), (2, 3, 3, 2)),
    "conv_transpose2d": (lambda bias: nn.ConvTranspose2d(2, 3, 3, stride=2, bias=bias), (2, 3, 3)),
    "grouped-conv2d": (lambda bias: nn.Conv2d(2, 4, 3, padding=1, groups=2, bias=bias), (2, 6, 5)),
    # the engine merges the BatchNorm into the layer (signed scales): the rule sees the merged weight and bias
    "linear+batch_norm": (lambda bias: _with_batch_norm(nn.Linear(6, 4, bias=bias), nn.BatchNorm1d(4)), (6,)),
    "conv2d+batch_norm": (lambda bias: _with_batch_norm(nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=bias),
                                                        nn.BatchNorm2d(3)), (2, 6, 5)),
}

RULES = {
    "lrp0": rules.Epsilon(0.0),
    "epsilon": rules.Epsilon(0.25),
    "epsilon-zero-bias": rules.Epsilon(0.25, zero_bias=True),
    "zplus": rules.ZPlus(stabilizer=1e-3),
    "alpha2beta1": rules.AlphaBeta(2.0, 1.0, stabilizer=1e-3),
    "alpha1beta0": rules.AlphaBeta(1.0, 0.0),
    "gamma": rules.Gamma(0.5, stabilizer=1e-3),
    "gamma-unstabilised": rules.Gamma(0.5, stabilizer=0.0),
    "gamma0": rules.Gamma(0.0, stabilizer=1e-3),
    "gamma-zero-bias": rules.Gamma(0.5, stabilizer=1e-3, zero_bias=True),
    "flat": rules.Flat(),
    "wsquare": rules.WSquare(),
}


# non-negative inputs take the fast forms; an input of zeros without bias gives z = 0 (no relevance, no NaN)
@pytest.mark.parametrize("sign", ["signed", "nonnegative", "nonnegative-zero"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("layer_name", LAYERS)
@pytest.mark.parametrize("rule_name", RULES)
def test_rule_matches_matrix_form(layer_name, rule_name, bias, sign, monkeypatch):
    make, in_shape = LAYERS[layer_name]
    layer = make(bias).double().eval()
    if bias:
        with torch.no_grad():
            _layer_bias(layer).uniform_(-0.5, 0.5)
    rule = RULES[rule_name]
    x = torch.randn(2, *in_shape, dtype=torch.float64)
    if sign != "signed":
        x = x.relu()
    if sign == "nonnegative-zero":
        x[1] = 0.0
    out = layer(x)
    R = torch.randn_like(out)
    # z+ and alpha-beta on a signed input stack x+ and x- side by side, and W+ and W- to match: one product each
    # way instead of two; a grouped convolution's weight does not allow that
    stacked, stack_signs = [], relprop.engine.ParametricCall.stack_signs

    def recorded(call, inputs):
        found = stack_signs(call, inputs)
        stacked.append(found is not None)
        return found

    monkeypatch.setattr(relprop.engine.ParametricCall, "stack_signs", recorded)
    attributed = relprop.LRP(layer, relprop.Composite(conv=rule, dense=rule)).attribute(x, target=R)
    signed_split = isinstance(rule, (rules.ZPlus, rules.AlphaBeta)) and sign == "signed"
    assert stacked == ([layer_name != "grouped-conv2d"] if signed_split else [])
    W, b = matrix_form(layer, in_shape)
    for example in range(2):
        expected = reference(rule, x[example].flatten(), W, b, R[example].flatten())
        torch.testing.assert_close(attributed[example].flatten(), expected, rtol=1e-10, atol=1e-12)


class _ShiftInPlace(nn.Module):
    def forward(self, x):
        return x.sub_(0.5)


class _TorchRelu(nn.Module):
    def forward(self, x):
        return torch.relu(x)


@pytest.mark.parametrize("between", ["relu", "relu-in-place", "torch-relu", "relu-then-shift-in-place"])
@pytest.mark.parametrize("rule_name", ["zplus", "alpha2beta1", "gamma"])
def test_a_relu_output_takes_the_fast_form_without_a_sign_check(rule_name, between, monkeypatch):
    """The input of a layer that reads a ReLU's output is known to be >= 0: no pass over it to check the sign.

    An in-place op after the ReLU may make entries negative: the layer checks again.
    """
    make, in_shape = LAYERS["conv2d+batch_norm"]
    layer = make(True).double().eval()
    activation = {"relu": nn.ReLU(), "relu-in-place": nn.ReLU(inplace=True),
                  "relu-then-shift-in-place": nn.Sequential(nn.ReLU(inplace=True), _ShiftInPlace()),
                  "torch-relu": _TorchRelu()}[between]
    model = nn.Sequential(activation, layer).eval()
    checks = []
    amin = torch.Tensor.amin
    monkeypatch.setattr(torch.Tensor, "amin", lambda self, *a, **k: checks.append(self.shape) or amin(self, *a, **k))
    x = torch.randn(2, *in_shape, dtype=torch.float64)
    a = x.relu() - 0.5 if between == "relu-then-shift-in-place" else x.relu()
    out = model(x.clone())
    R = torch.randn_like(out)
    checks.clear()
    rule = RULES[rule_name]
    attributed = relprop.LRP(model, relprop.Composite(conv=rule)).attribute(x, target=R)
    assert len(checks) == (1 if between == "relu-then-shift-in-place" else 0)
    W, b = matrix_form(layer, in_shape)
    for example in range(2):
        expected = reference(rule, a[example].flatten(), W, b, R[example].flatten())
        if between != "relu-then-shift-in-place":  # the ReLU passes the relevance of its output on as it is
            torch.testing.assert_close(attributed[example].flatten(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("sign", ["signed", "nonnegative"])
@pytest.mark.parametrize("rule_name", RULES)
def test_rule_matches_matrix_form_where_an_output_is_exactly_zero(rule_name, sign):
    """Contributions that cancel exactly (z = 0 with nonzero inputs) and relevance arriving there anyway."""
    layer = nn.Linear(6, 3).double().eval()
    with torch.no_grad():
        layer.weight[0] = torch.tensor([0.5, -0.5, 0.75, -0.75, 0.25, -0.25])
        layer.bias.uniform_(-0.5, 0.5)
        layer.bias[0] = 0.0
    x = torch.rand(2, 6, dtype=torch.float64) if sign == "nonnegative" else torch.randn(2, 6, dtype=torch.float64)
    x[:, 1], x[:, 3], x[:, 4:] = x[:, 0], x[:, 2], 0.0
    out = layer(x)
    assert torch.all(out[:, 0] == 0)
    R = torch.randn_like(out)
    rule = RULES[rule_name]
    attributed = relprop.LRP(layer, relprop.Composite(dense=rule)).attribute(x, target=R)
    W, b = matrix_form(layer, (6,))
    for example in range(2):
        expected = reference(rule, x[example], W, b, R[example])
        torch.testing.assert_close(attributed[example], expected, rtol=1e-10, atol=1e-12)


class _Reference(rules.Rule):
    """``rule``'s reference form (BasicRule.reference) on every conv/dense call, whatever form the rule takes."""

    kinds = rules.PARAMETRIC_KINDS

    def __init__(self, rule):
        self.rule = rule

    def propagate(self, call, relevance):
        return (self.rule.reference(call, relevance),)


@pytest.mark.parametrize("form", ["rule", "reference"])
@pytest.mark.parametrize("sign", ["signed", "nonnegative"])
@pytest.mark.parametrize("layer_name", ["linear", "conv2d", "conv2d+batch_norm"])
def test_gamma_without_bias_picks_its_group_by_the_bias_free_output(layer_name, sign, form):
    """Gamma(zero_bias=True) shares by the sign of z - b, its terms' own sum, also where the bias flips z's sign.

    By the biased sign it divided by a bias-free sum of the other sign, or near 0 (-7e30 at the pixels of
    EfficientNet-Lite0). "rule" is whichever form the rule takes on the call (fused where a kernel serves it).
    """
    torch.manual_seed(3)
    make, in_shape = LAYERS[layer_name]
    layer = make(True).double().eval()
    with torch.no_grad():  # large enough to outweigh the inputs' part of many outputs, of both signs
        bias = _layer_bias(layer)
        bias.copy_(2.0 * (-1.0) ** torch.arange(len(bias)))
    x = torch.randn(2, *in_shape, dtype=torch.float64)
    if sign == "nonnegative":
        x = x.relu()
    W, b = matrix_form(layer, in_shape)
    flat = x.flatten(1)
    assert (torch.sign(flat @ W + b) != torch.sign(flat @ W)).sum() >= 4, "the bias flips some outputs' sign"
    rule = rules.Gamma(0.25, stabilizer=1e-6, zero_bias=True)
    used = rule if form == "rule" else _Reference(rule)
    out = layer(x)
    R = torch.randn_like(out)
    attributed = relprop.LRP(layer, relprop.Composite(conv=used, dense=used)).attribute(x, target=R)
    for example in range(2):
        expected = reference(rule, flat[example], W, b, R[example].flatten())
        torch.testing.assert_close(attributed[example].flatten(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bounds", ["per-channel", "scalar", "per-position"])
@pytest.mark.parametrize("layer_name", ["linear", "conv2d", "conv3d", "conv2d+batch_norm", "conv_transpose2d",
                                        "grouped-conv2d"])
def test_zbox_matches_matrix_form(layer_name, bounds, monkeypatch):
    make, in_shape = LAYERS[layer_name]
    layer = make(True).double().eval()
    channels = in_shape[-1] if layer_name == "linear" else in_shape[0]
    bound_shape = (1, channels) if layer_name == "linear" else (1, channels) + (1,) * (len(in_shape) - 1)
    low = -torch.linspace(1.0, 2.0, channels, dtype=torch.float64).reshape(bound_shape)
    high = torch.linspace(1.5, 3.0, channels, dtype=torch.float64).reshape(bound_shape)
    if bounds == "scalar":
        low, high = -1.5, 2.0
    elif bounds == "per-position":
        low = low - torch.rand(1, *in_shape, dtype=torch.float64)
        high = high + torch.rand(1, *in_shape, dtype=torch.float64)
    x = torch.max(torch.min(torch.randn(2, *in_shape, dtype=torch.float64), torch.as_tensor(high)),
                  torch.as_tensor(low))
    rule = rules.ZBox(low, high, stabilizer=1e-3)
    # bounds the same at every position of a channel are folded into one weight, l W+ + h W-, but not into a
    # grouped convolution's
    folded, bound_weight = [], relprop.rules.kernels._Box._bound_weight

    def recorded(*args):
        weight = bound_weight(*args)
        folded.append(weight is not None)
        return weight

    monkeypatch.setattr(relprop.rules.kernels._Box, "_bound_weight", recorded)
    R = torch.randn_like(layer(x))
    attributed = relprop.LRP(layer, relprop.Composite(conv=rule, dense=rule)).attribute(x, target=R)
    # (a dense layer's positions are its input channels)
    assert folded == [layer_name != "grouped-conv2d" and (bounds != "per-position" or layer_name == "linear")]
    W, b = matrix_form(layer, in_shape)
    low_flat, high_flat = (torch.as_tensor(bound, dtype=torch.float64).expand_as(x[:1]).flatten()
                           for bound in (low, high))
    for example in range(2):
        expected = reference(rule, x[example].flatten(), W, b, R[example].flatten(), low_flat, high_flat)
        torch.testing.assert_close(attributed[example].flatten(), expected, rtol=1e-10, atol=1e-12)


def test_denominator_sign_of_zero_is_positive_and_never_nan():
    z = torch.tensor([-2.0, 0.0, 3.0], dtype=torch.float64)
    assert rules.denominator(z, 0.5).tolist() == [-2.5, 0.5, 3.5]
    assert (1.0 / rules.denominator(z, 0.0)).tolist() == [-0.5, 0.0, 1 / 3]


def test_inverse_of_lrp0_is_0_where_the_division_overflows_and_nan_stays_nan():
    z = torch.tensor([4.0, 0.0, -0.0, -0.5, 1e-320, math.inf, math.nan], dtype=torch.float64)
    inverse = rules.inverse_denominator(z, 0.0)
    assert inverse.tolist()[:6] == [0.25, 0.0, 0.0, -2.0, 0.0, 0.0] and math.isnan(inverse[6])
    assert rules.inverse_denominator(z[:4], 0.5).tolist() == [1 / 4.5, 2.0, -2.0, -1.0]


def test_inverse_of_an_in_place_relu_output_is_written_into_it():
    for epsilon, expected in ((0.0, [0.25, 0.0, 0.0, 0.0]), (0.5, [1 / 4.5, 2.0, 2.0, 0.0])):
        z = torch.tensor([4.0, 0.0, 1e-320, math.inf], dtype=torch.float64)
        inverse = rules.inverse_denominator(z, epsilon, in_place=True)
        assert inverse.data_ptr() == z.data_ptr() and inverse.tolist() == expected


@pytest.mark.parametrize("rule", [rules.Epsilon(0.0), rules.Epsilon(), rules.ZPlus(), rules.AlphaBeta(), rules.Gamma(),
                                  rules.Flat(), rules.WSquare()], ids=repr)
def test_no_nan_for_zero_input_and_dead_layer(rule):
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 2)).double().eval()
    with torch.no_grad():
        model[0].bias.fill_(-100.0)  # dead layer: every ReLU output is zero
    composite = relprop.Composite(epsilon=0.0, conv=rule, dense=rule)
    for x in (torch.zeros(1, 2, 4, 4, dtype=torch.float64), torch.randn(1, 2, 4, 4, dtype=torch.float64)):
        relevance = relprop.LRP(model, composite).attribute(x, target=0)
        assert torch.isfinite(relevance).all()


def test_pass_hands_relevance_through_a_shape_preserving_layer():
    conv = nn.Conv2d(2, 2, 3, padding=1).double().eval()
    x = torch.randn(1, 2, 5, 5, dtype=torch.float64)
    R = torch.randn(1, 2, 5, 5, dtype=torch.float64)
    relevance = relprop.LRP(conv, relprop.Composite(conv=rules.Pass())).attribute(x, target=R)
    assert torch.equal(relevance, R)


def test_alpha_beta_checks_its_parameters():
    with pytest.raises(ValueError, match="alpha - beta = 1"):
        rules.AlphaBeta(2.0, 2.0)


class _SquaredWeights(rules.BasicRule):
    """A new rule written as a user would: lambdas for its parts, no protocol flag. Inputs of 0 get relevance."""

    def __init__(self, epsilon=1e-3):
        super().__init__([rules.Term(lambda x: torch.ones_like(x), lambda w: w * w)],
                         lambda relevance, outputs, z: [relevance * (z != 0) / rules.denominator(outputs[0], epsilon)])


def _relu_net(in_place):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(inplace=in_place), nn.Linear(5, 3)).double().eval()


def test_a_new_rule_without_flags_is_right_after_an_in_place_relu():
    """The rule after an in-place ReLU gives relevance to the entries the ReLU set to 0, and reads its own z.

    Safe defaults: the engine then gives the layer before the ReLU its true output back, and keeps the rule's
    output. The same net with an out-of-place ReLU, where no such question arises, is the reference; the rule
    with a wrong flag (claiming inputs of 0 get no relevance) differs from it.
    """
    x = torch.randn(4, 6, dtype=torch.float64)
    rule = _SquaredWeights()
    assert rule.needs_output and not rule.zero_for_zero_input and rule.kernel is None

    def explain(model, rule):
        composite = relprop.Composite(dense=rules.Epsilon(0.1), name_map=[("2", rule)])
        return relprop.LRP(model, composite).attribute(x.clone(), target=1)

    expected = explain(_relu_net(in_place=False), rule)
    torch.testing.assert_close(explain(_relu_net(in_place=True), rule), expected, rtol=1e-12, atol=1e-12)
    wrong = _SquaredWeights()
    wrong.zero_for_zero_input = True
    assert not torch.allclose(explain(_relu_net(in_place=True), wrong), expected)


class _DenseEpsilon(rules.Rule):
    """The epsilon rule on dense layers from scratch; it reads the output in propagate and sets no flag."""

    kinds = frozenset({"dense"})

    def propagate(self, call, relevance):
        (x,) = call.inputs
        return (x * ((relevance / rules.denominator(call.output, 0.25)) @ call.weight),)


class _PreparedEpsilon(_DenseEpsilon):
    """The same, the quotient prepared from the output: the engine may drop the output once prepared."""

    needs_output = False

    def prepare(self, call):
        return 1 / rules.denominator(call.output, 0.25)

    def propagate(self, call, relevance):
        (x,) = call.inputs
        return (x * ((relevance * call.prepared) @ call.weight),)


@pytest.mark.parametrize("rule", [_DenseEpsilon(), _PreparedEpsilon()], ids=lambda rule: type(rule).__name__)
def test_a_rule_from_scratch_without_flags_equals_the_built_in(rule):
    assert _PreparedEpsilon.prepares  # derived from the prepare() it defines
    x = torch.randn(4, 6, dtype=torch.float64)
    mine = relprop.LRP(_relu_net(in_place=True), relprop.Composite(dense=rule)).attribute(x.clone(), target=1)
    builtin = relprop.LRP(_relu_net(in_place=True), relprop.Composite(dense=rules.Epsilon(0.25))).attribute(x, target=1)
    torch.testing.assert_close(mine, builtin, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("norm", [torch.nn.LayerNorm(6), torch.nn.GroupNorm(2, 6)], ids=["layer", "group"])
def test_a_norm_hands_on_the_epsilon_relevance_of_its_map_with_the_standard_deviation_held_constant(norm):
    torch.manual_seed(0)
    norm = norm.double().eval()
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
    x = torch.randn(3, 6, 4, dtype=torch.float64) if isinstance(norm, torch.nn.GroupNorm) else \
        torch.randn(3, 4, 6, dtype=torch.float64)
    eps = 1e-9
    relevance = relprop.LRP(norm, relprop.Composite(epsilon=eps)).attribute(x, target=2)

    # the linear map with the standard deviation a constant, from its definition, and the epsilon rule through it
    leaf = x.clone().requires_grad_()
    grouped = leaf.reshape(3, norm.num_groups, -1) if isinstance(norm, torch.nn.GroupNorm) else leaf
    dims = (-1,) if isinstance(norm, torch.nn.GroupNorm) else tuple(range(-len(norm.normalized_shape), 0))
    centred = grouped - grouped.mean(dims, keepdim=True)
    std = torch.sqrt(grouped.detach().var(dims, unbiased=False, keepdim=True) + norm.eps)
    scaled = (centred / std).reshape(x.shape)
    shape = (1, -1, 1) if isinstance(norm, torch.nn.GroupNorm) else (-1,)
    z = scaled * norm.weight.detach().reshape(shape) + norm.bias.detach().reshape(shape)
    seed = torch.zeros_like(z)
    seed[:, 2] = z.detach()[:, 2]  # target 2: index 2 of dimension 1 of the output, per example
    stabilised = z.detach() + eps * torch.where(z.detach() < 0, -1.0, 1.0)
    (grad,) = torch.autograd.grad(z, leaf, seed / stabilised)
    torch.testing.assert_close(relevance, x * grad, rtol=0, atol=1e-12)
