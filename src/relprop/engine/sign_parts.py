"""The parts by sign of a parametric op call's weight and input (``W+``, ``W-``, ``x+``, ``x-``), which the fused
rule kernels read (:mod:`relprop.rules.kernels`), and the workspace where they are written."""
from __future__ import annotations

from typing import Literal, overload

import torch
from torch import Tensor

from relprop._core.kinds import OpKind
from relprop.engine.calls import OpCall


class Workspace:
    """Buffers that the parametric op calls of one forward pass share for a weight-sized tensor each rule
    needs only while it runs (``W+``).

    The backward pass reaches one op at a time on a device, so one buffer per
    device and dtype, the size of the largest such tensor, serves every
    layer. A new tensor per layer would cost as much memory at any moment,
    but on a CPU each is fresh memory from the operating system (it is above
    glibc's mmap threshold), faulted in page by page: 71 MiB of them per
    attribution on ResNet50 (``benchmarks/README.md``).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    def like(self, tensor: Tensor, shape: list[int] | torch.Size | None = None) -> Tensor:
        """An uninitialised tensor shaped like ``tensor`` (or ``shape``), with its device and dtype.

        It is valid until the next call for the same device and dtype.
        """
        shape = tensor.shape if shape is None else torch.Size(shape)
        key = (tensor.device, tensor.dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < shape.numel():
            # a view of the old buffer still alive keeps its memory: replacing never overwrites it
            buffer = self._buffers[key] = torch.empty(shape.numel(), dtype=tensor.dtype, device=tensor.device)
        return buffer[:shape.numel()].view(shape)


class SignParts(OpCall):
    """The weight and input of a convolution or dense layer by sign (:class:`~relprop.engine.ParametricCall`'s
    base), written into the :class:`Workspace` the calls of a pass share."""

    # set by ParametricCall
    workspace: Workspace
    _weight: Tensor
    _batch_norm: tuple[Tensor, Tensor] | None
    _merged_weight: Tensor | None
    _channel_dim: int | None

    @property
    def weight(self) -> Tensor:
        """The weight, a merged BatchNorm's scale included (:attr:`ParametricCall.weight
        <relprop.engine.ParametricCall.weight>`)."""
        raise NotImplementedError

    def _merge_weight(self, out: Tensor | None = None) -> Tensor:
        """The merged weight, in ``out`` or a new tensor (:class:`~relprop.engine.ParametricCall`'s)."""
        raise NotImplementedError

    def transpose_with(self, grad: Tensor, weight: Tensor, like: Tensor | None = None) -> Tensor:
        """One transposed product with another weight (:class:`~relprop.engine.ParametricCall`'s)."""
        raise NotImplementedError

    @overload
    def weight_parts(self, negative: Literal[True]) -> tuple[Tensor, Tensor]: ...
    @overload
    def weight_parts(self, negative: Literal[False]) -> tuple[Tensor, None]: ...

    def weight_parts(self, negative: bool) -> tuple[Tensor, Tensor | None]:
        """``W+`` and, if ``negative``, ``W-`` of :attr:`weight`.

        ``W+`` is written into the :class:`Workspace`: it is valid while the
        rule runs, until another op call asks for its ``W+``. ``W-`` is a new
        tensor. A merged weight that is not kept already is made for them and
        not kept.
        """
        w_pos = self.workspace.like(self._weight)
        w_neg = torch.empty_like(self._weight) if negative else None
        self._write_signs(w_pos, w_neg)
        return w_pos, w_neg

    def negative_weight(self, out: Tensor) -> Tensor:
        """``W-`` of :attr:`weight`, written into ``out``: a weight-sized tensor the caller is done with
        (its ``W+``)."""
        return torch.clamp(self._weight_in(out), max=0, out=out)

    def _write_signs(self, w_pos: Tensor, w_neg: Tensor | None) -> None:
        """``W+`` of :attr:`weight` written into ``w_pos`` and, unless None, ``W-`` into ``w_neg``."""
        weight = self._weight_in(w_pos)
        if w_neg is not None:
            torch.clamp(weight, max=0, out=w_neg)
        torch.clamp(weight, min=0, out=w_pos)  # last: `weight` may be `w_pos` itself

    def _weight_in(self, out: Tensor) -> Tensor:
        """:attr:`weight`; where that is a merged weight not kept, made in ``out`` (weight-shaped) for the caller."""
        if self._batch_norm is None or self._merged_weight is not None:
            return self.weight
        return self._merge_weight(out)

    def scale_input_channels(self, weight: Tensor, scale: Tensor) -> Tensor | None:
        """``weight`` (shaped like :attr:`weight`) multiplied in place by ``scale``, one factor per input channel.

        The op with the result equals the op on its input multiplied channel by
        channel by ``scale`` (a vector as long as the input has channels).
        None, and ``weight`` left as it is, where the weight does not index
        the input channels one by one (grouped convolutions).
        """
        dim = self._input_channel_dim(scale.numel())
        if dim is None:
            return None
        shape = [1] * weight.dim()
        shape[dim] = -1
        return weight.mul_(scale.reshape(shape))

    def _input_channel_dim(self, channels: int) -> int | None:
        """The weight dimension that indexes the input's ``channels`` channels one by one; None where none does.

        None for grouped convolutions, whose weight indexes the channels of one group.
        """
        if self._channel_dim is None:
            return None
        dim = 1 - self._channel_dim  # the weight's other leading dimension
        return dim if self._weight.shape[dim] == channels else None

    def stack_signs(self, x: Tensor) -> tuple[Tensor, Tensor] | None:
        """``x+`` and ``x-`` side by side along the input channels, and ``W+`` and ``W-`` of :attr:`weight` to match.

        The op with both (:attr:`evaluate`) is ``W+ x+ + W- x-``, and one
        transposed product with the stacked weight (:meth:`transpose_with`, the
        stacked input as ``like``) gives ``W+^T s`` and ``W-^T s`` side by
        side: one product each way instead of two. On a first layer of three
        colour channels that halves the cost of both, since the kernels
        handle six channels about as fast as three. The stacked weight is
        written into the :class:`Workspace`. None where the weight does not
        index the input channels one by one (grouped convolutions).
        """
        dim = self._input_channel_dim(x.shape[self.input_channel_axis(x)])
        if dim is None:
            return None
        shape = list(self._weight.shape)
        shape[dim] *= 2
        weights = self.workspace.like(self._weight, shape)
        self._write_signs(*weights.chunk(2, dim))
        axis, inputs = self._stacked_input(x)
        x_pos, x_neg = inputs.chunk(2, axis)
        torch.clamp(x, min=0, out=x_pos)
        torch.clamp(x, max=0, out=x_neg)
        return inputs, weights

    def transpose_beside(self, grad: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        """``W^T grad`` (``W``: :attr:`weight`) and ``weight^T grad``, from one transposed product.

        ``W`` and ``weight`` side by side along the input channels make one
        product: on a first layer of three colour channels about the cost of
        one of them. Only where the weight indexes the input channels one by
        one (:meth:`scale_input_channels` is not None).
        """
        x = self.inputs[0]
        axis, like = self._stacked_input(x)
        dim = self._input_channel_dim(x.shape[axis])
        assert dim is not None  # callers check scale_input_channels first
        stacked = torch.cat([self.weight, weight], dim)
        # the kernel reads the shape of `like` alone: memory never written is never faulted in
        ours, theirs = self.transpose_with(grad, stacked, like=like).chunk(2, axis)
        return ours, theirs

    def _stacked_input(self, x: Tensor) -> tuple[int, Tensor]:
        """The axis of ``x``'s channels, and an uninitialised input like ``x`` with twice as many channels."""
        axis = self.input_channel_axis(x)
        shape = list(x.shape)
        shape[axis] *= 2
        return axis, x.new_empty(shape)

    def input_channel_axis(self, x: Tensor) -> int:
        """The axis of ``x`` (an input of the op) holding its channels: 1 for convolutions, the last for dense ops."""
        return 1 if self.kind == OpKind.CONV else x.dim() - 1
