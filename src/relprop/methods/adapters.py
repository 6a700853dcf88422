"""Architecture adapters: rules that follow from a tensor's role in a known architecture (docs/design.md, section 5).

The engine chooses a rule from what an op computes. A few rules depend on what a tensor *means*, which no
single op shows. In a selective state space model (Mamba, Gu and Dao 2023; Mamba-2, Dao and Gu 2024) the
step size ``dt`` and the projections ``B`` and ``C`` are computed from the input, but they *select* how the
signal moves through the scan rather than carry it. MambaLRP (Jafari et al. 2024) holds them constant, so
that the scan is linear in its signal and relevance flows along the signal only; without that, relevance
enters ``dt``, ``B`` and ``C`` and heatmaps differ by a few percent where the scan matters.

``B`` and ``C`` are channel slices of the same convolution output as the signal, so no op-level tag can
tell them apart. The adapter acts where their role is explicit, for the pass only:

- Mamba-1 mixers (``MambaMixer``, ``FalconMambaMixer``, ``JambaMambaMixer``, ...): the output of ``x_proj``
  is exactly ``(dt, B, C)``; a forward hook returns it detached.
- Mamba-2 mixers (Mamba-2, Bamba, Zamba2, Falcon-H1, Nemotron-H, GraniteMoE-hybrid): their module's
  ``mamba2_chunk_scan`` and ``mamba2_selective_state_update`` are called with ``dt``, ``B`` and ``C``
  detached (also where transformers wraps them as function modules of ``kernels``, by the wrapped function's
  argument names; a scan whose arguments have no names is warned about, not held); the module attributes are
  put back when the pass ends, also when it raises.

Detached tensors are constants to the engine, so every product with them is linear in the signal and takes
the preset's rule for it; with AttnLRP the result equals MambaLRP's reference implementation.
"""
from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from relprop._core.errors import UnhandledOpWarning, warn_caller

__all__ = ["HELD_ARGUMENTS", "hold_selective_parameters"]

#: module-level scan functions of Mamba-2-style models, with the arguments held constant in a pass
HELD_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "mamba2_chunk_scan": ("dt", "B", "C"),
    "mamba2_selective_state_update": ("dt", "B", "C"),
}


def _detached_output(module: nn.Module, args: Any, output: Tensor) -> Tensor:
    return output.detach()


def _is_mamba1_mixer(module: nn.Module) -> bool:
    """A Mamba-1 mixer: its ``x_proj`` computes the selective parameters (dt, B, C) and nothing else."""
    return (type(module).__name__.endswith("MambaMixer") and isinstance(getattr(module, "x_proj", None), nn.Linear)
            and hasattr(module, "dt_proj"))


def _signature(func: Callable[..., Any]) -> inspect.Signature:
    """The signature that names ``func``'s arguments: its own, or where a module wraps the function (transformers
    turns scan functions into ``kernels``' function modules, whose ``forward`` takes ``*args, **kwargs`` and calls
    the function it closes over), that function's."""
    signature = inspect.signature(func)
    if any(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values()):
        return signature
    for cell in getattr(getattr(func, "forward", None), "__closure__", None) or ():
        inner = cell.cell_contents
        if inspect.isfunction(inner) or isinstance(inner, nn.Module):  # a module may wrap one that wraps it
            return _signature(inner)
    return signature


def _holding(func: Callable[..., Any], held: tuple[str, ...]) -> Callable[..., Any]:
    """``func`` called with the arguments named in ``held`` detached."""
    signature = _signature(func)
    missing = [name for name in held if name not in signature.parameters]
    if missing:  # the parameters would move the relevance through the scan: said, not done silently
        warn_caller(f"relprop: {getattr(func, '__name__', type(func).__name__)} does not name the arguments "
                    f"{', '.join(missing)}: Mamba's selective parameters are not held constant (MambaLRP) in this "
                    "pass", UnhandledOpWarning)

    @functools.wraps(func)
    def call(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        for name in held:
            value = bound.arguments.get(name)
            if isinstance(value, Tensor):
                bound.arguments[name] = value.detach()
        return func(*bound.args, **bound.kwargs)

    return call


def _scan_functions(sources: set[str]) -> list[tuple[ModuleType, str, Callable[..., Any]]]:
    """The scan functions (module, name, function) defined in the Python modules named in ``sources``."""
    found = []
    for source_name in sources:
        source = sys.modules.get(source_name)
        for name in HELD_ARGUMENTS:
            func = getattr(source, name, None)
            if source is not None and callable(func):
                found.append((source, name, func))
    return found


def holds_selective_parameters(model: nn.Module) -> bool:
    """Whether :func:`hold_selective_parameters` changes anything for ``model``: it has Mamba mixers."""
    sources: set[str] = set()
    for module in model.modules():
        if _is_mamba1_mixer(module):
            return True
        sources.add(type(module).__module__)
    return bool(_scan_functions(sources))


@contextmanager
def hold_selective_parameters(model: nn.Module) -> Iterator[None]:
    """Hold the selective state space parameters of ``model``'s Mamba mixers constant during one pass.

    Parameters
    ----------
    model : nn.Module
        The model being explained; models without Mamba mixers are left alone.
    """
    handles: list[RemovableHandle] = []
    sources: set[str] = set()
    replaced: list[tuple[ModuleType, str, Callable[..., Any]]] = []
    try:
        for module in model.modules():  # one walk: Mamba-1 hooks, and where the model's classes are defined
            sources.add(type(module).__module__)
            if _is_mamba1_mixer(module):
                handles.append(module.get_submodule("x_proj").register_forward_hook(_detached_output))
        replaced = _scan_functions(sources)
        for source, name, func in replaced:
            setattr(source, name, _holding(func, HELD_ARGUMENTS[name]))
        yield
    finally:
        for source, name, func in replaced:
            setattr(source, name, func)
        for handle in handles:
            handle.remove()
