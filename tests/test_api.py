"""The captum-style API: targets, tuple inputs, extra arguments, the context form, errors."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import relprop
from conftest import ResidualNet, randomize_batch_norms, seed_of, zero_biases


def residual_net():
    return zero_biases(randomize_batch_norms(ResidualNet())).double().eval()


def images(n=2):
    return torch.randn(n, 3, 16, 16, dtype=torch.float64)


class TwoInputs(nn.Module):
    """Two tensor inputs, a module used twice, and a non-tensor positional argument."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(4, 4, bias=False)
        self.other = nn.Linear(3, 4, bias=False)
        self.head = nn.Linear(4, 2, bias=False)

    def forward(self, a, b, scale, mode="sum"):
        hidden = torch.relu(self.shared(torch.relu(self.shared(a))))  # the same module twice
        if mode == "sum":
            hidden = hidden + F.relu(self.other(b)) * scale
        return self.head(hidden)


def test_target_forms_agree():
    model, x = residual_net(), images()
    lrp = relprop.LRP(model, "epsilon-plus")
    by_int = lrp.attribute(x, target=2)
    assert torch.equal(lrp.attribute(x, target=[2, 2]), by_int)
    assert torch.equal(lrp.attribute(x, target=torch.tensor([2, 2])), by_int)
    assert torch.equal(lrp.attribute(x, target=(2,)), by_int)
    per_example = lrp.attribute(x, target=[0, 4])
    torch.testing.assert_close(per_example[1], lrp.attribute(x[1:], target=4)[0], rtol=1e-10, atol=1e-14)


def test_output_relevance_tensor_and_linearity():
    model, x = residual_net(), images()
    lrp = relprop.LRP(model, "epsilon-alpha2-beta1")
    out = model(x).detach()
    ones = torch.zeros_like(out)
    ones[:, 3] = 1.0  # zennit's seed convention
    unit = lrp.attribute(x, target=ones)
    expected = lrp.attribute(x, target=3)
    torch.testing.assert_close(unit * out[:, 3].reshape(-1, 1, 1, 1), expected, rtol=1e-12,
                               atol=1e-14 * expected.abs().max().item())


def test_target_none_for_one_output_per_example():
    model = nn.Sequential(nn.Linear(5, 1, bias=False)).double().eval()
    x = torch.randn(3, 5, dtype=torch.float64)
    relevance = relprop.LRP(model).attribute(x)
    torch.testing.assert_close(relevance.sum(1), model(x)[:, 0].detach(), rtol=1e-5, atol=0)


def test_tuple_inputs_extra_arguments_and_module_reuse_conserve():
    model = TwoInputs().double().eval()
    a, b = torch.rand(3, 4, dtype=torch.float64), torch.rand(3, 3, dtype=torch.float64)
    lrp = relprop.LRP(model, relprop.composites.Epsilon(epsilon=0.0))
    (ra, rb), delta = lrp.attribute((a, b), target=[0, 1, 0], additional_forward_args=(0.5, "sum"),
                                    return_convergence_delta=True)
    assert ra.shape == a.shape and rb.shape == b.shape
    expected = seed_of(model(a, b, 0.5), [0, 1, 0]).detach()
    torch.testing.assert_close(ra.sum(1) + rb.sum(1), expected, rtol=1e-10, atol=0)
    assert delta.abs().max() < 1e-10
    assert rb.abs().sum() > 0
    # the string argument switches a branch off: b gets nothing
    ra2, rb2 = lrp.attribute((a, b), target=0, additional_forward_args=(0.5, "none"))
    assert torch.equal(rb2, torch.zeros_like(b)) and ra2.abs().sum() > 0


def test_inplace_relu_and_inplace_add_conserve():
    model, x = residual_net(), images()  # ReLU(inplace=True) and `out += identity`
    relevance = relprop.LRP(model, relprop.composites.EpsilonPlus(epsilon=0.0)).attribute(x, target=1)
    torch.testing.assert_close(relevance.sum((1, 2, 3)), model(x)[:, 1].detach(), rtol=1e-10, atol=0)


def test_ignored_result_of_an_inplace_op_still_counts():
    class Accumulate(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)

        def forward(self, x):
            h = torch.relu(self.a(x))
            h.add_(torch.relu(self.b(x)))  # result ignored: only the in-place effect matters
            return h.sum(1, keepdim=True)

    model = Accumulate().double().eval()
    x = torch.rand(2, 3, dtype=torch.float64)
    relevance = relprop.LRP(model, relprop.composites.Epsilon(0.0)).attribute(x, target=0)
    torch.testing.assert_close(relevance.sum(1), model(x)[:, 0].detach(), rtol=1e-10, atol=0)


def in_place_form_matches(make) -> torch.Tensor:
    """``make(True)`` and ``make(False)``, a model with in-place ops and the same without: equal relevance."""
    torch.manual_seed(0)
    in_place, out_of_place = make(True).double().eval(), make(False).double().eval()
    out_of_place.load_state_dict(in_place.state_dict())
    x = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(in_place(x), out_of_place(x), rtol=1e-12, atol=0)
    expected = relprop.LRP(out_of_place, relprop.composites.Epsilon(0.1)).attribute(x, target=1)
    relevance = relprop.LRP(in_place, relprop.composites.Epsilon(0.1)).attribute(x, target=1)
    torch.testing.assert_close(relevance, expected, rtol=1e-10, atol=0)
    return relevance


IN_PLACE = {  # in place, and the same op out of place
    "+=": (lambda h, g, c: h.__iadd__(g), lambda h, g, c: h + g),
    "add_ alpha": (lambda h, g, c: h.add_(g, alpha=-0.5), lambda h, g, c: h - 0.5 * g),
    "sub_": (lambda h, g, c: h.sub_(g), lambda h, g, c: h - g),
    "-= alpha": (lambda h, g, c: h.sub_(g, alpha=2.0), lambda h, g, c: h - 2.0 * g),
    "broadcast": (lambda h, g, c: h.add_(g[:, :1]), lambda h, g, c: h + g[:, :1]),
    "constant": (lambda h, g, c: h.add_(c), lambda h, g, c: h + c),
    "itself": (lambda h, g, c: h.add_(h), lambda h, g, c: h + h),
    "mul_ itself": (lambda h, g, c: h.mul_(h), lambda h, g, c: h * h),
}


@pytest.mark.parametrize("then", ["relu_", "mul_", "nothing"])
@pytest.mark.parametrize("form", IN_PLACE)
def test_in_place_ops_give_the_relevance_of_their_out_of_place_form(form, then):
    class Residual(nn.Module):
        def __init__(self, in_place):
            super().__init__()
            self.a, self.b, self.head = nn.Linear(4, 5), nn.Linear(4, 5), nn.Linear(5, 2)
            self.register_buffer("c", torch.linspace(-1, 1, 5))
            self.op = IN_PLACE[form][0 if in_place else 1]

        def forward(self, x):
            h = self.a(x)
            h = self.op(h, self.b(x), self.c)
            h = h.relu_() if then == "relu_" else h.mul_(0.5) if then == "mul_" else h
            return self.head(h)

    assert in_place_form_matches(Residual).abs().sum() > 0


@pytest.mark.parametrize("chain", ["relu_ sub_", "relu_ mul_", "relu_ relu_ add_"])
def test_in_place_ops_after_an_in_place_relu_leave_the_layer_its_output(chain):
    """The ReLU runs in place and the layer reads relu(z) later: a second in-place op must not change that."""
    class Chain(nn.Module):
        def __init__(self, in_place):
            super().__init__()
            self.a, self.head, self.in_place = nn.Linear(4, 5), nn.Linear(5, 2), in_place

        def forward(self, x):
            h = self.a(x)
            for op in chain.split():
                constant = {"sub_": 0.3, "mul_": -0.5, "add_": 1.0}.get(op)
                args = () if constant is None else (constant,)
                h = getattr(h, op)(*args) if self.in_place else getattr(torch, op.rstrip("_"))(h, *args)
            return self.head(h)

    in_place_form_matches(Chain)


READERS = {  # what reads an in-place ReLU's output, and the composite
    "epsilon": (lambda: nn.Identity(), relprop.rules.Epsilon(0.1)),
    "flat": (lambda: nn.Identity(), relprop.rules.Flat()),
    "w-square": (lambda: nn.Identity(), relprop.rules.WSquare()),
    "max-pool, flat": (lambda: nn.MaxPool2d(2, 1), relprop.rules.Flat()),
    "sigmoid, epsilon": (lambda: nn.Sigmoid(), relprop.rules.Epsilon(0.1)),
    "exp, epsilon": (lambda: Exp(), relprop.rules.Epsilon(0.1)),
}


class Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x)


@pytest.mark.parametrize("reader", READERS)
def test_an_in_place_relu_changes_no_relevance_whatever_reads_its_output(reader):
    # the convolution reads relu(z) for z after the ReLU overwrote z: that serves only if no relevance reaches the
    # entries the ReLU set to 0, which Flat and w^2 give relevance to, and sigmoid and exp map to nonzero values
    between, rule = READERS[reader]

    def make(in_place):
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=in_place), between(),
                             nn.Conv2d(4, 4, 3, padding=1), nn.Flatten(), nn.LazyLinear(3)).double().eval()

    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    composite = relprop.Composite(epsilon=0.1, name_map={"3": rule})
    out_of_place, in_place = make(False), make(True)
    out_of_place(x), in_place(x)  # the lazy layer takes its shape
    in_place.load_state_dict(out_of_place.state_dict())
    read_relu = []  # per attribution: whether the first convolution's rule read relu(z) for its output z

    def attribute(model):
        def audit(call, relevance, result):
            if call.module_name == "0":
                read_relu.append(call.output_nonnegative)

        recorded = relprop.LRP(model, composite).record(x, audit=audit)
        (relevance,) = recorded.relevance(relprop.output_relevance(recorded.logits, target=1))
        return relevance

    expected = attribute(out_of_place)
    relevance = attribute(in_place)
    torch.testing.assert_close(relevance, expected, rtol=1e-10, atol=1e-12)
    assert read_relu == [False, reader == "epsilon"]  # the true output, computed again, where relu(z) would not serve


def test_repeated_calls_give_identical_results():
    model, x = residual_net(), images()
    model.fc.rule = relprop.rules.Epsilon(0.1)
    lrp = relprop.LRP(model, "epsilon-plus-flat")
    first = lrp.attribute(x, target=3)
    for _ in range(3):
        assert torch.equal(lrp.attribute(x, target=3), first)


def test_torch_compile_around_an_attribution_and_of_the_model():
    model, x = residual_net(), images()
    expected = relprop.LRP(model, "epsilon-plus").attribute(x, target=3)
    lrp = relprop.LRP(model, "epsilon-plus")

    @torch.compile
    def normalised_heatmap(inputs):
        relevance = lrp.attribute(inputs * 2.0, target=3)
        return relevance / relevance.abs().amax(dim=(1, 2, 3), keepdim=True)

    scaled = relprop.LRP(model, "epsilon-plus").attribute(x * 2.0, target=3)
    torch.testing.assert_close(normalised_heatmap(x), scaled / scaled.abs().amax(dim=(1, 2, 3), keepdim=True))
    assert not torch.equal(scaled, expected)
    assert torch.equal(relprop.LRP(torch.compile(model), "epsilon-plus").attribute(x, target=3), expected)


def test_context_form_with_own_output_relevance():
    model, x = residual_net(), images()
    lrp = relprop.LRP(model, "epsilon-plus")
    leaf = x.clone().requires_grad_()
    with lrp.context():
        out = model(leaf)
    R = torch.randn_like(out)
    (relevance,) = torch.autograd.grad(out, leaf, R)
    assert torch.equal(relevance, lrp.attribute(x, target=R))


def test_model_returning_dict_or_tuple_is_explained_on_logits():
    class Wrapped(nn.Module):
        def __init__(self, inner, kind):
            super().__init__()
            self.inner, self.kind = inner, kind

        def forward(self, x):
            logits = self.inner(x)
            return {"hidden": logits * 2, "logits": logits} if self.kind == "dict" else (logits, logits * 2)

    inner, x = residual_net(), images()
    expected = relprop.LRP(inner).attribute(x, target=1)
    for kind in ("dict", "tuple"):
        assert torch.equal(relprop.LRP(Wrapped(inner, kind).eval()).attribute(x, target=1), expected)


@pytest.mark.parametrize("target, error, match", [
    (5, ValueError, "out of range.*index 5 on dimension 1 of size 5"),
    (-6, ValueError, "out of range"),
    ((1, 2), ValueError, "has 2 indices"),
    ([1, 2, 3], ValueError, "3 targets given for a batch of 2"),
    (1.5, TypeError, "target must be"),
    (["a", "b"], TypeError, "must hold integers"),
    (None, ValueError, "pass target="),
    (torch.zeros(2, 3, dtype=torch.float64), ValueError, "does not match the model output"),
])
def test_bad_targets_raise_clear_errors(target, error, match):
    with pytest.raises(error, match=match):
        relprop.LRP(residual_net()).attribute(images(), target=target)


def test_wrong_input_shape_names_the_module():
    with pytest.raises(RuntimeError) as info:
        relprop.LRP(residual_net()).attribute(torch.randn(2, 4, 16, 16, dtype=torch.float64), target=0)
    assert "module 'stem'" in "\n".join(info.value.__notes__)


def test_bad_inputs_and_composites():
    with pytest.raises(TypeError, match="inputs must be"):
        relprop.LRP(residual_net()).attribute([1, 2], target=0)
    with pytest.raises(ValueError, match="needs every input batch first"):
        relprop.LRP(TwoInputs().eval()).attribute((torch.rand(2, 4), torch.rand(3, 3)), target=0,
                                                  additional_forward_args=(1.0, "none"), return_convergence_delta=True)
    with pytest.raises(ValueError, match="unknown preset 'epsilon-minus'.*epsilon-plus-flat"):
        relprop.LRP(residual_net(), "epsilon-minus")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        relprop.LRP(lambda x: x)


def test_rule_that_cannot_apply_raises():
    model = residual_net()
    model.stem.rule = relprop.rules.Pass()  # 3 -> 8 channels: relevance cannot pass unchanged
    with pytest.raises(relprop.RuleError, match=r"Pass\(\).*module 'stem'.*cannot apply.*\(2, 3, 16, 16\)"):
        relprop.LRP(model).attribute(images(), target=0)
    model = residual_net()
    model.relu.rule = relprop.rules.ZPlus()  # a rule for linear layers on an activation
    with pytest.raises(relprop.RuleError, match="ZPlus.*relu"):
        relprop.LRP(model).attribute(images(), target=0)


class Unusual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        _ = torch.logsumexp(x, 1)                          # not on the path to the output: no report
        return self.fc(torch.cumprod(x, dim=1))            # on the path: reported


def test_unknown_op_on_the_path_is_reported_with_its_module():
    model, x = Unusual().double().eval(), torch.rand(2, 4, dtype=torch.float64)
    with pytest.warns(relprop.UnhandledOpWarning, match=r"torch.cumprod in module '<root>'") as record:
        relprop.LRP(model).attribute(x, target=0)
    assert not any("logsumexp" in str(w.message) for w in record)
    with pytest.raises(relprop.UnsupportedOpError, match="torch.cumprod"):
        relprop.LRP(model, strict=True).attribute(x, target=0)


def test_record_then_relevance_is_attribute():
    model, x = residual_net(), images()
    lrp = relprop.LRP(model, "epsilon-plus")
    explained = lrp.record(x, reusable=False)
    assert torch.equal(explained.logits, model(x))
    target = explained.logits.argmin(1)  # a seed chosen after seeing the output
    (relevance,) = explained.relevance(relprop.output_relevance(explained.logits, target))
    torch.testing.assert_close(relevance, lrp.attribute(x, target=target), rtol=1e-12, atol=1e-14)
    with pytest.raises(RuntimeError, match="crosses this recorded forward pass once"):
        explained.relevance(relprop.output_relevance(explained.logits, target))
