"""captum's ``Attribution`` protocol without captum, and what every attribution method's entry point wears.

:class:`Attribution` is what captum's wrappers and metrics read of a method; :func:`eager` keeps an attribution
out of a ``torch.compile`` graph around it; :func:`captum_entry` gives ``attribute`` the ``__wrapped__`` that
captum's ``NoiseTunnel`` calls; :func:`cyclic_gc_paused` keeps Python's cyclic collector out of an attribution.
"""
from __future__ import annotations

import functools
import gc
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import torch
from torch import Tensor

from relprop.methods._inputs import Inputs

__all__ = ["Attribution", "captum_entry", "cyclic_gc_paused", "eager"]

_F = TypeVar("_F", bound=Callable[..., Any])


def eager(method: _F) -> _F:
    """Run ``method`` eagerly also inside code compiled with ``torch.compile``.

    Relevance needs every op of the forward pass intercepted one by one, which a
    compiled graph does not allow: Dynamo breaks the graph here instead of
    failing, and what the caller compiles around an attribution stays compiled.
    Dynamo is looked up when the method runs: nothing can be compiling before
    ``torch.compile`` imported it, and importing it costs more than importing torch.
    The result has captum's ``__wrapped__`` (see :func:`captum_entry`).
    """
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:
            return method(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(method, recursive=True))
        return disabled[0](*args, **kwargs)
    return cast(_F, call)


def captum_entry(method: _F) -> _F:
    """Give an ``attribute`` method the ``__wrapped__`` that captum's ``NoiseTunnel`` calls.

    NoiseTunnel calls ``method.attribute.__wrapped__(method, inputs, ...)`` to
    skip captum's usage logger, so every ``attribute`` must be a wrapper.
    """
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)
    return cast(_F, call)


class Attribution:
    """captum's ``Attribution`` protocol, without captum as a dependency.

    What captum's wrappers and metrics read: ``forward_func`` (the model),
    ``multiplies_by_inputs``, ``has_convergence_delta()``,
    ``compute_convergence_delta(...)``, ``get_name()`` and ``attribute``, so
    that ``captum.attr.NoiseTunnel(method)``, ``captum.metrics.infidelity``
    and ``captum.metrics.sensitivity_max`` take relprop's methods.

    Parameters
    ----------
    forward_func : callable
        The model, or any function of the inputs returning its output.
    """

    #: whether the attributions are a local effect times the inputs (captum's flag, used by NoiseTunnel)
    multiplies_by_inputs: bool = False

    def __init__(self, forward_func: Callable[..., Any]) -> None:
        if not callable(forward_func):
            raise TypeError(f"relprop: forward_func must be a model or a function, got {type(forward_func).__name__}")
        self.forward_func = forward_func

    def has_convergence_delta(self) -> bool:
        """Whether :meth:`compute_convergence_delta` (and ``return_convergence_delta=True``) is available."""
        return type(self).compute_convergence_delta is not Attribution.compute_convergence_delta

    def compute_convergence_delta(self, attributions: Inputs, *args: Any) -> Tensor:
        """The method's approximation error per example; see the subclass for its arguments."""
        raise NotImplementedError(f"relprop: {self.get_name()} has no convergence delta")

    @classmethod
    def get_name(cls) -> str:
        """A readable name: ``"Integrated Gradients"``, ``"Layer LRP"``."""
        return re.sub(r"(?<=[a-z])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", " ", cls.__name__)



@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused inside the block, and enabled again after it if it was before.

    An attribution allocates several Python objects per op (op calls, autograd nodes, tensors) that live until
    its backward pass ends. Collections in the middle of it move them into the older generations, and now and
    then that sets off a full collection of every object of the process, which with torchvision and
    transformers loaded costs several times a small attribution. An attribution makes no reference cycles (its
    objects are freed by reference counting when it ends), so pausing the collector leaves nothing behind.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


