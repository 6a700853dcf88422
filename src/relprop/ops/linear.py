"""Convolutions and dense layers (``f(x; weight, bias)``), BatchNorm merged into them."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from relprop._core.kinds import OpKind
from relprop._core.registry import Handler, lookup, op_name, register, torch_and_tensor
from relprop._core.signatures import bind, bind_builtin
from relprop._core.tensors import constant, held_rows, holds, is_activation
from relprop.engine.parametric import ParametricCall, batch_norm_affine
from relprop.ops.host import OpHost
from relprop.ops.products import _ADD_PRODUCTS, _MATRIX

_CONV = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_TRANSPOSE = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
_LINEAR = ("input", "weight", "bias")


def _conv_vjp(x: Tensor, weight: Tensor, options: dict, transposed: bool) -> Callable[[Tensor], Tensor] | None:
    """The VJP of a convolution with respect to its input, as one transposed convolution (no autograd)."""
    dims = weight.dim() - 2

    def expand(value: Any) -> list[int]:
        return [value] * dims if isinstance(value, int) else list(value)

    padding = options.get("padding", 0)
    if isinstance(padding, str):  # "same" / "valid": leave it to autograd
        return None
    stride, padding, dilation = expand(options.get("stride", 1)), expand(padding), expand(options.get("dilation", 1))
    output_padding = expand(options.get("output_padding", 0)) if transposed else [0] * dims
    groups = options.get("groups", 1)

    def transpose(grad: Tensor, weight: Tensor = weight, like: Tensor | None = None) -> Tensor:
        # the kernel reads only the shape of the input `like`; under autocast the relevance may be in the autocast
        # dtype where the weight is not (an aten op is not cast for it)
        shape = x if like is None else like
        if weight.dtype != grad.dtype or shape.dtype != grad.dtype:
            weight, shape = weight.to(grad.dtype), shape.to(grad.dtype)
        return torch.ops.aten.convolution_backward(grad, shape, weight, None, stride, padding,
                                                   dilation, transposed, output_padding, groups,
                                                   [True, False, False])[0]
    return transpose


#: a dense layer's transposed product ``grad @ W`` looks for the rows and columns of ``grad`` that hold relevance
#: from this many multiply-adds on (a few reductions over ``grad``, against ``in_features`` multiply-adds per entry)
SPARSE_PRODUCT_SIZE = 1 << 24
#: ... and multiplies the columns that hold relevance alone where at most this share of them do: the copies of
#: those columns and of their weight rows cost a pass over each, so the product must shrink well below its size
SPARSE_COLUMNS_SHARE = 1 / 4


def dense_transpose(grad: Tensor, weight: Tensor) -> Tensor:
    """The VJP of a dense layer with respect to its input, ``grad @ weight`` (``weight``: out x in features).

    Relevance is often zero in most of its entries: explaining one logit of a
    language-model head puts it in one entry of ``(tokens, vocabulary)``, and
    a classifier that reads one token of a sequence (BERT's ``[CLS]``) hands
    relevance to that token's row alone. There the product skips the zeros:
    where at most half the rows of ``grad`` hold relevance
    (:func:`~relprop._core.tensors.held_rows`), those rows are multiplied
    alone, each bitwise as in the dense product of those rows; else, where
    few columns hold relevance (a logit explained at every position), those
    columns are multiplied with the weight rows they select. Both equal the
    dense product up to the order of its sums. On a CPU only: the sparse
    forms read how many rows or columns hold relevance on the host, and on a
    GPU reading it waits for every kernel queued before.
    """
    if grad.device.type != "cpu" or grad.numel() * weight.shape[1] < SPARSE_PRODUCT_SIZE:
        return grad @ weight
    flat = grad.reshape(-1, grad.shape[-1])
    rows = held_rows(flat)
    if rows is not None:
        out = flat.new_zeros(len(flat), weight.shape[1]).index_copy_(0, rows, flat[rows] @ weight)
    else:
        columns = holds(flat, 0).nonzero().squeeze(1)
        if len(columns) > SPARSE_COLUMNS_SHARE * flat.shape[1]:
            return grad @ weight
        out = flat.index_select(1, columns) @ weight.index_select(0, columns)
    return out.view(*grad.shape[:-1], weight.shape[1])


def _parametric(kind: OpKind, names: tuple[str, ...]) -> Handler:
    """Convolutions and dense layers: ``f(x; weight, bias)``, rule from the composite."""
    transposed = names is _CONV_TRANSPOSE

    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        bound = bind_builtin(names, args, kwargs)
        x, original_weight, original_bias = bound.get("input"), bound.get("weight"), bound.get("bias")
        if not is_activation(x):
            return func(*args, **kwargs)
        # rules see constants; weights computed from the input count as constants too
        assert original_weight is not None  # torch's convolutions and F.linear take a weight
        weight = original_weight.detach()
        bias = original_bias.detach() if original_bias is not None else None
        options = {key: value for key, value in bound.items() if key not in _LINEAR}
        transpose: Callable[..., Tensor] | None
        channel_dim: int | None

        def evaluate(inp: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
            return func(inp, w, b, **options)

        if kind == OpKind.DENSE:
            transpose, channel_dim = (lambda grad, w=weight, like=None: dense_transpose(grad, w)), 0  # shape from w
        else:
            transpose = _conv_vjp(x.detach(), weight, options, transposed)
            # a merged BatchNorm scales the weight's output-channel dimension: 1 for transposed
            # convolutions, which holds output channels only for groups == 1
            channel_dim = (1 if options.get("groups", 1) == 1 else None) if transposed else 0
        # the forward value comes from the model's own parameters: some kernels choose by requires_grad
        call = ParametricCall(kind, func, (x, constant(original_weight), constant(original_bias)), options,
                              op_name(func), session.module_name, weight, bias, evaluate, channel_dim, transpose,
                              session.workspace, is_first=session.fed_by_input(x),
                              input_nonnegative=session.aliases.relu_output(x))
        return session.run(call)
    return handle


def _addmm(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``addmm(bias, x, W)`` with a constant ``W`` (in x out), as Hugging Face's ``Conv1D`` writes a dense layer."""
    bound = bind_builtin(("input", "mat1", "mat2"), args, kwargs)
    bias, x, weight = bound.get("input"), bound.get("mat1"), bound.get("mat2")
    # a dense layer's bias is one value per output feature (or one for all); another (per row) is a sum
    per_feature = bias is None or (isinstance(bias, Tensor) and all(size == 1 for size in bias.shape[:-1]))
    if is_activation(weight) or is_activation(bias) or set(bound) - {"input", "mat1", "mat2"} or not per_feature:
        return _ADD_PRODUCTS["addmm"](session, func, args, kwargs)
    if not is_activation(x):
        return func(*args, **kwargs)
    assert isinstance(weight, Tensor) and (bias is None or isinstance(bias, Tensor))
    return _dense_by_matrix(session, func, (bias, x, weight), x, weight, bias)


def _matrix_product(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``x @ C`` with a constant floating-point matrix ``C`` (in x out) is a dense layer written by hand
    (``x @ self.weight.T``): the composite's rule for dense layers. Every other matrix product is a product."""
    if (len(args) == 2 and not kwargs and is_activation(args[0]) and args[0].dim() >= 2
            and isinstance(args[1], Tensor) and not is_activation(args[1]) and args[1].dim() == 2
            and args[1].is_floating_point()):
        return _dense_by_matrix(session, func, args, args[0], args[1], None)
    return _MATRIX(session, func, args, kwargs)


def _dense_by_matrix(session: OpHost, func: Callable, args: tuple, x: Tensor, weight: Tensor,
                     bias: Tensor | None) -> Any:
    """A dense layer ``x @ weight (+ bias)`` with its weight as in x out (``func(*args)`` computes it)."""
    def evaluate(inp: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return inp @ w if b is None else torch.addmm(b, inp, w)

    constants = (weight.detach(), bias.detach() if bias is not None else None)
    call = ParametricCall(OpKind.DENSE, func, tuple(constant(a) if a is not x else a for a in args), {},
                          op_name(func), session.module_name, *constants, evaluate, 1,
                          lambda grad, w=constants[0], like=None: dense_transpose(grad, w.T), session.workspace,
                          is_first=session.fed_by_input(x), input_nonnegative=session.aliases.relu_output(x))
    return session.run(call)


def _batch_norm(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """BatchNorm: merged into the conv/dense op that produced its input, else an affine map."""
    bound = bind(F.batch_norm, args, kwargs)
    x = bound["input"]
    if not is_activation(x):
        return func(*args, **kwargs)
    producer = session.aliases.producer(x)
    mean, var = bound["running_mean"], bound["running_var"]
    # the BatchNorm normalises dimension 1; a dense layer's output features are its last
    if (not isinstance(producer, ParametricCall) or not producer.merges_batch_norm
            or (producer.kind == OpKind.DENSE and x.dim() != 2)
            or bound["training"] or mean is None or session.module_rule() is not None):
        return session.run(session.record(OpKind.BATCHNORM, func, args, kwargs))
    scale, shift = batch_norm_affine(bound)

    def batch_norm(z: Tensor) -> Tensor:
        return func(z, mean, var, bound["weight"], bound["bias"], False, bound["momentum"], bound["eps"])

    # both modules in the name, so that every merge shows in messages and in the audit
    merged = producer.merge_batch_norm(batch_norm, scale, shift, x, f"{producer.module_name}+{session.module_name}")
    out = session.run(merged, rule=producer.rule)
    record = session.tapped.get(x)
    # a tap between the layer and its BatchNorm moves behind the merged pair: there the relevance arrives
    return out if record is None else session.tap(out, record)


register(_parametric(OpKind.CONV, _CONV), lookup(torch, "conv1d conv2d conv3d"))
register(_parametric(OpKind.CONV, _CONV_TRANSPOSE), lookup(torch, "conv_transpose1d conv_transpose2d conv_transpose3d"))
register(_parametric(OpKind.DENSE, _LINEAR), [F.linear])
register(_addmm, [torch.addmm, Tensor.addmm])
register(_batch_norm, [F.batch_norm])


register(_matrix_product, torch_and_tensor("matmul mm"), lookup(Tensor, "__matmul__"))
