"""Tensor utilities: what counts as an activation, gradients summed back to a shape, the rows that hold entries."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeGuard

import torch
from torch import Tensor

# private functions of torch._C that its type stubs lack, looked up once (they run for many ops)
#: whether two tensors share memory (views and aliases included)
is_alias_of: Callable[[Tensor, Tensor], bool] = getattr(torch._C, "_is_alias_of")
#: the address of a tensor's memory: a key for it that makes no storage object (one would count as a reference)
storage_address: Callable[[Tensor], int] = getattr(torch._C, "_storage_address")
#: the references to the memory at an address; None where this torch does not expose the count
storage_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)

_Parameter = torch.nn.Parameter  # looked up once: `torch.nn.Parameter` costs three attribute lookups per call


def is_activation(value: Any) -> TypeGuard[Tensor]:
    """An activation: a tensor derived from a model input. Parameters are constants."""
    # isinstance(value, Parameter) in two cheap steps (it runs for every argument of every op): the type, and
    # the flag by which Parameter's own instance check also accepts tensor subclasses
    return (isinstance(value, Tensor) and value.requires_grad and not issubclass(type(value), _Parameter)
            and not getattr(value, "_is_param", False))


def is_parameter(value: Tensor) -> bool:
    """A parameter: a ``torch.nn.Parameter`` (a frozen one too), or another tensor that requires grad and is no
    activation. Captured plans know parameters by identity and memory, other constants by shape alone."""
    return issubclass(type(value), _Parameter) or getattr(value, "_is_param", False) or (
        value.requires_grad and not is_activation(value))


_CONTAINERS = (list, tuple, dict)


def holds_activation(value: Any) -> bool:
    """Whether a list, tuple or dict holds an activation, at any depth."""
    for item in value.values() if isinstance(value, dict) else value:
        if is_activation(item) if isinstance(item, Tensor) else (
                isinstance(item, _CONTAINERS) and holds_activation(item)):
            return True
    return False


def positional_activations(args: tuple) -> tuple[list, list[int] | None]:
    """``args`` as a list, and the indices of the activations among them; None if a list or tuple holds one."""
    slots = []
    for index, value in enumerate(args):
        if isinstance(value, Tensor):
            if is_activation(value):
                slots.append(index)
        elif isinstance(value, _CONTAINERS) and holds_activation(value):
            return list(args), None
    return list(args), slots


def sum_to(tensor: Tensor, shape: torch.Size) -> Tensor:
    """``tensor`` summed over the dimensions along which ``shape`` was broadcast (itself where the shapes match)."""
    return tensor if tensor.shape == shape else tensor.sum_to_size(shape)


def per_unit(relevance: Tensor, x: Tensor, owned: bool = False) -> Tensor:
    """``relevance / x``, the relevance per unit of ``x`` (its gradient form); 0 where ``x`` is 0.

    ``owned``: ``relevance`` is the caller's to overwrite, and the result is written into it.
    """
    quotient = relevance.div_(x) if owned and relevance.shape == x.shape else relevance / x
    return quotient.masked_fill_(x == 0, 0.0)


def holds(tensor: Tensor, dim: int) -> Tensor:
    """Whether each slice of ``tensor`` along ``dim`` holds an entry other than 0 (NaN and infinities do).

    ``amax`` and ``amin`` over ``dim`` (both propagate NaN): on a CPU torch's
    ``any`` reduction of a floating-point tensor is several times slower than
    the two together.
    """
    return tensor.amax(dim).ne(0).logical_or_(tensor.amin(dim).ne(0))


#: rows are worked on alone where at most this share of them hold entries: gathering them and scattering the
#: result costs a pass over the rows taken, which the rows skipped pay for
HELD_ROWS_SHARE = 0.5


def held_rows(tensor: Tensor) -> Tensor | None:
    """The rows of ``tensor`` that hold entries other than 0, where they are few: their indices, ascending.

    ``tensor`` is taken as rows of its last dimension (``reshape(-1,
    tensor.shape[-1])``): relevance at a few positions of a sequence (one
    next-token logit of a vocabulary) leaves most of them 0. None where
    more than :data:`HELD_ROWS_SHARE` of the rows hold entries, and for a
    tensor with no rows to skip (fewer than 2 dimensions, or empty). NaN
    and infinities count as entries. Two reductions over ``tensor`` find the
    rows (:func:`holds`); ``nonzero``, slow on a CPU, then reads their mask
    alone.
    """
    if tensor.dim() < 2 or not tensor.numel():
        return None
    flat = tensor.reshape(-1, tensor.shape[-1])
    rows = holds(flat, 1).nonzero().squeeze(1)
    return rows if len(rows) <= HELD_ROWS_SHARE * len(flat) else None


def has_activation(args: tuple, kwargs: dict) -> bool:
    """Whether any argument (or element of a list argument) is an activation."""
    for value in (*args, *kwargs.values()):
        if is_activation(value):
            return True
        if isinstance(value, (list, tuple)) and any(is_activation(v) for v in value):
            return True
    return False


def has_parameter(args: tuple, kwargs: dict) -> bool:
    """Whether any argument (or element of a list argument) is a tensor that requires grad (a parameter)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor) and value.requires_grad:
            return True
        if isinstance(value, (list, tuple)) and any(isinstance(v, Tensor) and v.requires_grad for v in value):
            return True
    return False


def constant(value: Any) -> Any:
    """``value`` as a constant of an op: activations detached, parameters and others as they are."""
    return value.detach() if is_activation(value) else value


def plain_binary(args: tuple) -> bool:
    """Whether ``args`` are two tensors of one floating dtype and device, or such a tensor and a real number.

    For those, autograd's VJP of a sum or product is the closed form, bitwise: it casts no gradient to
    another dtype or device.
    """
    if len(args) != 2 or not all(isinstance(a, Tensor) or type(a) in (int, float) for a in args):
        return False
    tensors = [a for a in args if isinstance(a, Tensor)]
    return (bool(tensors) and tensors[0].is_floating_point()
            and all(t.dtype == tensors[0].dtype and t.device == tensors[0].device for t in tensors))


def rounding(dtype: torch.dtype) -> float:
    """The relative difference two ways of computing one value in ``dtype`` may show: the square root of its
    machine epsilon, and float32's at least, because models in wider types still run some ops in float32 (Hugging
    Face's RMSNorm, rotary embedding and eager softmax)."""
    return max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps) ** 0.5


def agrees(a: Tensor, b: Tensor) -> Tensor:
    """Whether ``a`` equals ``b`` to the rounding of ``b``'s dtype, relative to each entry and to ``b``'s largest
    finite entry (NaN where both are NaN), as a boolean tensor: traceable, so that a compiled program checks it
    on every run."""
    tolerance = rounding(b.dtype)
    size = b.abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).amax() if b.numel() else b.new_zeros(())
    close = (a - b).abs() <= tolerance * size + tolerance * b.abs()
    return (close | (a == b) | (a.isnan() & b.isnan())).all()

