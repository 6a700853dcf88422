"""Sums, means, average pooling, interpolation, norms: linear in their activations."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from relprop._core.held import held
from relprop._core.kinds import OpKind
from relprop._core.registry import Handler, lookup, op_name, register, torch_and_tensor
from relprop._core.signatures import bind, bind_builtin
from relprop._core.tensors import constant, is_activation, plain_binary
from relprop.engine.calls import OpCall
from relprop.engine.sums import AddCall
from relprop.ops.attention import note_masked
from relprop.ops.host import OpHost
from relprop.ops.inplace import _in_place, _in_place_sum
from relprop.ops.routing import _run, _run_in_place


def _scatter_reduce(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``scatter_reduce``: a sum for ``"sum"`` and ``"mean"``, winner-take-all (routing) for ``"amax"``/``"amin"``."""
    reduce = bind_builtin(("input", "dim", "index", "src", "reduce"), args, kwargs).get("reduce")
    if reduce in ("sum", "mean"):
        return _sum(session, func, args, kwargs)
    if reduce in ("amax", "amin"):
        return _run(session, func, args, kwargs)
    return session.unknown(func, args, kwargs)


def _index_put(routing: Handler) -> Handler:
    """``index_put``: routing, unless it adds the values to the entries (``accumulate=True``): then a sum."""
    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        if not bind_builtin(("input", "indices", "values", "accumulate"), args, kwargs).get("accumulate", False):
            return routing(session, func, args, kwargs)
        if routing is _run:
            return _sum(session, func, args, kwargs)
        return _in_place(Tensor.index_put, _sum)(session, func, args, kwargs)
    return handle


def _norm(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """A vector norm: positively homogeneous of degree 1, so ``x * grad ||x||`` sums to ``||x||``.

    The epsilon rule on it (kind ``"sum"``) therefore conserves: ``R_i = R |x_i|^p / ||x||_p^p``. Its
    output is a statistic: in a product (ConvNeXt-V2's ``x * (gx / gx.mean())``) it takes no relevance.
    """
    call = session.record(OpKind.SUM, func, args, kwargs)
    if len(call.inputs) != 1:
        return session.unknown(func, args, kwargs)
    out = session.run(call)
    session.aliases.set_tag(out, "statistic")
    return out


def _grid_sample(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """Sampling the input at grid positions: a weighted sum of its pixels, shared like an interpolation.

    The grid says where to look: like a gate, it takes no relevance, also where a network computes it
    (spatial transformers).
    """
    bound = bind(func, args, kwargs)
    if not is_activation(bound["input"]):
        return session.unknown(func, args, kwargs)
    bound["grid"] = constant(bound["grid"])
    return _sum(session, func, (), bound)


def _linear(kind: OpKind, linearised: Callable | None = None) -> Handler:
    """Sums, means, average pooling, interpolation, normalisation: linear in their activations."""
    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        return session.run(session.record(kind, func, args, kwargs, linearised))
    return handle


def _sum(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """Sums, means, average pooling, interpolation: linear, shared by contributions (kind ``"sum"``).

    With one activation, the output keeps its tag: a gate shifted, resampled
    or summed is still a gate (``1 - sigmoid(g)`` in ConViT's gated attention,
    GhostNetV3's ``x * interpolate(sigmoid(r))``).
    """
    return _run_sum(session, session.record(OpKind.SUM, func, args, kwargs))


def _run_sum(session: OpHost, call: OpCall) -> Any:
    """Run a sum's ``call``; with one activation, the output keeps its tag (see :func:`_sum`)."""
    tag = session.aliases.tag(call.activations[0]) if len(call.inputs) == 1 else None
    out = session.run(call)
    if tag is not None:
        session.aliases.set_tag(out, tag)
    return out



def _add(sign: int) -> Handler:
    """``x + alpha * y`` (``sign`` 1) and ``x - alpha * y`` (-1): a sum with a closed-form VJP (:class:`AddCall`).

    Other forms (keyword tensors, ``out=``, mixed dtypes, a complex or tensor ``alpha``) go as any sum.
    """
    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        alpha = kwargs.get("alpha", 1)
        if not (plain_binary(args) and kwargs.keys() <= {"alpha"} and type(alpha) in (int, float)):
            return _sum(session, func, args, kwargs)
        call = AddCall(func, args, kwargs, op_name(func), session.module_name, sign * alpha)
        out = _run_sum(session, call)
        if sign == 1:
            note_masked(session, call, args, alpha, out)
        return out
    return handle


def _variance(centred: Tensor, dims: tuple[int, ...]) -> Tensor:
    """The (biased) variance of ``centred``, an input less its mean over ``dims``: its mean square.

    ``Tensor.var`` gives the same to rounding, but on a CPU it takes many times as long (on a transformer's
    layer norm input, longer than the layer norm itself).
    """
    return centred.square().mean(dims, keepdim=True)


def _layer_norm(input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None,
                bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Layer norm with the standard deviation held constant; the mean subtraction stays linear."""
    dims = tuple(range(-len(normalized_shape), 0))
    centred = input - input.mean(dims, keepdim=True)
    std = torch.sqrt(_variance(held(centred), dims) + eps)
    out = centred / std
    if weight is not None:
        out = out * weight
    return out + bias if bias is not None else out


def _group_norm(input: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None,
                eps: float = 1e-5) -> Tensor:
    """Group norm with the standard deviation held constant."""
    grouped = input.reshape(input.shape[0], num_groups, -1)
    centred = grouped - grouped.mean(-1, keepdim=True)
    std = torch.sqrt(_variance(held(centred), (-1,)) + eps)
    out = (centred / std).reshape(input.shape)
    shape = (1, -1) + (1,) * (input.dim() - 2)
    if weight is not None:
        out = out * weight.reshape(shape)
    return out + bias.reshape(shape) if bias is not None else out


def _rms_norm(input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None,
              eps: float | None = None) -> Tensor:
    """RMS norm with the root mean square held constant."""
    dims = tuple(range(-len(normalized_shape), 0))
    eps = torch.finfo(input.dtype).eps if eps is None else eps
    out = input * torch.rsqrt(held(input).pow(2).mean(dims, keepdim=True) + eps)
    return out * weight if weight is not None else out


# F.fold adds overlapping patches: a sum (its gradient would copy each pixel's relevance to every patch)
register(_sum, torch_and_tensor("sum mean nansum cumsum"), lookup(torch, "rsub"),
          lookup(Tensor, "__radd__ __rsub__"), [F.fold])
register(_sum, lookup(torch, "avg_pool1d"), lookup(torch._C._nn, "avg_pool2d avg_pool3d"),
          lookup(F, "adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d interpolate upsample "
                     "upsample_bilinear upsample_nearest"))
# sums into entries chosen by an index (a mixture of experts adding each expert's output to its tokens' rows)
register(_sum, torch_and_tensor("index_add scatter_add"))
register(_in_place(Tensor.index_add, _sum), lookup(Tensor, "index_add_"))
register(_in_place(Tensor.scatter_add, _sum), lookup(Tensor, "scatter_add_"))
register(_index_put(_run), torch_and_tensor("index_put"))
register(_scatter_reduce, torch_and_tensor("scatter_reduce"))
# PyG's max and min aggregations reduce messages into zeros in place (torch_geometric.utils.scatter)
register(_in_place(Tensor.scatter_reduce, _scatter_reduce), lookup(Tensor, "scatter_reduce_"))
register(_index_put(_run_in_place), lookup(Tensor, "index_put_"))
register(_add(1), torch_and_tensor("add"))
register(_add(-1), torch_and_tensor("sub"))
register(_in_place_sum(Tensor.add, 1, _sum), lookup(Tensor, "add_ __iadd__"))
register(_in_place_sum(Tensor.sub, -1, _sum), lookup(Tensor, "sub_ __isub__"))

register(_linear(OpKind.NORM, _layer_norm), [F.layer_norm])
register(_linear(OpKind.NORM, _group_norm), [F.group_norm])
register(_linear(OpKind.NORM, _rms_norm), lookup(F, "rms_norm"))


register(_norm, torch_and_tensor("norm"), lookup(torch.linalg, "norm vector_norm"))
register(_grid_sample, [F.grid_sample])
