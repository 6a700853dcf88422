"""Parametric linear op calls (convolutions, dense layers): their weight and bias, a BatchNorm merged in, and
their transposed products."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self

import torch
from torch import Tensor

from relprop._core.kinds import OpKind
from relprop._core.tensors import held_rows, is_activation
from relprop.engine.nodes import is_relevance_node
from relprop.engine.sign_parts import SignParts, Workspace

#: autograd nodes searched for the model input that an activation comes from
_INPUT_SEARCH = 256


def model_input(x: Tensor) -> Tensor | None:
    """The model input that ``x`` is made from by routing ops alone (reshape, pad, ...); None if there is none.

    ``x`` itself if it is the model input. None where an op with a rule lies on
    the way (``x`` is not just the input rearranged) or the graph is too large
    to search.
    """
    if x.grad_fn is None:
        return x if is_activation(x) else None
    stack, seen, found = [x.grad_fn], set[int](), None
    while stack:
        node = stack.pop()
        if is_relevance_node(node) or len(seen) > _INPUT_SEARCH:
            return None
        variable = getattr(node, "variable", None)
        if not node.next_functions and is_activation(variable):
            found = variable  # a model input (parameters are leaves too, but not inputs)
        for parent, _ in node.next_functions:
            if parent is not None and id(parent) not in seen:
                seen.add(id(parent))
                stack.append(parent)
    return found


def routed_image(x: Tensor, image: float | Tensor) -> Tensor | None:
    """``image``, in the space of the model input ``x`` is made from, taken through the same routing ops.

    The routing ops between the input and ``x`` are a linear map ``J`` (a
    space-to-depth, a crop, a zero padding); ``J image`` comes from two
    vector-Jacobian products, ``J^T u`` and its own VJP, on the model's
    graph, which stays as it is. ``image`` broadcasts against the input. None
    where ``x`` is not made from a model input by routing ops alone.
    """
    source = model_input(x)
    if source is None:
        return None
    image = torch.as_tensor(image, dtype=source.dtype, device=source.device).expand_as(source)
    with torch.enable_grad():
        probe = torch.zeros_like(x, requires_grad=True)
        (back,) = torch.autograd.grad(x, source, probe, create_graph=True, retain_graph=True)
        (forward,) = torch.autograd.grad(back, probe, image)
    return forward.detach()


def batch_norm_affine(bound: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """``F.batch_norm``'s arguments (bound by name, running statistics) as the affine map it applies per
    channel: ``(scale, shift)`` with ``batch_norm(z) = scale * z + shift``. Merged into the layer that produced
    ``z``: ``f(x; scale W, scale b + shift)``."""
    mean, var = bound["running_mean"], bound["running_var"]
    weight = bound["weight"] if bound["weight"] is not None else torch.ones_like(var)
    bias = bound["bias"] if bound["bias"] is not None else torch.zeros_like(mean)
    scale = weight / torch.sqrt(var + bound["eps"])
    return scale, bias - mean * scale


def scaled_output_channels(weight: Tensor, scale: Tensor, channel_dim: int, out: Tensor | None = None) -> Tensor:
    """``weight`` with ``scale`` on its output channels (dimension ``channel_dim``), in ``out`` or a new tensor."""
    shape = [1] * weight.dim()
    shape[channel_dim] = -1
    return torch.mul(weight, scale.reshape(shape), out=out)


class ParametricCall(SignParts):
    """A parametric linear op ``f(x; weight, bias)`` (convolution, dense layer).

    ``weight`` and ``bias`` are constants here; a BatchNorm that directly
    follows the op is merged into them by :meth:`merge_batch_norm`. With
    ``transpose`` (the op's VJP with respect to ``x``, e.g. a transposed
    convolution) no autograd graph is kept for epsilon-type rules; it is
    called as ``transpose(grad, weight, like)``, where ``like`` is an input of
    the shape the op with ``weight`` takes, None for the op's own input (see
    :meth:`stack_signs`).
    """

    def __init__(self, kind: OpKind, func: Callable, args: tuple, kwargs: dict, name: str, module_name: str,
                 weight: Tensor, bias: Tensor | None,
                 evaluate: Callable[[Tensor, Tensor, Tensor | None], Tensor], channel_dim: int | None,
                 transpose: Callable[..., Tensor] | None, workspace: Workspace, is_first: bool = False,
                 input_nonnegative: bool = False):
        super().__init__(kind, func, args, kwargs, name, module_name)
        #: the op itself, called as ``evaluate(x, weight, bias)``
        self.evaluate = evaluate
        self.workspace = workspace
        self.is_first = is_first
        #: whether the input is known to be >= 0 (a ReLU's output), so that rules need not check its sign
        self.input_nonnegative = input_nonnegative
        self._weight, self._bias = weight, bias
        self._channel_dim = channel_dim  # weight dimension that indexes output channels
        self._transpose = transpose
        self._batch_norm: tuple[Tensor, Tensor] | None = None  # merged (scale, shift) per output channel
        self._merged_weight: Tensor | None = None
        self._merged_bias: Tensor | None = None
        self._value: Tensor | None = None

    @property
    def weight(self) -> Tensor:
        """The weight, a merged BatchNorm's scale included (computed on first use, kept until :meth:`finish`)."""
        if self._batch_norm is None:
            return self._weight
        if self._merged_weight is None:  # only rules that modify parameters need it
            self._merged_weight = self._merge_weight()
        return self._merged_weight

    @property
    def bias(self) -> Tensor | None:
        """The bias, a merged BatchNorm's scale and shift included."""
        if self._batch_norm is None:
            return self._bias
        if self._merged_bias is None:
            scale, shift = self._batch_norm
            self._merged_bias = shift if self._bias is None else self._bias * scale + shift
        return self._merged_bias

    def _merge_weight(self, out: Tensor | None = None) -> Tensor:
        """The weight with the merged BatchNorm's scale on its output channels, in ``out`` or a new tensor."""
        assert self._batch_norm is not None and self._channel_dim is not None  # only a merged call merges
        return scaled_output_channels(self._weight, self._batch_norm[0], self._channel_dim, out)

    def routed_image(self, image: float | Tensor) -> Tensor | None:
        """``image``, in the model input's space, taken through the routing ops that made this op's input.

        None where the input is not the model input rearranged (see :func:`routed_image`).
        """
        return routed_image(self.activations[0], image)

    def _output_shape(self, vector: Tensor) -> Tensor:
        """A per-channel vector shaped to broadcast against the output."""
        shape = [1] * self.output_dim
        shape[1 if self.kind == OpKind.CONV else -1] = -1
        return vector.reshape(shape)

    @property
    def arguments(self) -> dict[str, Any]:
        """``weight`` and ``bias`` (a merged BatchNorm included) and the op's options (``stride``, ``padding``, ...)."""
        return {"weight": self.weight, "bias": self.bias, **self._constants}

    def bias_term(self) -> Tensor:
        """The bias, shaped to broadcast against the output."""
        bias = self.bias
        assert bias is not None  # called where there is a bias
        return self._output_shape(bias)

    def _needs_graph(self) -> bool:
        return self._transpose is None and super()._needs_graph()

    def recompute(self) -> Tensor:
        with torch.no_grad():  # a merged BatchNorm included
            return self.evaluate(self.inputs[0], self.weight, self.bias)

    def release(self) -> None:
        """Keep the data input: a BatchNorm that follows builds its merged node on it."""

    def _build_graph(self) -> None:
        if self._batch_norm is None:  # a merged call's graph ends in the BatchNorm; the op's VJP saves no input
            super()._build_graph()

    def finish(self) -> None:
        super().finish()
        if self.reusable:
            return
        self._merged_weight = None  # a copy of the layer's weights, else kept until the graph is freed
        self._transpose = None  # a transposed convolution holds its input (for the shape)

    def run(self) -> Tensor:
        if self._value is not None:  # a merged call: the output was computed by the BatchNorm itself
            value, self._value = self._value, None
            return value
        return super().run()

    def vjp(self, grad: Tensor) -> tuple[Tensor | None, ...]:
        transpose = self._transpose
        if self._graph is not None or transpose is None:
            return super().vjp(grad)
        if self._batch_norm is None:
            return (transpose(grad),)  # no graph kept: the op is transposable
        # the merged BatchNorm's scale goes onto the weight or onto the relevance, whichever is smaller
        if self._weight.numel() < grad.numel():
            return (transpose(grad, self.weight),)
        return (transpose(grad * self._output_shape(self._batch_norm[0])),)

    def vjp_scaled(self, grad: Tensor, scale: Callable[[Tensor, Tensor | None], Tensor]) -> tuple[Tensor | None, ...]:
        """:meth:`vjp` of ``grad * scale(z, b)``: ``z`` the output, ``b`` the bias broadcast against it (None without).

        On a vocabulary head (:attr:`_head`) whose ``grad`` holds relevance in
        few rows (:func:`~relprop._core.tensors.held_rows`), ``scale`` sees
        those rows of the output alone (``b``: the bias vector) and their
        product alone is transposed: a dense layer maps each row of its input
        to the same row of its output, so the other rows of the result are 0,
        and every entry of the scaled rows is bitwise as on the whole output.
        """
        transpose = self._transpose if self._head and self._batch_norm is None else None
        rows = None if transpose is None else held_rows(grad)
        if transpose is None or rows is None:
            return self.vjp(grad * scale(self.output, None if self.bias is None else self.bias_term()))
        width = grad.shape[-1]
        held = grad.reshape(-1, width)[rows]
        found = transpose(held.mul_(scale(self.output.reshape(-1, width)[rows], self.bias)))
        out = found.new_zeros(grad.numel() // width, found.shape[-1]).index_copy_(0, rows, found)
        return (out.view(*grad.shape[:-1], found.shape[-1]),)

    @property
    def runs_as_autograd(self) -> bool:
        return self._batch_norm is None and not self._head

    @property
    def replays(self) -> bool:  # type: ignore[override]  # a property where OpCall has a class attribute
        # a convolution's transposed product holds its input (for the shape); a merged BatchNorm, its statistics
        return self.kind == OpKind.DENSE and self._batch_norm is None

    def rebound(self, args: tuple, kwargs: dict) -> Self:
        call = super().rebound(args, kwargs)
        call._merged_weight = call._merged_bias = call._value = None
        return call

    @property
    def _head(self) -> bool:
        """Whether this is a dense layer much wider than its input on a CPU, as a language model's vocabulary head.

        The relevance reaching such a layer is most often one logit: its node's transposed product skips the zeros
        (``relprop.ops.dense_transpose``), where plain autograd would multiply them all.
        """
        weight = self._weight
        return self.kind == OpKind.DENSE and weight.device.type == "cpu" and weight.shape[0] >= 8 * weight.shape[-1]

    @property
    def merges_batch_norm(self) -> bool:
        """Whether a BatchNorm that follows can be merged in (:meth:`merge_batch_norm`): the weight indexes the
        output channels along one dimension (not a grouped transposed convolution)."""
        return self._channel_dim is not None

    @property
    def transposable(self) -> bool:
        """Whether :meth:`transpose_with` is available (no string padding, no private graph needed)."""
        return self._transpose is not None

    def transpose_with(self, grad: Tensor, weight: Tensor, like: Tensor | None = None) -> Tensor:
        """The VJP with respect to the input of the op with another ``weight``: one transposed product.

        ``like``: an input of the shape the op with ``weight`` takes, where that is not the shape of :attr:`~relprop.engine.OpCall.inputs`
        (a stacked weight, see :meth:`stack_signs`).
        """
        transpose = self._transpose
        if transpose is None:
            raise RuntimeError(f"relprop: {self.describe()} is not transposable: check call.transposable first")
        return transpose(grad, weight, like)

    def merge_batch_norm(self, batch_norm: Callable[[Tensor], Tensor], scale: Tensor, shift: Tensor,
                         output: Tensor, module_name: str) -> "ParametricCall":
        """A copy of this call with ``batch_norm(f(x)) = f(x; scale*W, scale*b + shift)`` merged in.

        The merged output is ``batch_norm`` applied to ``output``, this call's
        output, so it stays bitwise the plain model's. On a call that has a
        BatchNorm merged already (``conv -> bn -> bn2``) the two compose:
        ``scale * (scale0 * z + shift0) + shift``. This call stays as it is, for
        the other ops that read its output. ``module_name`` names the modules of both.
        """
        if self._batch_norm is not None:
            scale0, shift0 = self._batch_norm
            scale, shift = scale0 * scale, shift0 * scale + shift
        merged = object.__new__(type(self))  # a shallow copy; copy.copy costs as much as a small op
        merged.__dict__.update(self.__dict__)
        merged._batch_norm = (scale, shift)
        merged._merged_weight = merged._merged_bias = None  # this call's, if it made them already
        merged._prepared = False
        merged.name = f"{self.name}+batch_norm"
        merged.module_name = module_name
        merged._value = batch_norm(output.detach())
        if self._graph is not None:
            leaves, out = self._graph
            with torch.enable_grad():
                merged._graph = (leaves, batch_norm(out))
        return merged
