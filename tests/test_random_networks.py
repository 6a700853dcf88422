"""Property-based tests on random networks drawn from a grammar of the supported ops (hypothesis)."""
import copy

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import relprop
from conftest import gradient_times_input, randomize_batch_norms, relative_error, zero_biases

PIECEWISE_LINEAR = ("relu", "leaky_relu", "relu_inplace")
ACTIVATIONS = PIECEWISE_LINEAR + ("gelu", "silu", "tanh")
BLOCK = st.one_of(
    st.tuples(st.just("conv"), st.booleans(), st.sampled_from(["none", "before", "after"]),
              st.sampled_from(ACTIVATIONS)),
    st.tuples(st.just("residual"), st.sampled_from(ACTIVATIONS), st.booleans()),
    st.tuples(st.just("concat"), st.sampled_from(ACTIVATIONS)),
    st.tuples(st.just("pool"), st.sampled_from(["max", "avg"])),
    st.tuples(st.just("reuse"),),
)


def activate(x, name):
    if name == "relu_inplace":
        return F.relu(x, inplace=True)
    return getattr(F, name)(x)


class RandomNet(nn.Module):
    """Blocks from ``spec`` on 3-channel 8x8 inputs, then flatten (or view) and two dense layers."""

    def __init__(self, spec, bias_head=True, view=False):
        super().__init__()
        self.spec, self.view = spec, view
        self.layers = nn.ModuleList()
        channels, size = 3, 8
        for block in spec:
            if block[0] == "conv":
                _, bias, norm, _ = block
                layer = nn.ModuleDict({"conv": nn.Conv2d(channels, 4, 3, padding=1, bias=bias)})
                if norm == "before":
                    layer["norm"] = nn.BatchNorm2d(channels)
                elif norm == "after":
                    layer["norm"] = nn.BatchNorm2d(4)
                channels = 4
            elif block[0] == "residual":
                layer = nn.Conv2d(channels, channels, 3, padding=1)
            elif block[0] == "concat":
                layer = nn.Conv2d(channels, 2, 1)
                channels += 2
            elif block[0] == "pool":
                layer, size = nn.Identity(), size // 2 if size > 2 else size
            else:
                layer = nn.Identity()
            self.layers.append(layer)
        self.hidden = nn.Linear(channels * size * size, 6, bias=bias_head)
        self.head = nn.Linear(6, 3, bias=bias_head)
        self.last_conv = None

    def forward(self, x):
        last = None
        for block, layer in zip(self.spec, self.layers):
            kind = block[0]
            if kind == "conv":
                _, _, norm, act = block
                if norm == "before":
                    x = layer["norm"](x)
                x = layer["conv"](x)
                if norm == "after":
                    x = layer["norm"](x)
                x, last = activate(x, act), layer["conv"]
            elif kind == "residual":  # as in ResNet: add to the conv output (in place or not), then activate
                out = layer(x)
                if block[2]:
                    out += x
                else:
                    out = out + x
                x = activate(out, block[1])
            elif kind == "concat":
                x = torch.cat([x, activate(layer(x), block[1])], 1)
            elif kind == "pool" and x.shape[-1] > 2:
                x = F.max_pool2d(x, 2) if block[1] == "max" else F.avg_pool2d(x, 2)
            elif kind == "reuse" and last is not None and last.in_channels == last.out_channels == x.shape[1]:
                x = torch.relu(last(x))  # the same module a second time
        x = x.reshape(x.shape[0], -1) if self.view else torch.flatten(x, 1)
        return self.head(F.relu(self.hidden(x)))


def piecewise_linear(spec):
    return all(act in PIECEWISE_LINEAR for block in spec for act in block[1:] if isinstance(act, str)
               and act in ACTIVATIONS)


SETTINGS = settings(max_examples=60, deadline=None)
SPECS = st.lists(BLOCK, min_size=1, max_size=5)


@SETTINGS
@given(spec=SPECS, view=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_lrp0_equals_gradient_times_input_on_piecewise_linear_nets(spec, view, seed):
    torch.manual_seed(seed)
    model = randomize_batch_norms(RandomNet(spec, view=view)).double().eval()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    relevance = relprop.LRP(model, relprop.composites.Epsilon(0.0), strict=True).attribute(x, target=[0, 2])
    assert torch.isfinite(relevance).all()
    if piecewise_linear(spec):
        expected = gradient_times_input(model, x, [0, 2])
        if expected.abs().max() > 0:
            assert relative_error(relevance, expected) < 1e-8


@SETTINGS
@given(spec=SPECS, seed=st.integers(0, 2 ** 16), preset=st.sampled_from(["epsilon", "epsilon-plus",
                                                                          "epsilon-alpha2-beta1"]))
def test_zero_bias_nets_conserve_and_stay_untouched(spec, seed, preset):
    torch.manual_seed(seed)
    model = zero_biases(randomize_batch_norms(RandomNet(spec, bias_head=False))).double().eval()
    state = copy.deepcopy(model.state_dict())
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    relevance, delta = relprop.LRP(model, relprop.composites.get(preset, epsilon=0.0)).attribute(
        x, target=1, return_convergence_delta=True)
    assert torch.isfinite(relevance).all()
    if preset == "epsilon":  # z+ and alpha-beta lose relevance where all positive contributions vanish
        scale = relevance.abs().sum().item() + model(x)[:, 1].abs().max().item()
        assert delta.abs().max().item() <= 1e-9 * scale
    assert all(torch.equal(value, model.state_dict()[key]) for key, value in state.items())
    assert all(p.grad is None for p in model.parameters())


@SETTINGS
@given(spec=SPECS, seed=st.integers(0, 2 ** 16), scale=st.sampled_from([0.0, 1e-30, 1e30]),
       preset=st.sampled_from(["epsilon", "epsilon-plus-flat", "epsilon-gamma-box"]))
def test_no_nan_for_zero_inputs_and_extreme_weights(spec, seed, scale, preset):
    torch.manual_seed(seed)
    model = randomize_batch_norms(RandomNet(spec)).double().eval()
    with torch.no_grad():
        model.layers[0].apply(lambda m: m.weight.mul_(1e8) if isinstance(m, nn.Conv2d) else None)
    x = torch.full((1, 3, 8, 8), scale, dtype=torch.float64)
    kwargs = {"low": -1e30, "high": 1e30} if preset == "epsilon-gamma-box" else {}
    relevance = relprop.LRP(model, relprop.composites.get(preset, **kwargs)).attribute(x, target=0)
    out = model(x)
    if torch.isfinite(out).all():
        assert not torch.isnan(relevance).any()
