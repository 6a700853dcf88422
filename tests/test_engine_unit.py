"""relprop.engine and the composite's defaults: module context, the kind -> rule table, the record factory."""
import pytest
import torch
from torch import nn

import relprop
from relprop import rules
from relprop.composites import Composite
from relprop.engine import ModuleContext, Session
from relprop.rules import OpKind
from relprop.engine import OpCall


class NewGELUActivation(nn.Module):  # named as Hugging Face's: run as one op
    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(x))


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(4, 4)
        self.act = NewGELUActivation()

    def forward(self, x):
        return self.act(self.dense(x))


def test_module_context_follows_nested_forwards_and_activation_modules():
    model = nn.Sequential(Inner(), nn.Linear(4, 2))
    context = ModuleContext(model)
    assert context.module is None and context.module_name == ""
    context.enter(model)
    context.enter(model[0])
    assert context.module is model[0] and context.module_name == "0" and not context.opaque
    context.enter(model[0].act)
    assert context.module_name == "0.act" and context.opaque == 1  # its ops are one op
    assert context.is_innermost(model[0].act) and not context.is_innermost(model[0])
    assert context.end_opaque()  # the outermost activation module ends: its output becomes the op
    context.exit()
    assert not context.end_opaque() and context.module_name == "0"
    context.exit()
    context.exit()
    assert context.module is None and context.module_name == ""


def test_each_op_is_recorded_with_the_module_that_issued_it():
    model = nn.Sequential(Inner(), nn.Linear(4, 2)).eval()
    seen = []
    lrp = relprop.LRP(model, "epsilon")
    recorded = lrp.record(torch.randn(2, 4), audit=lambda call, relevance, result: seen.append(
        (call.kind, call.module_name)))
    recorded.relevance(relprop.output_relevance(recorded.logits, target=0))
    assert set(seen) == {(OpKind.DENSE, "1"), (OpKind.ELEMENTWISE, "0.act"), (OpKind.DENSE, "0.dense")}


def test_hooks_and_training_flags_are_undone_when_the_forward_raises():
    class Failing(nn.Module):
        def forward(self, x):
            raise ValueError("broken")

    model = nn.Sequential(nn.Linear(4, 4), Failing()).train()
    session = Session(model, Composite())
    with pytest.warns(UserWarning, match="training mode"), pytest.raises(ValueError, match="broken"), \
            session.active():
        model(torch.randn(1, 4, requires_grad=True))
    assert model.training and model[0].training
    assert not model[0]._forward_pre_hooks and not model[1]._forward_hooks
    assert session.context.module is None and session.context.module_name == ""


def test_record_makes_a_call_of_the_current_module():
    model = Inner()
    session = Session(model, Composite())
    session.context.enter(model)
    session.context.enter(model.dense)
    x = torch.randn(2, 4, requires_grad=True)
    call = session.record(OpKind.SUM, torch.sum, (x,), {"dim": 1})
    assert (call.kind, call.name, call.module_name) == (OpKind.SUM, "torch.sum", "dense")
    assert call.inputs[0].data_ptr() == x.data_ptr()


def _call(kind, *inputs, factors=()):
    call = OpCall(kind, torch.mul if kind == OpKind.PRODUCT else torch.tanh, inputs, {}, "op", "")
    call.factors = factors  # what ops.ProductCall tags from the producers of its factors
    return call


def test_every_op_kind_has_a_decided_default():
    # a new kind must get a row in the table, or be one of the kinds decided apart
    assert set(OpKind) == set(Composite.DEFAULTS) | {OpKind.PRODUCT, OpKind.MAXPOOL, OpKind.UNKNOWN}


def test_defaults_come_from_the_table_and_follow_the_composite_attributes():
    composite = Composite(epsilon=0.5)
    x = torch.randn(3, requires_grad=True)
    assert composite.default(_call(OpKind.CONV, x)) is composite.conv
    assert composite.default(_call(OpKind.DENSE, x)) is composite.dense
    for kind in (OpKind.SUM, OpKind.NORM, OpKind.BATCHNORM):
        rule = composite.default(_call(kind, x))
        assert isinstance(rule, rules.Epsilon) and rule.epsilon == 0.5
    assert isinstance(composite.default(_call(OpKind.SOFTMAX, x)), rules.Softmax)
    assert type(composite.default(_call(OpKind.ELEMENTWISE, x))) is rules.Pass
    assert composite.default(_call(OpKind.MAXPOOL, x)) is None
    assert composite.default(_call(OpKind.UNKNOWN, x)) is None
    composite.dense = rules.ZPlus()  # read at each op
    assert composite.default(_call(OpKind.DENSE, x)) is composite.dense
    assert isinstance(relprop.composites.CPLRP().default(_call(OpKind.ATTENTION, x)), rules.SignalTakesAll)
    assert isinstance(relprop.composites.AttnLRP().default(_call(OpKind.ATTENTION, x)), rules.UniformProduct)


def test_products_split_uniformly_give_all_to_the_signal_next_to_a_gate_or_pass():
    composite = Composite()
    x, y = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    assert isinstance(composite.default(_call(OpKind.PRODUCT, x, y, factors=(None, None))), rules.UniformProduct)
    assert isinstance(composite.default(_call(OpKind.PRODUCT, x, y, factors=(None, "sigmoid"))),
                      rules.SignalTakesAll)
    assert type(composite.default(_call(OpKind.PRODUCT, x, factors=(None,)))) is rules.Pass


class _InPlaceReLU(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.relu_()


@pytest.mark.parametrize("activation", [lambda: torch.nn.ReLU(inplace=True), _InPlaceReLU])
def test_in_place_activation_with_a_rule_that_reads_its_input(activation):
    """A rule other than Pass on an in-place activation reads the input as it was before the write."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).double().eval()
    in_place = torch.nn.Sequential(torch.nn.Linear(4, 4), activation(), torch.nn.Linear(4, 2)).double().eval()
    in_place.load_state_dict(plain.state_dict())
    x = torch.randn(3, 4, dtype=torch.float64)
    composite = relprop.composites.Composite(layer_map=[(type(in_place[1]), relprop.rules.Gradient()),
                                                        (torch.nn.ReLU, relprop.rules.Gradient())])
    expected = relprop.LRP(plain, composite).attribute(x, target=0)
    assert torch.equal(relprop.LRP(in_place, composite).attribute(x, target=0), expected)


@pytest.mark.parametrize("factors, attnlrp, cplrp", [
    ((None, "sigmoid"), (False, True), (False, True)),
    (("softmax", None), (False, False), (True, False)),  # attention weights are gates for CP-LRP alone
    (("activation", "sigmoid"), (False, True), (False, True)),  # every factor a gate for CP-LRP: the activation is the signal
    (("sigmoid", "sigmoid"), (False, False), (False, False)),  # gates alone: none is, so none takes all
])
def test_which_factors_are_gates_is_the_gated_rule_of_each_composite(factors, attnlrp, cplrp):
    x, y = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    call = _call(OpKind.PRODUCT, x, y, factors=factors)
    assert relprop.composites.AttnLRP()._gated.gates(call) == attnlrp
    assert relprop.composites.CPLRP()._gated.gates(call) == cplrp


class _TanhThenReLU(torch.nn.Module):
    def __init__(self, in_place: bool):
        super().__init__()
        self.fc, self.out, self.in_place = torch.nn.Linear(4, 6), torch.nn.Linear(6, 2), in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        return self.out(h.relu_() if self.in_place else h.relu())


def test_in_place_relu_on_an_output_whose_kept_graph_saved_it():
    """tanh's backward saves its output: a rule that takes the VJP of tanh must not see the ReLU's write."""
    torch.manual_seed(0)
    plain, in_place = _TanhThenReLU(False).double().eval(), _TanhThenReLU(True).double().eval()
    in_place.load_state_dict(plain.state_dict())
    x = torch.randn(3, 4, dtype=torch.float64)
    composite = relprop.composites.Composite(func_map={torch.tanh: relprop.rules.Gradient()})
    expected = relprop.LRP(plain, composite).attribute(x, target=0)
    assert torch.equal(relprop.LRP(in_place, composite).attribute(x, target=0), expected)


class _GradientWithoutFlag(relprop.rules.Rule):
    """The plain gradient, written without ``needs_vjp``: the engine then builds the op's graph when asked."""

    kinds = relprop.rules.Gradient.kinds

    def propagate(self, call, relevance):
        return call.vjp(relevance)


@pytest.mark.parametrize("model", [_TanhThenReLU(False), torch.nn.Sequential(torch.nn.Conv1d(2, 3, 3, padding="same"))])
def test_a_rule_that_takes_the_vjp_without_the_flag_gets_it(model):
    torch.manual_seed(0)
    model = model.double().eval()
    x = torch.randn(2, 4, dtype=torch.float64) if isinstance(model, _TanhThenReLU) else torch.randn(2, 2, 5).double()
    target = 0 if isinstance(model, _TanhThenReLU) else (0, 1)
    funcs = [torch.tanh, torch.nn.functional.linear, torch.nn.functional.conv1d]
    flagged = relprop.LRP(model, relprop.Composite(func_map={f: relprop.rules.Gradient() for f in funcs}))
    unflagged = relprop.LRP(model, relprop.Composite(func_map={f: _GradientWithoutFlag() for f in funcs}))
    expected = flagged.attribute(x, target=target)
    assert torch.equal(unflagged.attribute(x, target=target), expected)
    assert expected.abs().sum() > 0


def test_a_view_an_op_returns_becomes_a_tensor_of_its_own_and_a_copy_where_it_views_an_argument():
    from relprop.engine.nodes import _unviewed

    x = torch.randn(2, 3, 4)
    weight, bias = torch.randn(5, 4), torch.randn(5)
    fresh = torch.nn.functional.linear(x, weight, bias)  # the 2-D addmm, viewed in the input's shape
    call = OpCall(OpKind.DENSE, torch.nn.functional.linear, (x, weight, bias), {}, "linear", "")
    own = _unviewed(fresh, call)
    assert fresh._is_view() and not own._is_view()
    assert own.data_ptr() == fresh.data_ptr() and torch.equal(own, fresh)  # the same memory, no copy
    of_argument = x[:, 1:]  # an op returning a view of its input: modifying it must not modify the input
    copied = _unviewed(of_argument, OpCall(OpKind.ELEMENTWISE, torch.Tensor.__getitem__, (x,), {}, "getitem", ""))
    assert not copied._is_view() and copied.data_ptr() != of_argument.data_ptr()
    assert torch.equal(copied, of_argument)


@pytest.mark.parametrize("func, args, kwargs, writes", [
    (torch.nn.functional.relu, (1.0, True), {}, True),  # the flag by position
    (torch.nn.functional.relu, (1.0,), {"inplace": True}, True),
    (torch.nn.functional.relu, (1.0, False), {}, False),
    (torch.Tensor.add_, (1.0, 2.0), {}, True),
    (torch.Tensor.__iadd__, (1.0, 2.0), {}, True),
    (torch.Tensor.__add__, (1.0, 2.0), {}, False),
    (torch.add, (1.0, 2.0), {"out": None}, True),
    (torch.ops.aten.relu_.default, (1.0,), {}, True),  # its schema says so
    (torch.ops.aten.relu.default, (1.0,), {}, False),
])
def test_one_test_of_writing_in_place(func, args, kwargs, writes):
    from relprop._core.signatures import writes_into

    assert writes_into(func, args, kwargs) is writes
