""":class:`SmoothStride`: strided convolutions and max pooling without checkerboard artefacts."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from relprop._core.contract import Call, ParametricView, is_parametric
from relprop.rules.basic import BasicRule
from relprop.rules.functions import AsFunction, _no_surrogate


class SmoothStride(AsFunction):
    """A strided window op propagated as its stride-1 form followed by a stride x stride average.

    A convolution or max pooling with stride ``s`` covers some input pixels
    with more of its windows than others (a 1x1 convolution with stride 2,
    ResNet's downsampling shortcut, reads one pixel of every 2x2 block; a 7x7
    one with stride 2 covers a pixel with 4 windows along a dimension at one
    parity and 3 at the other), so the plain rules leave a lattice in the
    heatmap. This rule propagates the op as if it computed its stride-1 form
    and then the average of each ``s x s`` block of that: for a convolution
    with kernel ``W``, the convolution with the kernel ``W * box_s / s**d``
    (``W``, dilated if the op is, convolved with an ``s x s`` box of ones; size
    ``k + s - 1``), stride ``s``, the op's own left padding and the bias kept.
    Every input pixel then has the same total weight of windows over it along
    each dimension (the polyphase sums of a kernel convolved with an ``s``-box
    are equal). For a 1x1 kernel that is an ``s x s`` kernel of ``W / s**2``.
    Max pooling is propagated as the same smoothing of the average over its
    windows (padding counts as zeros, as in
    :class:`Proportional`): a 3x3 window with stride 2 as the 4x4 kernel
    ``[1, 2, 2, 1]^T [1, 2, 2, 1] / 36``. Windows that run over the input's far
    end read zeros there, as padding, so that the output keeps the op's size.
    The forward pass is unchanged.

    By default the smoothed op takes the epsilon rule (this is
    :class:`AsFunction` of it); ``rule`` gives a smoothed convolution another
    rule for convolutions, as the presets do with ``smooth_stride=True``. The
    rule's modifiers act on ``W`` before the box: ZPlus propagates through
    ``W+ * box``, Flat through ``ones * box``, ZBox through ``W * box`` and its
    bounds through ``W+ * box`` and ``W- * box``: the rule on the stride-1 form,
    followed by each block's average shared in proportion to the rule's own
    contributions. Max pooling always takes the epsilon rule. With
    :class:`Epsilon`, :class:`ZPlus` or :class:`Flat` and no bias (a merged
    BatchNorm's shift included), it conserves.

    Applies to ``conv1d``, ``conv2d`` and ``conv3d`` (numeric padding) and to
    ``max_pool1d``, ``max_pool2d`` and ``max_pool3d`` with a stride above 1
    along some dimension.

    Parameters
    ----------
    epsilon : float
        Stabiliser of the epsilon rule's denominator (without ``rule``, and on
        max pooling).
    rule : BasicRule, optional
        The rule of a smoothed convolution (:class:`ZPlus`,
        :class:`AlphaBeta`, :class:`Gamma`, :class:`Flat`, :class:`WSquare`,
        :class:`ZBox`), in its term form; None for the epsilon rule.
    any_stride : bool
        Also accept a convolution it does not smooth (no stride above 1, a
        transposed convolution, string padding) and propagate it as it is, by
        ``rule`` (by the epsilon rule without one): for a preset's first
        layer, which may or may not be strided.
    """

    def __init__(self, epsilon: float = 1e-6, rule: BasicRule | None = None, any_stride: bool = False):
        if rule is not None and not isinstance(rule, BasicRule):
            raise TypeError(f"relprop: SmoothStride's rule is None (epsilon) or a rule for convolutions built from "
                            f"terms (ZPlus, AlphaBeta, Gamma, Flat, WSquare, ZBox), got {rule!r}")
        super().__init__(_no_surrogate, epsilon, kinds=("conv", "maxpool"))
        self.rule = rule
        self.any_stride = any_stride
        # what the engine keeps: the smoothed forms compute their own output; an op left as it is, the rule's needs
        self.needs_output = any_stride and rule is not None and rule.needs_output
        self.zero_for_zero_input = rule is None or rule.zero_for_zero_input

    def accepts(self, call: Call) -> bool:
        """A strided convolution or max pooling (answered before it runs); with ``any_stride`` any convolution."""
        if call.kind not in self.kinds or len(call.inputs) != 1:
            return False
        window = _Window.of(call)
        if window is not None and window.strided:
            return True
        if not self.any_stride or call.kind != "conv":
            return False
        if self.rule is not None:
            return is_parametric(call) and self.rule.accepts(call)
        return call.arguments is not None

    @property
    def fills_zeros(self) -> bool:
        return not self.zero_for_zero_input

    def conserves(self, call: Call) -> bool:
        if call.kind == "maxpool":
            return True
        if not is_parametric(call):  # accepts() took convolutions and max pooling alone
            return False
        if self.rule is not None:
            return self.rule.conserves(call)
        return call.bias is None

    def surrogate_output(self, call: Call, x: Tensor) -> Tensor:
        window = _Window.of(call)
        if window is None or not window.strided:  # an op left as it is (any_stride): the epsilon rule on the op
            arguments = call.arguments
            assert arguments is not None  # accepts() checked the arguments
            return call.func(x, **arguments)
        smoothed = _SmoothedConv.of(call, window)
        return smoothed.evaluate(x, smoothed.weight, smoothed.bias)

    def propagate(self, call: Call, relevance: Tensor) -> tuple[Tensor | None, ...]:
        if self.rule is None or call.kind == "maxpool":
            return super().propagate(call, relevance)
        assert is_parametric(call)  # accepts() took convolutions and max pooling alone
        window = _Window.of(call)
        if window is None or not window.strided:
            return self.rule.propagate(call, relevance)
        # the smoothed convolution offers what the rule reads of a convolution (ParametricView)
        return self.rule.propagate(cast(ParametricView, _SmoothedConv.of(call, window)), relevance)

    def __repr__(self) -> str:
        extra = ", any_stride=True" if self.any_stride else ""
        return f"SmoothStride(epsilon={self.epsilon!r}, rule={self.rule!r}{extra})"


#: max pooling functions and their number of spatial dimensions
_MAX_POOLS = {F.max_pool1d: 1, F.max_pool2d: 2, F.max_pool3d: 3}


@dataclass(frozen=True)
class _Window:
    """Where a convolution or max pooling reads its input, one value per spatial dimension."""

    kernel: tuple[int, ...]  # taps, before dilation
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    ceil_mode: bool = False

    @classmethod
    def of(cls, call: Call) -> _Window | None:
        """The window of a ``conv1d``..``conv3d`` with numeric padding or of a ``max_pool1d``..``max_pool3d``, else
        None."""
        options = call.arguments
        if options is None:
            return None
        if call.kind == "conv" and call.func in _CONVOLUTIONS and is_parametric(call):
            weight = call.weight
            dims, padding = weight.dim() - 2, options.get("padding", 0)
            if isinstance(padding, str):
                return None
            return cls(tuple(weight.shape[2:]), _per_dim(options.get("stride", 1), dims), _per_dim(padding, dims),
                       _per_dim(options.get("dilation", 1), dims))
        dims = _MAX_POOLS.get(call.func, 0) if call.kind == "maxpool" else 0
        if not dims:
            return None
        kernel = _per_dim(options["kernel_size"], dims)
        stride = _per_dim(options["stride"], dims) if options["stride"] else kernel  # None or []: the kernel size
        return cls(kernel, stride, _per_dim(options["padding"], dims), _per_dim(options["dilation"], dims),
                   bool(options["ceil_mode"]))

    @property
    def strided(self) -> bool:
        return any(step > 1 for step in self.stride)

    @property
    def extent(self) -> tuple[int, ...]:
        """The span of a window in input pixels, dilation included."""
        return tuple((k - 1) * d + 1 for k, d in zip(self.kernel, self.dilation))

    def outputs(self, size: int, axis: int) -> int:
        """The op's output size along spatial ``axis`` for an input of ``size`` (torch's rule, ceil mode included)."""
        step, pad = self.stride[axis], self.padding[axis]
        span = size + 2 * pad - self.extent[axis] + (step - 1 if self.ceil_mode else 0)
        count = span // step + 1
        return count - 1 if self.ceil_mode and (count - 1) * step >= size + pad else count


def _boxed(weight: Tensor, stride: tuple[int, ...], dilation: tuple[int, ...]) -> Tensor:
    """``weight`` (dilated) convolved with a box of ones of size ``stride``, over the box's size.

    The kernel of a window op's stride-1 form followed by the average of each
    ``stride`` block; built from shifted copies, out of place.
    """
    if any(d > 1 for d in dilation):
        spread = weight.new_zeros(*weight.shape[:2], *((k - 1) * d + 1 for k, d in zip(weight.shape[2:], dilation)))
        spread[(slice(None), slice(None), *(slice(None, None, d) for d in dilation))] = weight
        weight = spread
    dims = len(stride)
    for axis, step in enumerate(stride):
        if step > 1:  # F.pad lists the last dimension first
            weight = torch.stack([F.pad(weight, [0, 0] * (dims - 1 - axis) + [shift, step - 1 - shift])
                                  for shift in range(step)]).sum(0)
    return weight / math.prod(stride)


@dataclass
class _SmoothedConv:
    """A strided window op's stride-1 form followed by the stride x stride average, as a rule for convolutions sees
    an op call: a convolution (depthwise with an averaging kernel for max pooling).

    It offers what the term form of a :class:`BasicRule` reads (``inputs``,
    ``weight``, ``bias``, ``evaluate``, ``output``, ``bias_term``); ``weight`` is the op's
    own, and :meth:`evaluate` smooths whatever weight a rule gives it, so that
    the rule's modifiers act before the box. It is not transposable, so the
    fused forms do not apply.
    """

    call: Call
    window: _Window
    weight: Tensor
    bias: Tensor | None
    groups: int
    func: Callable[..., Tensor]
    kind: str = "conv"
    transposable: bool = False  # no fused form: the rule takes its reference form

    @classmethod
    def of(cls, call: Call, window: _Window) -> _SmoothedConv:
        dims = len(window.kernel)
        func = _CONVOLUTIONS[dims - 1]
        if call.kind == "maxpool":  # the average over each window: a depthwise convolution with a constant kernel
            (x,) = call.inputs
            channels = x.shape[-dims - 1]
            weight = x.new_full((channels, 1, *window.kernel), 1.0 / math.prod(window.kernel))
            return cls(call, window, weight, None, channels, func)
        options = call.arguments
        assert options is not None  # _Window.of found the window in them
        return cls(call, window, options["weight"], options["bias"], options.get("groups", 1), func)

    @property
    def inputs(self) -> tuple[Tensor, ...]:
        return self.call.inputs

    @property
    def output(self) -> Tensor:
        with torch.no_grad():
            return self.evaluate(self.call.inputs[0], self.weight, self.bias)

    def bias_term(self) -> Tensor:
        """The bias, shaped to broadcast against the output (a rule with ``zero_bias`` takes it off the output)."""
        assert self.bias is not None  # called where there is a bias
        return self.bias.reshape(-1, *(1,) * len(self.window.kernel))

    def evaluate(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """The convolution with ``weight`` smoothed (:func:`_boxed`): output n reads ``x[s n - p : s n - p + k+s-1]``.

        The far end is padded with zeros so that there are as many outputs as
        the op gives (F.pad lists the last dimension first).
        """
        window = self.window
        sizes = x.shape[-len(window.kernel):]
        far = [(window.outputs(size, axis) - 1) * step + extent + step - 1 - (size + 2 * pad)
               for axis, (size, step, pad, extent) in enumerate(zip(sizes, window.stride, window.padding,
                                                                     window.extent))]
        if any(far):
            x = F.pad(x, [value for extra in reversed(far) for value in (0, extra)])
        return self.func(x, _boxed(weight, window.stride, window.dilation), bias, stride=window.stride,
                         padding=window.padding, groups=self.groups)

    def routed_image(self, value: Tensor | float) -> Tensor | None:
        """ZBox's bounds taken through the routing ops before the op (:meth:`ParametricView.routed_image`)."""
        return self.call.routed_image(value) if is_parametric(self.call) else None

    def describe(self) -> str:
        return f"the smoothed stride-1 form of {self.call.describe()}"


def _per_dim(value: int | Sequence[int], dims: int) -> tuple[int, ...]:
    """A convolution option (an int or one value per dimension) as one value per dimension."""
    return (value,) * dims if isinstance(value, int) else tuple(value)


_CONVOLUTIONS = (torch.conv1d, torch.conv2d, torch.conv3d)
