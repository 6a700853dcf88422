"""Ops propagated as another function (rules.AsFunction, Proportional, SmoothStride) and rules by torch function."""
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import relprop
from relprop import rules
from relprop.composites import Composite, EpsilonPlusFlat
from relprop.workflows.evaluate import checkerboard


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


@pytest.mark.parametrize("rule", [None, rules.ZPlus(), rules.AlphaBeta(2.0, 1.0), rules.Gamma(0.25),
                                  rules.Gamma(0.25, zero_bias=True)],
                         ids=["epsilon", "zplus", "alphabeta", "gamma", "gamma-zero-bias"])
@pytest.mark.parametrize("stride", [2, (2, 3)])
def test_smooth_stride_is_the_rule_of_the_block_average_convolution(rule, stride):
    """SmoothStride(rule) on a 1x1 conv = rule on the conv with a stride x stride kernel of weight / stride^2."""
    torch.manual_seed(5)
    conv = nn.Conv2d(4, 3, 1, stride=stride).double().eval()
    steps = (stride, stride) if isinstance(stride, int) else stride
    average = nn.Conv2d(4, 3, steps, stride=steps).double().eval()
    with torch.no_grad():
        average.weight.copy_(conv.weight.expand(3, 4, *steps) / (steps[0] * steps[1]))
        average.bias.copy_(conv.bias)
    x = torch.randn(2, 4, 12, 12, dtype=torch.float64)
    R = torch.rand_like(conv(x))
    smooth = rules.SmoothStride(epsilon=1e-9, rule=rule)
    expected = _lrp(average, x, R, Composite(epsilon=1e-9, conv=rule or rules.Epsilon(1e-9)))
    torch.testing.assert_close(_lrp(conv, x, R, Composite(conv=smooth)), expected, rtol=1e-10, atol=1e-13)


def test_smooth_stride_refuses_a_rule_it_cannot_apply():
    with pytest.raises(TypeError, match="SmoothStride's rule is None .* got Epsilon"):
        rules.SmoothStride(rule=rules.Epsilon())


@pytest.mark.parametrize("composite", [relprop.composites.Epsilon(1e-12, smooth_stride=True),
                                       EpsilonPlusFlat(1e-12, smooth_stride=True)], ids=["epsilon", "zplus"])
def test_smooth_stride_conserves_without_biases(composite):
    """Bias-free (BatchNorm shifts 0): the input relevance sums to f_t(x), also over an odd-sized input."""
    net, x = _conv_net(bias=False), torch.randn(3, 3, 11, 11, dtype=torch.float64)
    target = [0, 2, 4]
    f = net(x)[torch.arange(3), target]
    audit = relprop.audit(net, x, target, composite)
    (row,) = [row for row in audit.rows if row.module.startswith("4")]
    assert row.rule == repr(composite.smooth_stride) and row.rule.startswith("SmoothStride")
    assert abs(row.relevance_out - row.relevance_in) < 1e-9 * abs(row.relevance_in)
    relevance = _lrp(net, x, target, composite)
    torch.testing.assert_close(relevance.sum((1, 2, 3)), f.detach(), rtol=1e-7, atol=0)


def test_smooth_stride_preset_option_on_strided_ops():
    """EpsilonPlus(smooth_stride=True): SmoothStride on every strided convolution and max pooling, ZPlus elsewhere;
    EpsilonPlusFlat's stem keeps Flat, smoothed."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=4).eval()
    x = torch.randn(1, 3, 64, 64)
    rows = relprop.audit(model, x, 0, relprop.composites.EpsilonPlus(smooth_stride=True)).rows
    smoothed = sorted(row.module for row in rows if row.rule.startswith("SmoothStride"))
    strided = [f"layer{i}.0.{name}" for i in (2, 3, 4) for name in ("conv1+layer{}.0.bn1", "downsample.0+layer{}.0.downsample.1")]
    assert smoothed == sorted(["conv1+bn1", "maxpool"] + [name.format(name[5]) for name in strided])
    assert all(row.rule.startswith("SmoothStride(epsilon=1e-06, rule=ZPlus") for row in rows
               if row.module in smoothed)
    assert all(row.rule.startswith("ZPlus") for row in rows if "conv" in row.module and row.module not in smoothed)
    rows = relprop.audit(model, x, 0, EpsilonPlusFlat(smooth_stride=True)).rows
    (stem,) = [row for row in rows if row.module == "conv1+bn1"]
    assert stem.rule.startswith("SmoothStride(epsilon=1e-06, rule=Flat") and stem.rule.endswith("any_stride=True)")


def _box_kernel(weight: torch.Tensor, step: int) -> torch.Tensor:
    """``weight`` (O, I, k, k) convolved with a step x step box of ones, over step^2, by its definition."""
    k = weight.shape[-1]
    out = weight.new_zeros(*weight.shape[:2], k + step - 1, k + step - 1)
    for a in range(k + step - 1):
        for b in range(k + step - 1):
            for t in range(step):
                for u in range(step):
                    if 0 <= a - t < k and 0 <= b - u < k:
                        out[..., a, b] += weight[..., a - t, b - u] / step**2
    return out


@pytest.mark.parametrize("size", [8, 9])
@pytest.mark.parametrize("rule", [None, rules.ZPlus()], ids=["epsilon", "zplus"])
def test_smooth_stride_is_the_rule_of_the_kernel_convolved_with_a_box(size, rule):
    """A 3x3 stride-2 conv (padding 1) = the rule on the 4x4 stride-2 conv with kernel W * box / 4, the input
    zero-padded at the far end where the last window runs over it (size 9). ZPlus modifies W before the box:
    W+ * box, not (W * box)+, so the reference conv takes W+ * box (the input is non-negative, as after a ReLU)."""
    torch.manual_seed(7)
    conv = nn.Conv2d(3, 2, 3, stride=2, padding=1).double().eval()
    x = torch.rand(2, 3, size, size, dtype=torch.float64)
    R = torch.rand_like(conv(x))
    reference = nn.Conv2d(3, 2, 4, stride=2, padding=1).double().eval()
    with torch.no_grad():
        weight = conv.weight if rule is None else conv.weight.clamp(min=0)
        reference.weight.copy_(_box_kernel(weight, 2))
        reference.bias.copy_(conv.bias)
    assert not torch.equal(_box_kernel(conv.weight, 2).clamp(min=0), _box_kernel(conv.weight.clamp(min=0), 2))
    far = size % 2  # 9 + 2 - 4 = 7: three windows; the op gives five, the fifth needs one more pixel
    padded = nn.Sequential(nn.ZeroPad2d((0, far, 0, far)), reference).eval()
    assert padded(x).shape == R.shape
    expected = _lrp(padded, x, R, Composite(epsilon=1e-9, conv=rule or rules.Epsilon(1e-9)))
    smooth = rules.SmoothStride(epsilon=1e-9, rule=rule)
    torch.testing.assert_close(_lrp(conv, x, R, Composite(conv=smooth)), expected, rtol=1e-12, atol=1e-15)


def test_smooth_stride_dilated_conv1d_closed_form():
    """conv1d, kernel [a, b, c], dilation 2, stride 2: the kernel dilated, [a, 0, b, 0, c], then the 2-box: the
    stride-2 kernel [a, a, b, b, c, c] / 2."""
    torch.manual_seed(12)
    conv = nn.Conv1d(2, 3, 3, stride=2, padding=2, dilation=2).double().eval()
    reference = nn.Conv1d(2, 3, 6, stride=2, padding=2).double().eval()
    with torch.no_grad():
        reference.weight.copy_(conv.weight.repeat_interleave(2, dim=-1) / 2)
        reference.bias.copy_(conv.bias)
    x = torch.randn(2, 2, 12, dtype=torch.float64)
    R = torch.rand_like(conv(x))
    assert reference(x).shape == R.shape
    expected = _lrp(reference, x, R, Composite(epsilon=1e-9))
    torch.testing.assert_close(_lrp(conv, x, R, Composite(conv=rules.SmoothStride(epsilon=1e-9))), expected,
                               rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("pool", [nn.MaxPool2d(3, 2, 1), nn.MaxPool2d(3, 2, ceil_mode=True), nn.MaxPool2d(2),
                                  nn.MaxPool2d(3, 3, 1, ceil_mode=True), nn.MaxPool1d(3, 2, 1), nn.MaxPool3d(3, 2, 1)],
                         ids=repr)
@pytest.mark.parametrize("size", [9, 10])
def test_smooth_stride_max_pooling_keeps_the_output_size_and_conserves(pool, size):
    dims = int(type(pool).__name__[-2])
    torch.manual_seed(13)
    x = torch.rand(2, 3, *(size,) * dims, dtype=torch.float64) + 0.1
    R = torch.rand_like(pool(x))
    composite = Composite(layer_map=[(type(pool), rules.SmoothStride(epsilon=0.0))])
    relevance = _lrp(pool.eval(), x, R, composite)
    torch.testing.assert_close(relevance.sum(), R.sum(), rtol=1e-12, atol=0)
    assert (relevance > 0).all()  # every pixel that a window reads takes a share


def test_smooth_stride_on_1x1_kernels_is_the_block_average_bitwise():
    """On a 1x1 strided conv the epsilon form is, to the bit, AsFunction of the conv with an s x s kernel of
    weight / s^2 over the input zero-padded at its far end (SmoothStride before it took other kernels)."""
    torch.manual_seed(8)
    conv = nn.Conv2d(4, 3, 1, stride=2).double().eval()
    x = torch.randn(2, 4, 11, 11, dtype=torch.float64)
    R = torch.rand_like(conv(x))

    def block_average(x, weight, bias, stride, **_):
        return F.conv2d(F.pad(x, [0, 1, 0, 1]), weight.expand(3, 4, 2, 2) / 4, bias, stride)

    found = _lrp(conv, x, R, Composite(conv=rules.SmoothStride(epsilon=1e-9)))
    expected = _lrp(conv, x, R, Composite(conv=rules.AsFunction(block_average, epsilon=1e-9)))
    assert torch.equal(found, expected)


def test_smooth_stride_max_pooling_coverage_is_uniform():
    """A 3x3 stride-2 max pool (padding 1) as the 4x4 kernel [1, 2, 2, 1]^T [1, 2, 2, 1] / 36: on a constant
    input with relevance 1 at every output whose window lies inside it, every pixel covered by those windows
    alone gets 1/4 (each parity sums to 1/2 per dimension); Proportional's 3x3 windows give 1/9, 2/9, 4/9 (one or two windows per dimension)."""
    pool = nn.MaxPool2d(3, 2, padding=1).eval()
    x = torch.ones(1, 1, 16, 16, dtype=torch.float64)
    R = torch.zeros(1, 1, 8, 8, dtype=torch.float64)
    R[..., 1:7, 1:7] = 1.0  # windows 2n - 1 .. 2n + 2, inside the input for n = 1 .. 6
    smooth = _lrp(pool, x, R, Composite(layer_map=[(nn.MaxPool2d, rules.SmoothStride(epsilon=0.0))]))
    inner = (..., slice(4, 12), slice(4, 12))  # pixels whose smoothed windows (n = (i - 2) / 2 .. (i + 1) / 2) all carry R
    torch.testing.assert_close(smooth[inner], torch.full((1, 1, 8, 8), 0.25, dtype=torch.float64), rtol=1e-12, atol=0)
    assert abs(smooth.sum().item() - R.sum().item()) < 1e-12  # and it conserves
    proportional = _lrp(pool, x, R, Composite(layer_map=[(nn.MaxPool2d, rules.Proportional(epsilon=0.0))]))
    torch.testing.assert_close(proportional[0, 0, 4:6, 4:6], torch.tensor([[1, 2], [2, 4]], dtype=torch.float64) / 9)


def test_smooth_stride_flat_stem_coverage_is_uniform():
    """EpsilonPlusFlat(smooth_stride=True) on a 7x7 stride-2 first conv: Flat on the kernel ones * box, whose
    parities each cover a pixel with weight 3.5 of 7 per dimension: 1/4 over the C input channels, where plain Flat
    gives (3/7 or 4/7)^2 / C (three or four windows per dimension)."""
    conv = nn.Conv2d(3, 2, 7, stride=2, padding=3).double().eval()
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    R = torch.zeros(1, 2, 16, 16, dtype=torch.float64)
    R[:, 0, 2:14, 2:14] = 1.0  # windows 2n - 3 .. 2n + 4 (smoothed), inside the input for n = 2 .. 13
    inner = (..., slice(8, 24), slice(8, 24))  # pixels every window over which carries R
    smooth = _lrp(conv, x, R, EpsilonPlusFlat(0.0, smooth_stride=True))
    torch.testing.assert_close(smooth[inner], torch.full((1, 3, 16, 16), 1 / 12, dtype=torch.float64),
                               rtol=1e-12, atol=0)
    plain = _lrp(conv, x, R, EpsilonPlusFlat(0.0))
    torch.testing.assert_close(plain[0, 0, 8:10, 8:10], torch.tensor([[9, 12], [12, 16]], dtype=torch.float64) / 147)


def _stem_net(bias: bool = True) -> nn.Module:
    """A ResNet-like stem and a strided stage: 7x7 s2 conv, BatchNorm, 3x3 s2 max pool, 3x3 s2 conv, a strided 1x1
    shortcut added to it, a dense layer; float64, eval."""
    torch.manual_seed(9)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 8, 7, 2, 3, bias=bias), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.MaxPool2d(3, 2, 1))
            self.conv = nn.Conv2d(8, 8, 3, 2, 1, bias=bias)
            self.shortcut = nn.Conv2d(8, 8, 1, 2, bias=bias)
            self.head = nn.Sequential(nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5, bias=bias))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.stem(x)
            return self.head(self.conv(h) + self.shortcut(h))

    net = Net().double().eval()
    with torch.no_grad():
        bn = net.stem[1]
        bn.running_mean.uniform_(-0.5, 0.5) if bias else bn.running_mean.zero_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.bias.uniform_(-0.5, 0.5) if bias else bn.bias.zero_()
    return net


@pytest.mark.parametrize("preset", ["epsilon", "epsilon-plus-flat", "epsilon-gamma-box"])
def test_smooth_stride_on_a_strided_stem_conserves_without_biases(preset):
    """Bias-free, every strided op smoothed (a Flat or ZBox stem included): the input relevance sums to f_t(x)."""
    net = _stem_net(bias=False)
    x = torch.rand(2, 3, 30, 30, dtype=torch.float64)
    bounds = {"low": 0.0, "high": 1.0} if preset == "epsilon-gamma-box" else {}
    composite = relprop.composites.get(preset, epsilon=1e-12, smooth_stride=True, **bounds)
    rows = relprop.audit(net, x, [0, 3], composite).rows
    assert {row.module for row in rows if row.rule.startswith("SmoothStride")} == {
        "stem.0+stem.1", "stem.3", "conv", "shortcut"}
    relevance = _lrp(net, x, [0, 3], composite)
    f = net(x)[torch.arange(2), [0, 3]].detach()
    torch.testing.assert_close(relevance.sum((1, 2, 3)), f, rtol=1e-7, atol=0)


def test_smooth_stride_zbox_stem_closed_form():
    """ZBox smoothed: x (W * box) - l (W+ * box) - h (W- * box), shared by the epsilon-free z^B rule."""
    torch.manual_seed(10)
    conv = nn.Conv2d(3, 2, 3, stride=2, padding=1, bias=False).double().eval()
    x = torch.rand(1, 3, 8, 8, dtype=torch.float64, requires_grad=True)
    low, high = torch.full_like(x, -0.5), torch.full_like(x, 1.5)
    R = torch.rand(1, 2, 4, 4, dtype=torch.float64)
    parts = [_box_kernel(w, 2) for w in (conv.weight.detach(), conv.weight.detach().clamp(min=0),
                                         conv.weight.detach().clamp(max=0))]
    z = [F.conv2d(v, w, stride=2, padding=1) for v, w in zip((x, low.requires_grad_(), high.requires_grad_()), parts)]
    total = z[0] - z[1] - z[2]
    grads = torch.autograd.grad(total, (x, low, high), R / total)
    expected = x * grads[0] + low * grads[1] + high * grads[2]
    composite = Composite(first={"conv": rules.ZBox(-0.5, 1.5, stabilizer=0.0)}, smooth_stride=True)
    torch.testing.assert_close(_lrp(conv, x.detach(), R, composite), expected.detach(), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("preset", ["epsilon-plus-flat", "epsilon-gamma-box"])
def test_smooth_stride_leaves_an_unstrided_first_layer_as_it_is(preset):
    """A first layer without a stride keeps its own rule (Flat, ZBox: fused forms that read the output), to the bit."""
    torch.manual_seed(11)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)).double().eval()
    x = torch.rand(2, 3, 6, 6, dtype=torch.float64)
    bounds = {"low": 0.0, "high": 1.0} if preset == "epsilon-gamma-box" else {}
    plain, smooth = (relprop.composites.get(preset, smooth_stride=flag, **bounds) for flag in (False, True))
    assert repr(smooth.first["conv"]).endswith("any_stride=True)")
    assert torch.equal(_lrp(net, x, [0, 2], smooth), _lrp(net, x, [0, 2], plain))


def _photo(size: int) -> torch.Tensor:
    """examples/pictures/chelsea.jpg at size x size, normalised as torchvision's ImageNet models expect."""
    from PIL import Image

    picture = Image.open(Path(__file__).parents[1] / "examples" / "pictures" / "chelsea.jpg").resize((size, size))
    pixels = torch.from_numpy(np.asarray(picture, dtype=np.float32).copy()).permute(2, 0, 1)[None] / 255.0
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    return (pixels - mean) / torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def test_smooth_stride_removes_the_stem_checkerboard_from_the_input_heatmap():
    """The input heatmap of a ResNet-like net on a photo: its period-8 lattice (stem, max pool, strided stage)
    falls to a tenth under epsilon-plus-flat with smooth_stride (measured: 0.070 -> 0.002)."""
    net, x = _stem_net().float(), _photo(128)
    before, after = (checkerboard(_lrp(net, x, 2, EpsilonPlusFlat(smooth_stride=smooth)).sum(1), 8)
                     for smooth in (False, True))
    assert before > 0.05 and after < before / 10, (before, after)


class _Pool(nn.Module):
    """A functional max pooling in a module's forward: a module of its own, so that module.rule can reach it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(x, 2)


class _Residual(nn.Module):
    def __init__(self, in_place: bool):
        super().__init__()
        self.conv, self.in_place = nn.Conv2d(3, 3, 3, padding=1), in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        if self.in_place:
            h += x
            return h
        return h + x


def _pool_net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), _Pool(), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 3)).double().eval()


def test_func_map_precedence():
    """module.rule > name_map > func_map > first > layer_map > default, told apart by their numbers."""
    net, x = _pool_net(), torch.rand(2, 3, 8, 8, dtype=torch.float64)
    proportional = {F.max_pool2d: rules.Proportional()}
    winner = _lrp(net, x, 1, Composite())
    shared = _lrp(net, x, 1, Composite(layer_map=[(_Pool, rules.Proportional())]))
    assert not torch.allclose(shared, winner)
    torch.testing.assert_close(_lrp(net, x, 1, Composite(func_map=proportional)), shared, rtol=1e-12, atol=0)
    # func_map before layer_map
    composite = Composite(func_map=proportional, layer_map=[(_Pool, rules.Gradient())])
    torch.testing.assert_close(_lrp(net, x, 1, composite), shared, rtol=1e-12, atol=0)
    # name_map before func_map
    composite = Composite(func_map=proportional, name_map=[("2", rules.Gradient())])
    torch.testing.assert_close(_lrp(net, x, 1, composite), winner, rtol=1e-12, atol=0)
    # module.rule before func_map
    net[2].rule = rules.Gradient()
    torch.testing.assert_close(_lrp(net, x, 1, Composite(func_map=proportional)), winner, rtol=1e-12, atol=0)
    del net[2].rule
    # func_map before first: the first convolution takes the mapped rule, not the preset's Flat
    flat = EpsilonPlusFlat()
    mapped = EpsilonPlusFlat(func_map={torch.conv2d: rules.ZPlus()})
    torch.testing.assert_close(_lrp(net, x, 1, mapped), _lrp(net, x, 1, relprop.composites.EpsilonPlus()),
                               rtol=1e-12, atol=0)
    assert not torch.allclose(_lrp(net, x, 1, mapped), _lrp(net, x, 1, flat))


@pytest.mark.parametrize("in_place", [False, True])
def test_func_map_matches_the_aliases_of_a_function(in_place):
    """torch.add, Tensor.add, x + y and x += y are one function; its rule (here a large epsilon) reaches each."""
    torch.manual_seed(4)
    net = nn.Sequential(_Residual(in_place), nn.Flatten(), nn.Linear(3 * 5 * 5, 2)).double().eval()
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    default = _lrp(net, x, 0, Composite())
    # the sum's own rule with epsilon 10 everywhere it is called: the same as giving every default linear op (only
    # the sum here: the conv and dense layers have rules of their own) that epsilon
    expected = _lrp(net, x, 0, Composite(epsilon=10.0, conv=rules.Epsilon(), dense=rules.Epsilon()))
    assert not torch.allclose(expected, default)
    for key in (torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.add_, torch.Tensor.__iadd__):
        found = _lrp(net, x, 0, Composite(func_map={key: rules.Epsilon(10.0)}))
        torch.testing.assert_close(found, expected, rtol=1e-12, atol=0)


def test_func_map_refuses_what_it_cannot_reach():
    with pytest.raises(ValueError, match="cannot give torch.reshape a rule: .*routing op"):
        Composite(func_map={torch.reshape: rules.Pass()})
    with pytest.raises(ValueError, match="cannot give torch.diff a rule: relprop has no op of that name"):
        Composite(func_map={torch.diff: rules.Epsilon()})
    with pytest.raises(ValueError, match="keys are torch functions .* got 'max_pool2d'"):
        Composite(func_map={"max_pool2d": rules.Proportional()})
    # a rule that cannot apply to every call of the function: RuleError naming the entry, the op and the module
    net, x = _pool_net(), torch.rand(1, 3, 8, 8, dtype=torch.float64)
    with pytest.raises(relprop.RuleError, match=r"func_map entry for torch.nn.functional.relu\) cannot apply to "
                                                r"torch.nn.functional.relu in module '1'"):
        _lrp(net, x, 0, Composite(func_map={F.relu: rules.Epsilon()}))


class _Map:
    """The relevance a run of ``relprop explain`` drew (its pictures' titles name the options, so not their bytes)."""

    def __init__(self, relevance):
        self.relevance = relevance

    def read_bytes(self):
        return self.relevance.numpy().tobytes()


def _explain_cli(tmp_path, name, *options):
    from unittest import mock

    from PIL import Image

    from relprop import viz
    from relprop.cli import main

    picture = tmp_path / "digit.png"
    if not picture.exists():
        pixels = torch.zeros(28, 28, dtype=torch.uint8)
        pixels[5:23, 12:16], pixels[8:12, 4:24] = 255, 200
        Image.fromarray(pixels.numpy()).save(picture)
    drawn = []
    original = viz.save_explanation

    def record(relevance, path, **kwargs):
        drawn.append(torch.as_tensor(relevance).clone())
        return original(relevance, path, **kwargs)

    with mock.patch.object(viz, "save_explanation", record):
        code = main(["explain", str(picture), "--model", "cli_factory:small_cnn", "--size", "28", "--channels", "1",
                     "--preset", "epsilon", "--target", "3", "--out", str(tmp_path / name), *options])
    return code, _Map(drawn[0] if drawn else torch.zeros(0))


def strided_net() -> nn.Module:
    """A model with a strided 1x1 convolution, for ``--model test_asfunction:strided_net``."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 1, stride=2), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 14 * 14, 10))


def test_cli_func_rule_and_smooth_stride(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # cli_factory
    code, plain = _explain_cli(tmp_path, "plain")
    assert code == 0
    # winner-take-all named explicitly is the default; proportional max pooling changes the heatmap
    code, winner = _explain_cli(tmp_path, "winner", "--func-rule", "max_pool2d=gradient", "--smooth-stride")
    # (no strided convolution here, and func_map names the max pool's rule before smooth_stride is asked)
    assert code == 0 and winner.read_bytes() == plain.read_bytes()
    code, shared = _explain_cli(tmp_path, "shared", "--func-rule", "max_pool2d=proportional")
    assert code == 0 and shared.read_bytes() != plain.read_bytes()
    # --smooth-stride reaches a strided 1x1 convolution
    model = ["--model", "test_asfunction:strided_net"]
    (code, strided), (code_smooth, smooth) = (_explain_cli(tmp_path, "strided", *model),
                                              _explain_cli(tmp_path, "smooth", *model, "--smooth-stride"))
    assert code == code_smooth == 0 and strided.read_bytes() != smooth.read_bytes()
    capsys.readouterr()
    for value, message in [("foo=proportional", "no torch function named 'foo'"),
                           ("max_pool2d=bar", "unknown rule 'bar'; rules: epsilon"),
                           ("reshape=epsilon", "cannot give torch.reshape a rule")]:
        code, _ = _explain_cli(tmp_path, "bad", "--func-rule", value)
        error = capsys.readouterr().err
        assert code == 2 and len(error.splitlines()) == 1 and message in error, error
        assert not (tmp_path / "bad").exists()


def test_checkerboard_measure_closed_forms():
    torch.manual_seed(6)
    lattice = torch.zeros(3, 16, 16)
    lattice[0, ::2, ::2] = 1.0  # the lattice alone: all of the variation
    lattice[1] = 2.0  # constant: none
    lattice[2, :, :8] = 1.0  # a half plane: no power at the frequencies of period 2 (multiples of 8)
    torch.testing.assert_close(checkerboard(lattice, 2), torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    # against the spectrum: power at the multiples of H / period and W / period, over all power but the mean's
    noise = torch.randn(2, 24, 24, dtype=torch.float64)
    power = torch.fft.fft2(noise - noise.mean((-2, -1), keepdim=True)).abs().square()
    on_lattice = power[:, ::6, ::6].sum((-2, -1)) / power.sum((-2, -1))
    torch.testing.assert_close(checkerboard(noise, 4), on_lattice, rtol=1e-10, atol=0)
    with pytest.raises(ValueError, match="at least the period 32"):
        checkerboard(noise, 32)


def _stage_checkerboards(model: nn.Module, size: int, composite: Composite) -> torch.Tensor:
    """Period-2 checkerboard of the relevance at layer1..3's outputs (read by the strided shortcuts), on a photo."""
    inputs = _photo(size)
    target = model(inputs).argmax(1)
    stages = relprop.LayerLRP(model, ["layer1", "layer2", "layer3"], composite).attribute(inputs, target=target)
    return torch.cat([checkerboard(relevance.sum(1), 2) for relevance in stages])


def test_smooth_stride_removes_the_shortcut_checkerboard_resnet18():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    before = _stage_checkerboards(model, 128, EpsilonPlusFlat())
    after = _stage_checkerboards(model, 128, EpsilonPlusFlat(smooth_stride=True))
    assert (before > 0.3).all() and (after < before / 2).all(), (before, after)


@pytest.mark.slow
def test_smooth_stride_removes_the_shortcut_checkerboard_resnet50():
    """The README's numbers for one picture: ResNet50, random init (seed 0), 224 x 224."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet50().eval()
    before = _stage_checkerboards(model, 224, EpsilonPlusFlat())
    after = _stage_checkerboards(model, 224, EpsilonPlusFlat(smooth_stride=True))
    assert (before > 0.5).all() and (after < before / 2.5).all(), (before, after)
    # the input heatmap, whose period-32 lattice holds the stem's and every stage's (README: 0.137 -> 0.009)
    x = _photo(224)
    target = model(x).argmax(1)
    before, after = (checkerboard(_lrp(model, x, target, EpsilonPlusFlat(smooth_stride=smooth)).sum(1), 32)
                     for smooth in (False, True))
    assert before > 0.1 and after < before / 5, (before, after)


def test_a_dilated_max_pool_runs_winner_take_all_and_smoothed_but_refuses_proportional():
    # average pooling has no dilation: Proportional cannot apply and says so; the smoothed pool builds its own kernel
    pool = nn.Sequential(nn.MaxPool2d(3, 2, 1, dilation=2)).double().eval()
    x = torch.rand(1, 2, 9, 9, dtype=torch.float64) + 0.1
    seed = torch.ones_like(pool(x))
    winner = relprop.LRP(pool).attribute(x, target=seed)
    assert winner.sum().item() == pytest.approx(seed.numel()) and (winner > 0).sum() <= seed.numel()
    with pytest.raises(relprop.RuleError, match="Proportional.*cannot apply.*module '0'"):
        relprop.LRP(pool, relprop.Composite(layer_map=[(nn.MaxPool2d, relprop.rules.Proportional())])).attribute(
            x, target=seed)
    smoothed = relprop.LRP(pool, relprop.composites.get("epsilon", smooth_stride=True)).attribute(x, target=seed)
    assert smoothed.sum().item() == pytest.approx(seed.numel(), rel=1e-4)  # up to the stabiliser
    assert (smoothed > 0).sum() > (winner > 0).sum()
