"""relprop.tracking: producers, tags, readers and in-place overwrites of one forward pass."""
import weakref

import torch
from torch import nn

from relprop.composites import Composite
from relprop.engine import Session
from relprop.rules import OpKind
from relprop.engine import OpCall
from relprop.engine import AliasTracker


def _run(model, x, composite=None):
    session = Session(model, composite or Composite())
    with session.active():
        out = model(x.detach().requires_grad_())
    return session, out


def test_an_in_place_relu_takes_over_as_producer_and_marks_the_output_it_overwrote():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True)).eval()
    session, out = _run(model, torch.randn(1, 3, 5, 5))
    relu = session.aliases.producer(out)
    assert relu.func is torch.nn.functional.relu and relu.in_place and relu.overwrites.kind == OpKind.CONV
    assert relu.overwrites.output_nonnegative  # the convolution reads relu(z) for z from now on
    assert session.aliases.zeroed_in([out]) == (relu.overwrites,)
    assert session.aliases.relu_output(out)


def test_an_out_of_place_relu_leaves_its_input_and_producer_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    session, out = _run(model, torch.randn(1, 3, 5, 5))
    relu = session.aliases.producer(out)
    assert not relu.in_place and relu.overwrites is None and session.aliases.zeroed_in([out]) == ()


def test_tags_follow_routing_and_are_dropped_by_an_overwrite():
    model = nn.Sigmoid().eval()
    session, out = _run(model, torch.randn(2, 3))
    aliases = session.aliases
    assert aliases.tag(out) == "sigmoid"
    reshaped = out.reshape(3, 2)  # outside the pass: routed by hand
    aliases.routed((out, (3, 2)), {}, reshaped)
    assert aliases.tag(reshaped) == "sigmoid"
    plain = torch.ones(2, 3, requires_grad=True)
    aliases.overwritten(out, plain)  # overwritten by something untagged: no longer a gate
    assert aliases.tag(out) is None and aliases.producer(out) is None
    aliases.set_tag(plain, "statistic")
    constant = torch.ones(2)
    aliases.set_tag(constant, "statistic")  # a constant is never tagged
    assert aliases.tag(plain) == "statistic" and aliases.tag(constant) is None


def test_readers_keep_a_copy_of_what_they_read_before_it_is_overwritten():
    tracker = AliasTracker()
    x = torch.randn(4, requires_grad=True)
    call = OpCall(OpKind.ELEMENTWISE, torch.tanh, (x,), {}, "torch.tanh", "")
    call.versions = (call.inputs[0]._version,)
    tracker.recorded(call, torch.tanh(x))
    before = call.inputs[0].clone()
    tracker.before_write(x)
    with torch.no_grad():
        x.add_(1)
    assert call.inputs[0].data_ptr() != x.data_ptr() and torch.equal(call.inputs[0], before)
    call.check_inputs()  # the copy was not modified: no error
    tracker.before_write(x)  # a second write: nothing left to copy


def test_the_tracker_keeps_no_tensor_alive():
    tracker = AliasTracker()
    x = torch.randn(3, requires_grad=True)
    call = OpCall(OpKind.ELEMENTWISE, torch.tanh, (x,), {}, "torch.tanh", "")
    out = torch.tanh(x)
    tracker.recorded(call, out)
    tracker.set_tag(out, "softmax")
    assert tracker.tag(out) == "softmax" and tracker.producer(out) is call
    gone = weakref.ref(out)
    del out
    assert gone() is None


class _Overwrites(nn.Module):
    """``a * b`` and ``a + b``, then ``b`` scaled in place (or, ``copy=True``, a scaled copy of it)."""

    def __init__(self, copy):
        super().__init__()
        self.copy = copy
        self.first, self.second = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()

    def forward(self, x):
        a, b = self.first(x), self.second(x)
        out = a * b + (a + b)
        b = b * 3 if self.copy else b.mul_(3)
        return out + b


def test_closed_form_vjps_read_the_factors_as_they_were_before_an_in_place_write():
    import relprop

    torch.manual_seed(0)
    in_place, copied = _Overwrites(copy=False).eval(), _Overwrites(copy=True).eval()
    copied.load_state_dict(in_place.state_dict())
    x = torch.randn(3, 4, dtype=torch.float64)
    expected = relprop.LRP(copied, "attnlrp").attribute(x, target=1)
    assert torch.equal(relprop.LRP(in_place, "attnlrp").attribute(x, target=1), expected)
