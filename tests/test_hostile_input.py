"""Fuzzing the public API's arguments: a clear error or a result, and an untouched model, every time."""
import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import relprop
from relprop._core.signatures import bind as _bind
from test_model_safety import assert_untouched, model, snapshot

NET = model()
X = torch.randn(2, 3, 16, 16, dtype=torch.float64)
BEFORE = snapshot(NET)

TARGETS = st.one_of(
    st.none(), st.integers(-20, 20), st.floats(allow_nan=True), st.text(max_size=3), st.booleans(),
    st.tuples(st.integers(-8, 8)), st.tuples(st.integers(-8, 8), st.integers(-8, 8)),
    st.lists(st.integers(-8, 8), max_size=4), st.lists(st.text(max_size=2), max_size=3),
    st.builds(torch.tensor, st.lists(st.integers(-8, 8), min_size=1, max_size=3)),
    st.builds(lambda n: torch.zeros(n, 5, dtype=torch.float64), st.integers(1, 3)),
)


@settings(max_examples=150, deadline=None)
@given(target=TARGETS, preset=st.sampled_from(["epsilon", "epsilon-plus-flat"]))
def test_any_target_gives_a_result_or_a_clear_error(target, preset):
    try:
        relevance = relprop.LRP(NET, preset).attribute(X, target=target)
    except (ValueError, TypeError) as error:
        assert str(error).startswith("relprop:"), error
    else:
        assert relevance.shape == X.shape and torch.isfinite(relevance).all()
    assert_untouched(NET, BEFORE)


@pytest.mark.parametrize("inputs, error, match", [
    ((), TypeError, "inputs must be"),
    ("image", TypeError, "inputs must be"),
    ((X, "x"), TypeError, "inputs must be"),
])
def test_bad_inputs(inputs, error, match):
    with pytest.raises(error, match=match):
        relprop.LRP(NET).attribute(inputs, target=0)
    assert_untouched(NET, BEFORE)


class Hostile(nn.Module):
    def __init__(self, behaviour):
        super().__init__()
        self.behaviour = behaviour
        self.fc, self.head = nn.Linear(4, 3), nn.Linear(3, 3)

    def forward(self, x):
        h = self.fc(x)
        if self.behaviour == "raise":
            raise KeyError("something inside the model")
        if self.behaviour == "string":
            return "not a tensor"
        if self.behaviour == "no-grad":
            return h.detach()
        if self.behaviour == "modify-read-input":  # the second layer reads h, then h changes: autograd refuses
            out = self.head(h)
            h.mul_(3.0)
            return out + h[:, :1]
        if self.behaviour == "modify-a-copy":  # the same, out of place
            out = self.head(h)
            return out + (h * 3.0)[:, :1]
        return {"other": 3}


@pytest.mark.parametrize("behaviour, error, match", [
    ("raise", KeyError, "something inside the model"),
    ("string", TypeError, "relprop: the model returned str"),
    ("dict", TypeError, "without any tensor"),
    ("no-grad", RuntimeError, "relprop: the model output does not depend on the inputs"),
])
def test_models_that_misbehave(behaviour, error, match):
    hostile = Hostile(behaviour).eval()
    before = snapshot(hostile)
    with pytest.raises(error, match=match):
        relprop.LRP(hostile).attribute(torch.randn(2, 4), target=0)
    assert_untouched(hostile, before)


def test_an_input_modified_in_place_after_a_layer_read_it():
    """Plain autograd refuses (the layer saved its input for its weight's gradient); the layer's rule keeps a copy."""
    hostile, plain = Hostile("modify-read-input").eval(), Hostile("modify-a-copy").eval()
    plain.load_state_dict(hostile.state_dict())
    x = torch.randn(2, 4)
    torch.testing.assert_close(relprop.LRP(hostile).attribute(x, target=0), relprop.LRP(plain).attribute(x, target=0))


BOUND = [nn.functional.batch_norm, nn.functional.relu, nn.functional.leaky_relu, nn.functional.softmax,
         nn.functional.max_pool2d]


@settings(max_examples=300, deadline=None)
@given(func=st.sampled_from(BOUND), positional=st.integers(0, 10),
       keywords=st.lists(st.sampled_from(["input", "weight", "eps", "inplace", "dim", "kernel_size", "stride",
                                          "negative_slope", "running_mean", "running_var", "bogus"]), max_size=5))
def test_arguments_are_bound_by_name_as_python_binds_them(func, positional, keywords):
    """The engine binds op arguments by hand (it is faster); order, defaults and errors are Python's own."""
    signature = inspect.signature(func)
    args = tuple(range(positional))
    kwargs = {name: -1 for name in keywords}
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        with pytest.raises(TypeError, match=str(error)):
            _bind(func, args, kwargs)
        return
    bound.apply_defaults()
    assert list(_bind(func, args, kwargs).items()) == list(bound.arguments.items())
