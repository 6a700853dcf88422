"""The inputs, targets and extra arguments of the attribution methods: one way to format, repeat and slice them.

Inputs are a tensor or a tuple of tensors, batch first; ``additional_forward_args``
is a tuple of further positional arguments or a dict of keyword arguments,
whose batch-first tensors go with the inputs wherever the batch is repeated.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

Target = int | tuple | Sequence | Tensor | None
Inputs = Tensor | Sequence[Tensor]
#: positional and keyword arguments after the inputs
Arguments = tuple[tuple, dict]


def as_tuple(value: Any) -> tuple:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def forward_arguments(value: Any) -> tuple[tuple, dict]:
    """Positional and keyword arguments from ``additional_forward_args``; tensors detached."""
    def detach(a: Any) -> Any:
        return a.detach() if isinstance(a, Tensor) else a
    if isinstance(value, Mapping):
        return (), {key: detach(a) for key, a in value.items()}
    return tuple(detach(a) for a in as_tuple(value)), {}


def explained_arguments(inputs: Inputs, additional_forward_args: Any,
                        attached: bool = False) -> tuple[tuple[Tensor, ...], tuple, dict]:
    """What an explanation runs the model on: the inputs as leaves (floating-point ones detached, requiring grad;
    token ids as they are), and the model's further positional and keyword arguments.

    ``attached``: for a differentiable relevance, a floating-point input that requires grad stays as it is (the
    relevance is differentiated with respect to it, through whatever computed it), and the others are detached
    without requiring grad: the differentiable program makes them its leaves
    (:func:`~relprop.methods.differentiable.own_leaves`), knowing so which inputs need no derivative."""
    inputs = as_tuple(inputs)
    if not inputs or not all(isinstance(x, Tensor) for x in inputs):
        raise TypeError("relprop: inputs must be a tensor or a tuple of tensors")
    extra, keywords = forward_arguments(additional_forward_args)
    if attached:
        return tuple(x if not x.is_floating_point() or x.requires_grad else x.detach() for x in inputs), extra, keywords
    return tuple(x.detach().requires_grad_() if x.is_floating_point() else x for x in inputs), extra, keywords


def format_inputs(inputs: Inputs) -> tuple[Tensor, ...]:
    """The inputs as a tuple of floating-point tensors, or a one-line error."""
    items = as_tuple(inputs)
    if not items or not all(isinstance(x, Tensor) and x.is_floating_point() for x in items):
        raise TypeError("relprop: inputs must be a floating-point tensor or a tuple of them, batch first")
    return items


def as_given(inputs: Inputs, results: tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
    """A tensor for a tensor input, a tuple for tuple inputs (captum's convention)."""
    return results[0] if isinstance(inputs, Tensor) else results


def format_baselines(items: tuple[Tensor, ...], baselines: Any) -> tuple[Tensor, ...]:
    """One baseline per input, broadcast to its shape: None (zeros), a number, a tensor, or a tuple of those."""
    given = baselines if isinstance(baselines, tuple) else (baselines,) * len(items)
    if len(given) != len(items):
        raise ValueError(f"relprop: {len(given)} baselines given for {len(items)} inputs")
    formatted = []
    for x, baseline in zip(items, given):
        value = torch.as_tensor(0.0 if baseline is None else baseline, dtype=x.dtype, device=x.device)
        try:
            formatted.append(value.expand_as(x))
        except RuntimeError as error:
            raise ValueError(f"relprop: a baseline of shape {tuple(value.shape)} does not fit an input of shape "
                             f"{tuple(x.shape)}") from error
    return tuple(formatted)


def _map_batch(arguments: Arguments, batch: int, change: Callable[[Tensor], Tensor]) -> Arguments:
    """The arguments with ``change`` applied to every batch-first tensor (first dimension ``batch``)."""
    def apply(value: Any) -> Any:
        return change(value) if isinstance(value, Tensor) and value.dim() and value.shape[0] == batch else value
    positional, keywords = arguments
    return tuple(apply(a) for a in positional), {key: apply(a) for key, a in keywords.items()}


def repeat_arguments(arguments: Arguments, batch: int, times: int) -> Arguments:
    """The arguments for ``times`` consecutive copies of each example: batch-first tensors repeated."""
    return _map_batch(arguments, batch, lambda value: value.repeat_interleave(times, 0))


def tile_arguments(arguments: Arguments, batch: int, times: int = 2) -> Arguments:
    """The arguments for the batch repeated ``times`` times as a whole: batch-first tensors stacked."""
    return _map_batch(arguments, batch, lambda value: torch.cat([value] * times))


def slice_arguments(arguments: Arguments, batch: int, start: int, stop: int) -> Arguments:
    """The rows ``start:stop`` of every batch-first tensor argument."""
    return _map_batch(arguments, batch, lambda value: value[start:stop])


def repeat_target(target: Target, times: int) -> Target:
    """Per-example targets for ``times`` consecutive copies of each example; a target for all as it is."""
    if (isinstance(target, Tensor) and target.dim() == 1 and target.numel() > 1
            or isinstance(target, list) and len(target) > 1):
        items = target.tolist() if isinstance(target, Tensor) else target
        return [item for item in items for _ in range(times)]
    return target


def tile_target(target: Target, times: int) -> Target:
    """Per-example targets for the batch repeated ``times`` times as a whole (concept-major)."""
    if isinstance(target, Tensor) and not target.is_floating_point() and target.dim() == 1:
        return target.repeat(times)
    if isinstance(target, list):
        return target * times
    if isinstance(target, Tensor):
        return target.repeat(times, *[1] * (target.dim() - 1))
    return target


def one_or_list(results: list) -> Any:
    return results[0] if len(results) == 1 else results
