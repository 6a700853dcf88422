"""Module state that relprop changes for the length of a call and puts back: eval mode."""
from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

__all__ = ["evaluation"]


@contextmanager
def evaluation(model: nn.Module, warning: str | None = None, stacklevel: int = 3) -> Iterator[None]:
    """``model`` and its submodules in eval mode inside the block; each flag as it was after it, also when an
    exception flies.

    Parameters
    ----------
    model : nn.Module
    warning : str, optional
        Warned (a ``UserWarning``) when any module was in training mode.
    stacklevel : int
        Of the warning: 3 names the line of the ``with`` statement, one more for each function in between.
    """
    training = [module for module in model.modules() if module.training]
    if training and warning is not None:
        warnings.warn(warning, stacklevel=stacklevel)
    try:
        for module in training:
            module.training = False
        yield
    finally:
        for module in training:
            module.training = True
