"""Ops propagated as another function (rules.AsFunction, Proportional, SmoothStride) and rules by torch function."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import relprop
from relprop import rules
from relprop.composites import Composite, EpsilonPlusFlat


def _lrp(model: nn.Module, x: torch.Tensor, target: object, composite: Composite) -> torch.Tensor:
    return relprop.LRP(model, composite).attribute(x, target=target)


def _conv_net(bias: bool = True) -> nn.Module:
    """Conv, BatchNorm (merged), max pooling, a strided 1x1 conv with BatchNorm, a dense layer; float64, eval."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=bias), nn.BatchNorm2d(4), nn.ReLU(),
                        nn.MaxPool2d(3, 2, padding=1), nn.Conv2d(4, 6, 1, stride=2, bias=bias), nn.BatchNorm2d(6),
                        nn.ReLU(), nn.Flatten(), nn.Linear(6 * 3 * 3, 5, bias=bias)).double().eval()
    with torch.no_grad():
        for bn in (net[1], net[5]):
            bn.running_mean.uniform_(-0.5, 0.5) if bias else bn.running_mean.zero_()
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5) if bias else bn.bias.zero_()
    return net


def test_identity_surrogate_is_the_plain_epsilon_rule():
    """AsFunction with the op itself as surrogate (BatchNorm merged into its weight and bias) = Epsilon."""
    net, x = _conv_net(), torch.randn(2, 3, 11, 11, dtype=torch.float64)
    plain = _lrp(net, x, [1, 3], Composite(epsilon=1e-3))
    surrogate = Composite(epsilon=1e-3, conv=rules.AsFunction(torch.conv2d, epsilon=1e-3),
                          dense=rules.AsFunction(F.linear, epsilon=1e-3))
    torch.testing.assert_close(_lrp(net, x, [1, 3], surrogate), plain, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("kernel, stride, padding, ceil_mode", [(2, 2, 0, False), (3, 2, 1, False), (3, 2, 0, True)])
def test_proportional_is_as_function_of_average_pooling(kernel, stride, padding, ceil_mode):
    """Proportional = AsFunction(avg_pool2d) built from max_pool2d's own arguments, to 1e-12 in float64."""
    torch.manual_seed(1)
    x = torch.rand(2, 3, 9, 9, dtype=torch.float64)
    pool = nn.MaxPool2d(kernel, stride, padding, ceil_mode=ceil_mode).eval()
    R = torch.rand_like(pool(x))

    def average(x, kernel_size, stride, padding, ceil_mode, **_):
        return F.avg_pool2d(x, kernel_size, stride, padding, ceil_mode, count_include_pad=True)

    proportional = _lrp(pool, x, R, Composite(layer_map=[(nn.MaxPool2d, rules.Proportional(epsilon=1e-9))]))
    as_function = _lrp(pool, x, R, Composite(
        layer_map=[(nn.MaxPool2d, rules.AsFunction(average, epsilon=1e-9, kinds=["maxpool"]))]))
    torch.testing.assert_close(proportional, as_function, rtol=1e-12, atol=1e-15)
    assert isinstance(rules.Proportional(), rules.AsFunction)
    # and it is not winner-take-all
    assert not torch.allclose(proportional, _lrp(pool, x, R, Composite()))


def test_surrogate_of_the_wrong_shape_is_refused_naming_the_op():
    net, x = _conv_net(), torch.randn(1, 3, 11, 11, dtype=torch.float64)
    net[3].rule = rules.AsFunction(lambda x, **_: F.avg_pool2d(x, 2))  # 11 -> 5, the pool gives 6
    with pytest.raises(ValueError, match=r"surrogate .*shape \(1, 4, 5, 5\) on .*max_pool2d in module '3'.*\(1, 4, 6, 6\)"):
        _lrp(net, x, 0, Composite())


@pytest.mark.parametrize("size", [8, 9])
def test_smooth_stride_closed_form(size):
    """A lone 1x1 stride-2 conv: each pixel of the target's 2x2 block gets x W / 4 * R / z', z' the block's
    smoothed output ``sum_i W_i mean(x_i)`` and R the seed, the real output ``sum_i W_i x_i[2h, 2w]``."""
    torch.manual_seed(2)
    conv = nn.Conv2d(2, 3, 1, stride=2, bias=False).double().eval()
    x = torch.randn(1, 2, size, size, dtype=torch.float64)
    relevance = _lrp(conv, x, (1, 2, 3), Composite(epsilon=0.0, conv=rules.SmoothStride(epsilon=0.0)))
    expected = torch.zeros_like(x)
    block = (slice(None), slice(None), slice(4, 6), slice(6, 8))
    weight = conv.weight[1].detach().view(1, 2, 1, 1)
    smoothed = (weight * x[block]).sum() / 4
    expected[block] = x[block] * weight / 4 * conv(x)[0, 1, 2, 3].detach() / smoothed
    torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=1e-15)
    # the plain rule gives it all to one pixel of the block: the checkerboard
    plain = _lrp(conv, x, (1, 2, 3), Composite(epsilon=0.0))
    assert plain[..., 4, 6].abs().sum() > 0 and plain[..., 5, 7].abs().sum() == 0


def test_smooth_stride_conserves_without_biases():
    """Bias-free (BatchNorm shifts 0): the input relevance sums to f_t(x), also over an odd-sized input."""
    net, x = _conv_net(bias=False), torch.randn(3, 3, 11, 11, dtype=torch.float64)
    target = [0, 2, 4]
    f = net(x)[torch.arange(3), target]
    composite = EpsilonPlusFlat(epsilon=1e-12, smooth_stride=True)
    audit = relprop.audit(net, x, target, composite)
    (row,) = [row for row in audit.rows if row.module.startswith("4")]
    assert row.rule == "SmoothStride(epsilon=1e-12)"
    assert abs(row.relevance_out - row.relevance_in) < 1e-9 * abs(row.relevance_in)
    relevance = _lrp(net, x, target, composite)
    torch.testing.assert_close(relevance.sum((1, 2, 3)), f.detach(), rtol=1e-7, atol=0)


def test_smooth_stride_preset_option_on_resnet_shortcuts_only():
    """EpsilonPlus(smooth_stride=True): SmoothStride on every 1x1 strided conv (the shortcuts), ZPlus elsewhere."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=4).eval()
    x = torch.randn(1, 3, 64, 64)
    rows = relprop.audit(model, x, 0, relprop.composites.EpsilonPlus(smooth_stride=True)).rows
    smoothed = sorted(row.module for row in rows if row.rule.startswith("SmoothStride"))
    assert smoothed == [f"layer{i}.0.downsample.0+layer{i}.0.downsample.1" for i in (2, 3, 4)]
    assert all(row.rule.startswith("ZPlus") for row in rows if "conv" in row.module and "conv1" != row.module[:5])
