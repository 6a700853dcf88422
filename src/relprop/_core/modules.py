"""Module state that relprop changes for the length of a call and puts back: eval mode, parameters' grad flags."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from relprop._core.errors import warn_caller

__all__ = ["evaluation", "frozen", "submodules"]


def submodules(model: nn.Module) -> list[nn.Module]:
    """``list(model.modules())``, in its order (each module once, before its children), without the names
    that ``named_modules`` builds: read on every call of a compiled attribution."""
    found: list[nn.Module] = []
    seen: set[int] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        found.append(module)
        stack.extend(reversed([child for child in module._modules.values() if child is not None]))
    return found


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
    training = [module for module in submodules(model) if module.training]
    if training and warning is not None:
        warn_caller(warning)
    try:
        for module in training:
            module.training = False
        yield
    finally:
        for module in training:
            module.training = True


@contextmanager
def frozen(model: nn.Module) -> Iterator[None]:
    """``model``'s parameters not requiring grad inside the block; each flag as it was after it, also when an
    exception flies.

    A compiled program's backward pass computes the gradient of every input of its graph that requires grad, the
    parameters included, whatever ``torch.autograd.grad`` asks for afterwards: relevance needs none of them.
    """
    # a parameter shared by modules is listed once for each: its flag is set and put back alike
    learned = [parameter for module in submodules(model) for parameter in module._parameters.values()
               if parameter is not None and parameter.requires_grad]
    try:
        for parameter in learned:
            parameter.requires_grad_(False)
        yield
    finally:
        for parameter in learned:
            parameter.requires_grad_(True)
