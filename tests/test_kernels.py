"""Every fused form (relprop.kernels) against its rule's reference form (BasicRule.reference), float64.

A rule is defined once, by its terms; a kernel is only a faster way to
compute the same relevance. Here each kernel runs on the calls it serves and
must agree with the reference form of the same rule on the same call: conv
and dense layers, signed and non-negative inputs (with an example of zeros),
with and without bias, grouped, strided and transposed convolutions, a merged
BatchNorm. The matrix-form references of docs/design.md are in test_rules.py.
"""
import pytest
import torch
from conftest import randomize_batch_norms
from torch import nn

import relprop
from relprop import rules
from relprop.rules import kernels
from relprop.workflows.mnist import SmallCNN

LAYERS = {
    "linear": (lambda bias: nn.Linear(6, 4, bias=bias), (6,)),
    "linear-3d": (lambda bias: nn.Linear(6, 4, bias=bias), (3, 6)),
    "conv1d": (lambda bias: nn.Conv1d(2, 3, 3, padding=1, bias=bias), (2, 7)),
    "conv2d-stride2": (lambda bias: nn.Conv2d(3, 4, 3, stride=2, padding=1, bias=bias), (3, 7, 6)),
    "conv3d": (lambda bias: nn.Conv3d(2, 2, 2, padding=1, bias=bias), (2, 3, 3, 2)),
    "conv_transpose2d": (lambda bias: nn.ConvTranspose2d(2, 3, 3, stride=2, bias=bias), (2, 3, 3)),
    "grouped-conv2d": (lambda bias: nn.Conv2d(4, 6, 3, padding=1, groups=2, bias=bias), (4, 6, 5)),
    "dilated-grouped-conv2d": (lambda bias: nn.Conv2d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2, bias=bias),
                               (4, 7, 6)),
    "conv2d+batch_norm": (lambda bias: randomize_batch_norms(nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=bias), nn.BatchNorm2d(3))), (2, 6, 5)),
}

RULES = {
    "zplus": lambda shape, axis: rules.ZPlus(stabilizer=1e-3),
    "alpha2beta1": lambda shape, axis: rules.AlphaBeta(2.0, 1.0, stabilizer=1e-3),
    "alpha1beta0": lambda shape, axis: rules.AlphaBeta(1.0, 0.0),
    "gamma": lambda shape, axis: rules.Gamma(0.5, stabilizer=1e-3),
    "gamma-unstabilised": lambda shape, axis: rules.Gamma(0.5, stabilizer=0.0),
    "zbox-scalar": lambda shape, axis: rules.ZBox(-1.5, 2.0, stabilizer=1e-3),
    "zbox-per-channel": lambda shape, axis: rules.ZBox(*_channel_bounds(shape, axis), stabilizer=1e-3),
    "zbox-per-position": lambda shape, axis: rules.ZBox(*(
        bound + sign * torch.rand(1, *shape, dtype=torch.float64)
        for bound, sign in zip(_channel_bounds(shape, axis), (-1, 1)))),
    "flat": lambda shape, axis: rules.Flat(stabilizer=1e-3),
    "wsquare": lambda shape, axis: rules.WSquare(stabilizer=1e-3),
    "wsquare-zero-bias": lambda shape, axis: rules.WSquare(zero_bias=True),
}


def _channel_bounds(shape, axis):
    """Bounds per input channel (``axis`` of the batched input), the same at every position."""
    view = [1] * (len(shape) + 1)
    view[axis] = shape[axis - 1]
    low = -torch.linspace(1.0, 2.0, view[axis], dtype=torch.float64).reshape(view)
    return low, torch.linspace(1.5, 3.0, view[axis], dtype=torch.float64).reshape(view)


class _Form(rules.Rule):
    """One form of ``rule`` on every conv/dense call: its kernel (which must serve the call) or its reference."""

    kinds = rules.PARAMETRIC_KINDS

    def __init__(self, rule, fused):
        self._rule, self._fused = rule, fused
        self.served = []

    def propagate(self, call, relevance):
        if not self._fused:
            return (self._rule.reference(call, relevance),)
        found = self._rule.kernel(call, relevance)
        self.served.append(found is not None)
        return (found,)


def _serves(rule_name, sign):
    """Whether the kernel serves a call: gamma's only on non-negative input; all are transposable here."""
    return not (rule_name.startswith("gamma") and sign == "signed")


@pytest.mark.parametrize("sign", ["signed", "nonnegative", "nonnegative-zero"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("layer_name", LAYERS)
@pytest.mark.parametrize("rule_name", RULES)
def test_kernel_equals_reference_form(rule_name, layer_name, bias, sign):
    make, in_shape = LAYERS[layer_name]
    layer = make(bias).double().eval()
    if bias:
        with torch.no_grad():
            (layer[0] if isinstance(layer, nn.Sequential) else layer).bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, *in_shape, dtype=torch.float64)
    if sign != "signed":
        x = x.relu()
    if sign == "nonnegative-zero":
        x[1] = 0.0
    rule = RULES[rule_name](in_shape, len(in_shape) if layer_name.startswith("linear") else 1)
    assert rule.kernel is not None, "every built-in rule of these terms has a fused form"
    if rule_name.startswith("zbox"):  # inside its bounds
        x = torch.max(torch.min(x, torch.as_tensor(rule.high)), torch.as_tensor(rule.low))
    R = torch.randn_like(layer(x))
    fused = _Form(rule, fused=True)
    results = [relprop.LRP(layer, relprop.Composite(conv=form, dense=form)).attribute(x, target=R)
               for form in (fused, _Form(rule, fused=False))]
    if not _serves(rule_name, sign):
        assert fused.served == [False]
        return
    assert fused.served == [True]
    torch.testing.assert_close(results[0], results[1], rtol=1e-10, atol=1e-12)
    # the rule itself takes the kernel's result
    assert torch.equal(relprop.LRP(layer, relprop.Composite(conv=rule, dense=rule)).attribute(x, target=R),
                       results[0])


@pytest.mark.parametrize("rule", [rules.ZPlus(), rules.AlphaBeta(), rules.Gamma(), rules.ZBox(-1.0, 1.0)], ids=repr)
def test_kernels_are_chosen_from_the_terms_not_the_class(rule):
    """A BasicRule declared with the same terms and mapper gets the same kernel; other declarations get none."""
    same = rules.BasicRule(rule._terms, rule._gradient_mapper)
    assert type(same.kernel) is type(rule.kernel) and vars(same.kernel) == vars(rule.kernel)
    assert rules.BasicRule(rule._terms, lambda r, outs, z: [r] * len(outs)).kernel is None  # unknown mapper
    assert rules.BasicRule(rule._terms[:1], rule._gradient_mapper).kernel is None  # other terms
    assert rules.BasicRule(rule._terms, rule._gradient_mapper, zero_bias=True).kernel is None
    assert rules.BasicRule(rule._terms, rule._gradient_mapper, reducer=lambda inputs, grads: grads[0]).kernel is None
    assert rules.BasicRule(rules.Flat()._terms, rules.Shares(1e-6, weights=(2.0,))).kernel is None  # other weight


def test_flat_and_wsquare_take_the_input_free_kernel():
    """Flat keeps its zero_bias, w^2 its bias unless dropped: the kernel's bias flag follows the rule."""
    assert isinstance(rules.Flat().kernel, kernels._InputFree) and not rules.Flat().kernel.bias
    assert rules.WSquare().kernel.bias and not rules.WSquare(zero_bias=True).kernel.bias
    assert not rules.Flat().needs_output and not rules.WSquare().needs_output


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rule", [rules.Flat(), rules.WSquare()], ids=repr)
def test_input_free_kernel_matches_the_reference_on_the_demo_cnn(rule, dtype):
    """Every conv and dense layer of the demo CNN, batch 64: flat gives the same bits as the reference form (its
    denominators are whole numbers), w^2 agrees to 1e-12 in float64 (one example's sums may take another order).
    """
    torch.manual_seed(0)
    model = SmallCNN().eval().to(dtype)
    x = torch.rand(64, 1, 28, 28, dtype=dtype)
    R = torch.randn(64, 10, dtype=dtype)
    found = [relprop.LRP(model, relprop.Composite(conv=form, dense=form)).attribute(x, target=R)
             for form in (_Form(rule, fused=True), _Form(rule, fused=False))]
    if isinstance(rule, rules.Flat):
        assert torch.equal(found[0], found[1])
    else:
        tolerance = {"rtol": 1e-12, "atol": 1e-15} if dtype == torch.float64 else {}  # float32: the default
        torch.testing.assert_close(found[0], found[1], **tolerance)


@pytest.mark.parametrize("layer_name", ["linear-3d", "conv2d-stride2", "conv_transpose2d", "dilated-grouped-conv2d",
                                        "conv2d+batch_norm"])
@pytest.mark.parametrize("rule", [rules.Flat(stabilizer=1e-3), rules.WSquare(stabilizer=1e-3)], ids=repr)
def test_input_free_kernel_in_slices_of_the_batch_equals_the_reference_form(rule, layer_name, monkeypatch):
    """On a CPU the batch goes through in slices of SLICE_BYTES of quotient: here two examples, then one."""
    make, in_shape = LAYERS[layer_name]
    layer = make(True).double().eval()
    x = torch.randn(3, *in_shape, dtype=torch.float64)
    R = torch.randn_like(layer(x))
    monkeypatch.setattr(kernels, "SLICE_BYTES", 2 * R[:1].numel() * R.element_size())
    fused = _Form(rule, fused=True)
    results = [relprop.LRP(layer, relprop.Composite(conv=form, dense=form)).attribute(x, target=R)
               for form in (fused, _Form(rule, fused=False))]
    assert fused.served == [True]
    torch.testing.assert_close(results[0], results[1], rtol=1e-12, atol=1e-15)


def test_input_free_kernel_leaves_an_unbatched_input_to_the_reference_form():
    """A conv on one unbatched image has no batch to share the denominator over."""
    layer = nn.Conv2d(2, 3, 3, padding=1).double().eval()
    x = torch.rand(2, 5, 5, dtype=torch.float64)
    form = _Form(rules.WSquare(), fused=True)
    relprop.LRP(layer, relprop.Composite(conv=form)).attribute(x, target=torch.ones(3, 5, 5, dtype=torch.float64))
    assert form.served == [False]


def test_alpha_beta_kernel_reads_its_weights_from_the_shares():
    rule = rules.AlphaBeta(3.0, 2.0)
    assert isinstance(rule.kernel, kernels.Kernel) and (rule.kernel.alpha, rule.kernel.beta) == (3.0, 2.0)
    assert rules.ZPlus().kernel.beta is None and not rules.ZPlus().needs_output  # z+ never reads the output


def test_a_zbox_on_a_layer_without_a_transposed_product_takes_the_reference_form():
    """String padding leaves the VJP to autograd: no kernel, and the reference form agrees with a padded conv."""
    same = nn.Conv2d(2, 3, 3, padding="same").double().eval()
    explicit = nn.Conv2d(2, 3, 3, padding=1).double().eval()
    explicit.load_state_dict(same.state_dict())
    x = torch.rand(2, 2, 5, 5, dtype=torch.float64)
    R = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    rule = rules.ZBox(0.0, 1.0, stabilizer=1e-3)
    via_reference, via_kernel = (relprop.LRP(layer, relprop.Composite(conv=rule)).attribute(x, target=R)
                                 for layer in (same, explicit))
    torch.testing.assert_close(via_reference, via_kernel, rtol=1e-10, atol=1e-12)
