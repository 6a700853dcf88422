"""What an attribution explains: the model's logits, the target chosen in them, and the seed put there.

``target`` follows captum: an int (class along dim 1), a tuple indexing the trailing dimensions, a list or
1-D tensor with one target per example, or None for one output per example; the output relevance (the
seed) is the target's output value, so that relevance sums to about ``f_t(x)``.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from relprop.methods._inputs import Target, as_tuple


def model_logits(output: Any) -> Tensor:
    """The tensor a model's output is explained on: itself, its ``logits``, or its first tensor."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping) or hasattr(output, "keys"):
        if "logits" in output.keys() and isinstance(output["logits"], Tensor):
            return output["logits"]
        values = list(output.values())
    elif isinstance(output, (tuple, list)):
        values = list(output)
    else:
        raise TypeError(f"relprop: the model returned {type(output).__name__}; expected a tensor, a tuple, "
                        "a dict or a ModelOutput holding one")
    for value in values:
        if isinstance(value, Tensor):
            return value
    raise TypeError(f"relprop: the model returned a {type(output).__name__} without any tensor to explain")


#: the warning where a seed gives relevance to a logit of 0, which relevance per unit of activation cannot carry
LOST_SEED = ("relprop: the seed gives relevance to outputs of value 0, which relevance per unit of activation cannot "
             "carry; it is lost (explain with a composite without gradient_form)")


def _is_index(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.dim() == 0 and not value.is_floating_point() and value.dtype != torch.bool
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _per_example(value: Any) -> bool:
    """Whether an entry of a tuple target holds one index per example (a 1-D integer tensor, or a list)."""
    if isinstance(value, Tensor):
        return value.dim() == 1 and not value.is_floating_point() and value.dtype != torch.bool
    return isinstance(value, list)


def _column(values: Sequence[Any], target: Any) -> list[int]:
    """Integer indices as Python ints; a TypeError that names ``target`` where one is not an integer."""
    for value in values:
        if not _is_index(value):
            raise TypeError(f"relprop: target {target!r} must hold integers, got {type(value).__name__}")
    return [int(value) for value in values]


def _selects_otherwise(target: Any) -> bool:
    """A :class:`Contrastive` or an output relevance (a floating-point tensor): a seed that indices cannot say."""
    return isinstance(target, Contrastive) or isinstance(target, Tensor) and target.is_floating_point()


def target_columns(target: Target) -> tuple[list[int], ...] | None:
    """``target`` as indices: the one reading of a target in relprop.

    One list per indexed dimension after the batch dimension, of one index for every example or one per
    example; ``()`` for None (the one output of each example). None where ``target`` selects otherwise (a
    :class:`Contrastive`, an output relevance). :func:`checked_columns` checks them against an output;
    :func:`target_mask` and, as tensors, :func:`target_indices` take them from here.

    Raises
    ------
    TypeError
        ``target`` is of another type, or holds something other than integers.
    ValueError
        A target tensor that is not 1-D, an empty list, or a list whose targets index different numbers of
        dimensions.
    """
    if target is None:
        return ()
    if _selects_otherwise(target):
        return None
    if _is_index(target):
        return (_column([target], target),)
    if isinstance(target, tuple):  # one index per dimension, each for every example or one per example
        return tuple(_column(value.tolist() if isinstance(value, Tensor) else value, target) if _per_example(value)
                     else _column([value], target) for value in target)
    if isinstance(target, Tensor) and target.dim() != 1:
        raise ValueError(f"relprop: a target tensor must be 1-D (one class per example), got shape "
                         f"{tuple(target.shape)}")
    if not isinstance(target, (list, Tensor)):
        raise TypeError(f"relprop: target must be None, an int, a tuple, a list or a tensor, "
                        f"got {type(target).__name__}")
    if isinstance(target, Tensor) and target.dtype != torch.bool and len(target):
        return (target.tolist(),)  # integers, one per example (a training loop's labels): no entry to check
    rows = [item if isinstance(item, tuple) else (item,) for item in (target.tolist() if isinstance(target, Tensor)
                                                                      else target)]
    if not rows:
        raise ValueError("relprop: the target list is empty; give one target, or one per example")
    if len({len(row) for row in rows}) > 1:
        raise ValueError(f"relprop: the targets of {target!r} index different numbers of dimensions")
    return tuple(_column(column, target) for column in zip(*rows))


def checked_columns(columns: tuple[list[int], ...], shape: torch.Size, target: Any) -> tuple[list[int], ...]:
    """:func:`target_columns`'s ``columns``, checked against a model output of ``shape``: as many dimensions as
    it has after the batch dimension at most, one index or one per example, each in range. ``target`` names
    the problem in the error."""
    batch = shape[0] if len(shape) else 1
    if not columns and math.prod(shape) != batch:
        raise ValueError(f"relprop: the model output has shape {tuple(shape)}, more than one value per "
                         "example; pass target= to choose which one to explain")
    if len(columns) > len(shape) - 1:
        raise ValueError(f"relprop: target {target!r} has {len(columns)} indices, but the model output of shape "
                         f"{tuple(shape)} has only {len(shape) - 1} dimension(s) after the batch dimension")
    for dim, column in enumerate(columns, start=1):
        size = shape[dim]
        if len(column) not in (1, batch):
            raise ValueError(f"relprop: {len(column)} targets given for a batch of {batch} examples")
        outside = [value for value in column if not -size <= value < size]
        if outside:
            raise ValueError(f"relprop: target {target!r} is out of range for the model output of shape "
                             f"{tuple(shape)}: index {outside[0]} on dimension {dim} of size {size}")
    return columns


def target_mask(output: Tensor, target: Target) -> Tensor:
    """A boolean mask of the output entries that ``target`` selects (captum's semantics).

    ``target`` is None (one output per example), an int (the class along
    dimension 1), a tuple indexing the dimensions after the batch dimension
    (``(-1, token)``), or a list / 1-D integer tensor with one such target per
    example. A list or tensor of one target is used for every example, as
    captum does (``torch.tensor([2])`` for a batch of 4). An entry of a tuple
    may itself hold one index per example (``(-1, next_tokens)``, a 1-D
    integer tensor or a list).
    """
    columns = target_columns(target)
    if columns is None:
        raise TypeError(f"relprop: target {target!r} is not a selection of outputs (a Contrastive or an output "
                        "relevance is a seed: see output_relevance)")
    checked_columns(columns, output.shape, target)
    mask = torch.zeros_like(output, dtype=torch.bool)
    if output.dim() == 0:
        return mask.fill_(True)
    if all(len(column) == 1 for column in columns):
        every: tuple[slice | int, ...] = (slice(None), *(column[0] for column in columns))
        mask[every] = True
        return mask
    batch = output.shape[0]  # one per example: the indices of each row, in one write
    rows = torch.arange(batch, device=output.device)
    mask[(rows, *(torch.tensor(column * (batch if len(column) == 1 else 1), device=output.device)
                  for column in columns))] = True
    return mask


def target_indices(target: Target) -> tuple[Tensor, ...] | None:
    """:func:`target_columns` as index tensors (int64, shape ``(1,)`` or ``(n,)``) for :func:`selection_mask`: a
    compiled program selects with them whatever their values, where the values of Python integers would each be
    compiled into a program of their own."""
    if (isinstance(target, Tensor) and target.dim() == 1 and len(target) and target.dtype != torch.bool
            and not target.is_floating_point() and not target.is_complex()):
        return (target.to(torch.int64),)  # a training loop's labels as they are, not through a list
    columns = target_columns(target)
    return None if columns is None else tuple(torch.tensor(column, dtype=torch.int64) for column in columns)


def selection_mask(output: Tensor, indices: tuple[Tensor, ...]) -> Tensor:
    """The entries of ``output`` that :func:`target_indices`'s ``indices`` select, as :func:`target_mask` (for
    indices in range: a compiled program checks them with :func:`checked_columns` after it ran). Comparisons with
    positions only, so that it compiles for any values."""
    mask = torch.ones_like(output, dtype=torch.bool)
    for dim, index in enumerate(indices, start=1):
        size = output.shape[dim]
        hit = torch.arange(size, device=output.device) == (index.to(output.device) % size).unsqueeze(1)
        shape = [hit.shape[0]] + [1] * (output.dim() - 1)
        shape[dim] = size
        mask = mask & hit.reshape(shape)
    return mask


class Contrastive:
    """A contrastive target: explain ``f_t - mean of the other outputs`` instead of ``f_t``.

    The output relevance is ``f_t`` at the target and ``-f_j / (C - 1)`` at
    each of the ``C - 1`` other entries along the target's last indexed
    dimension (the classes, or the vocabulary at a position).

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> import relprop
    >>> relprop.Contrastive(0).relevance(torch.tensor([[1.0, 2.0, 4.0]]))
    tensor([[ 1., -1., -2.]])
    >>> lrp = relprop.LRP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 5)).eval())
    >>> lrp.attribute(torch.randn(2, 4), target=relprop.Contrastive(3)).shape  # class 3 against the others
    torch.Size([2, 4])
    >>> language_model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 10)).eval()
    >>> input_ids, token_id = torch.tensor([[1, 4, 2, 7]]), 5  # token 5 at the last position, against the others
    >>> relprop.LRP(language_model).attribute(input_ids, target=relprop.Contrastive((-1, token_id))).shape
    torch.Size([1, 4])
    """

    def __init__(self, target: Target):
        self.target = target

    def relevance(self, output: Tensor) -> Tensor:
        mask = target_mask(output, self.target)
        depth = len(self.target) if isinstance(self.target, tuple) else 1
        if isinstance(self.target, list) and self.target and isinstance(self.target[0], tuple):
            depth = len(self.target[0])
        others = mask.any(depth, keepdim=True).expand_as(mask) & ~mask
        zero = torch.zeros((), dtype=output.dtype, device=output.device)
        return torch.where(mask, output, zero) - torch.where(others, output, zero) / (output.shape[depth] - 1)

    def __repr__(self) -> str:
        return f"Contrastive({self.target!r})"


def output_relevance(output: Tensor, target: Target, attached: bool = False) -> Tensor:
    """The relevance seeded at the output: ``output`` where ``target`` selects, 0 elsewhere.

    See :func:`~relprop.methods.target_mask` for ``target``. A floating-point tensor of the
    output's shape is taken as the output relevance itself; a
    :class:`Contrastive` target explains the target against the others. ``attached``: the seed is a function of
    ``output`` for autograd (a differentiable relevance: the selected output is what is explained, not a constant
    of its value); else detached.
    """
    if isinstance(target, Contrastive):
        return target.relevance(output if attached else output.detach())
    if isinstance(target, Tensor) and target.is_floating_point():
        if target.shape != output.shape:
            raise ValueError(f"relprop: output relevance of shape {tuple(target.shape)} does not match the model "
                             f"output of shape {tuple(output.shape)}")
        return target.to(output.dtype) if attached else target.to(output.dtype).detach()
    value = output if attached else output.detach()
    return torch.where(target_mask(value.detach(), target), value,
                       torch.zeros((), dtype=value.dtype, device=value.device))


def convergence_delta(seed: Tensor, relevance: Tensor | Sequence[Tensor | None] | None) -> Tensor:
    """``seed total - relevance total`` per example: the relevance the rules absorbed (or created).

    The one definition of the delta in relprop (captum's ``LRP`` sign): 0
    where relevance is conserved from the output down to ``relevance``.

    Parameters
    ----------
    seed : Tensor
        The output relevance, or the explained output value per example; batch first.
    relevance : Tensor or sequence of Tensors
        The relevance of the inputs (or of a layer), each batch first; None entries are skipped.

    Returns
    -------
    Tensor of shape (N,)
    """
    parts = [r for r in as_tuple(relevance) if r is not None]
    batch = seed.shape[0] if seed.dim() else 1
    if any(r.dim() == 0 or r.shape[0] != batch for r in parts):
        raise ValueError("relprop: the convergence delta is per example and needs every input batch first; "
                         f"got input shapes {[tuple(r.shape) for r in parts]} for a seed of shape "
                         f"{tuple(seed.shape)}")
    total = sum((r.reshape(batch, -1).sum(1) for r in parts), torch.zeros(batch, dtype=seed.dtype,
                                                                             device=seed.device))
    return seed.reshape(batch, -1).sum(1) - total
