"""Module state that relprop changes for the length of a call and puts back: eval mode, parameters' grad flags."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from relprop._core.errors import warn_caller

__all__ = ["evaluation", "frozen"]


@contextmanager
def evaluation(model: nn.Module, warning: str | None = None) -> Iterator[None]:
    """``model`` and its submodules in eval mode inside the block; each flag as it was after it, also when an
    exception flies.

    Parameters
    ----------
    model : nn.Module
    warning : str, optional
        Warned (a ``UserWarning``, at the caller's line outside relprop) when any module was in training mode.
    """
    training = [module for module in model.modules() if module.training]
    if training and warning is not None:
        warn_caller(warning)
    try:
        for module in training:
            _set_training(module, False)
        yield
    finally:
        for module in training:
            _set_training(module, True)


def _set_training(module: nn.Module, mode: bool) -> None:
    """``module.training = mode``; past ``nn.Module.__setattr__``, whose checks for parameters, buffers and
    submodules cost more than the whole flag, where the module's class keeps that ``__setattr__``."""
    if type(module).__setattr__ is nn.Module.__setattr__:
        object.__setattr__(module, "training", mode)
    else:  # a class of its own may watch the flag
        module.training = mode


@contextmanager
def frozen(model: nn.Module) -> Iterator[None]:
    """``model``'s parameters not requiring grad inside the block; each flag as it was after it, also when an
    exception flies.

    A compiled program's backward pass computes the gradient of every input of its graph that requires grad, the
    parameters included, whatever ``torch.autograd.grad`` asks for afterwards: relevance needs none of them.
    """
    learned = [parameter for parameter in model.parameters() if parameter.requires_grad]
    try:
        for parameter in learned:
            parameter.requires_grad_(False)
        yield
    finally:
        for parameter in learned:
            parameter.requires_grad_(True)
