"""The parts of a decoder language model that patching reads and writes: its layers, heads, MLPs and residual stream.

Found from the model's own modules: the list of decoder layers (the ``nn.ModuleList``
with one entry per layer of the config), in each layer the attention and its output
projection (whose input holds one slice per head), and the MLP. Llama, Qwen2, Mistral
(``self_attn.o_proj``, ``mlp``) and GPT-2 (``attn.c_proj``, a ``Conv1D``, ``mlp``) are
found alike, grouped-query attention too: the output projection's input has a slice per
query head.

A *site* is one tensor of the forward pass, per layer: the input of an output
projection, the output of an attention block or of an MLP, the hidden state
entering a layer (or leaving the last). :func:`capture` keeps the tensors at sites during a forward pass,
:func:`replace` overwrites entries of them; both remove their hooks on exit, also
when an exception flies.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

__all__ = ["Decoder", "Site", "capture", "find_decoder", "replace"]

ATTENTION = ("self_attn", "attn", "attention", "self_attention")
PROJECTION = ("o_proj", "c_proj", "out_proj", "dense", "wo")
MLP = ("mlp", "feed_forward", "ffn", "block_sparse_moe")
HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers")


@dataclass(frozen=True)
class Site:
    """One tensor of the forward pass: the first input (``output=False``) or the output of ``module``."""

    module: nn.Module
    output: bool
    name: str  # the module's dotted path, for messages


@dataclass(frozen=True)
class Decoder:
    """A decoder's layers, the sites patching reads, and its number of (query) heads.

    Attributes
    ----------
    layers : tuple of nn.Module
        The decoder layers, in order.
    heads : tuple of Site
        Per layer, the input of the attention's output projection: ``(B, T, heads * head_dim)``.
    attentions : tuple of Site
        Per layer, the attention block's output (its first output): ``(B, T, hidden)``.
    mlps : tuple of Site
        Per layer, the MLP's output.
    residual : tuple of Site
        The hidden state entering each layer, and the one leaving the last (``layers + 1`` sites).
    head_count : int
    """

    layers: tuple[nn.Module, ...]
    heads: tuple[Site, ...]
    attentions: tuple[Site, ...]
    mlps: tuple[Site, ...]
    residual: tuple[Site, ...]
    head_count: int


def _config_value(objects: Sequence[Any], names: Sequence[str]) -> int | None:
    for item in objects:
        for name in names:
            value = getattr(item, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _child(parent: nn.Module, names: Sequence[str], what: str, where: str) -> tuple[str, nn.Module]:
    for name in names:
        module = getattr(parent, name, None)
        if isinstance(module, nn.Module):
            return name, module
    raise ValueError(f"relprop: patching found no {what} in {where} ({type(parent).__name__}): it looks for a "
                     f"submodule named {', '.join(names)}")


def find_decoder(model: nn.Module) -> Decoder:
    """The layers, heads, attention, MLP and residual sites of a decoder language model, from its own modules.

    Raises ``ValueError`` naming what could not be found: the list of layers, a layer's attention, its output
    projection, its MLP, or the number of heads.
    """
    config = getattr(model, "config", None)
    expected = _config_value([config], LAYER_COUNTS) if config is not None else None
    lists = [(name, module) for name, module in model.named_modules()
             if isinstance(module, nn.ModuleList) and len(module) > 0
             and len({type(child) for child in module}) == 1]
    if expected is not None:
        lists = [(name, module) for name, module in lists if len(module) == expected]
    if not lists:
        wanted = f" of {expected} layers (config)" if expected is not None else ""
        raise ValueError(f"relprop: patching found no list of decoder layers{wanted} in {type(model).__name__}: "
                         "an nn.ModuleList of layers of one type")
    # of several such lists (per-layer norms or caches beside the layers), the one whose layers hold attention
    layered = [(name, module) for name, module in lists
               if any(isinstance(getattr(module[0], attribute, None), nn.Module) for attribute in ATTENTION)]
    path, layer_list = max(layered or lists, key=lambda item: len(item[1]))
    layers = tuple(layer_list)
    heads, attentions, mlps, residual = [], [], [], []
    head_count = None
    for index, layer in enumerate(layers):
        where = f"{path}.{index}"
        attention_name, attention = _child(layer, ATTENTION, "attention", where)
        projection_name, projection = _child(attention, PROJECTION, "attention output projection",
                                             f"{where}.{attention_name}")
        mlp_name, mlp = _child(layer, MLP, "MLP", where)
        heads.append(Site(projection, False, f"{where}.{attention_name}.{projection_name}"))
        attentions.append(Site(attention, True, f"{where}.{attention_name}"))
        mlps.append(Site(mlp, True, f"{where}.{mlp_name}"))
        residual.append(Site(layer, False, where))
        if head_count is None:
            head_count = _config_value([attention, getattr(attention, "config", None), config], HEAD_COUNTS)
    residual.append(Site(layers[-1], True, f"{path}.{len(layers) - 1}"))
    if head_count is None:
        raise ValueError(f"relprop: patching found no number of attention heads in {type(model).__name__}: it reads "
                         f"{', '.join(HEAD_COUNTS)} on the attention module or the config")
    return Decoder(layers, tuple(heads), tuple(attentions), tuple(mlps), tuple(residual), head_count)


def _first(value: Any) -> Tensor | None:
    """The tensor a site reads: the value itself, or its first entry (a layer's tuple output)."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], Tensor):
        return value[0]
    return None


def _with_first(value: Any, tensor: Tensor) -> Any:
    return tensor if isinstance(value, Tensor) else type(value)([tensor, *value[1:]])


Edit = Callable[[Tensor], Tensor]


@contextmanager
def _hooks(sites: Sequence[Site], edit: Callable[[int, Tensor], Tensor | None]) -> Iterator[None]:
    """Call ``edit(i, tensor)`` at each site ``i`` as the forward pass reaches it; a tensor returned replaces it."""
    handles = []

    def before(i: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            if args and isinstance(args[0], Tensor):
                new = edit(i, args[0])
                return None if new is None else ((new, *args[1:]), kwargs)
            if isinstance(kwargs.get("hidden_states"), Tensor):
                new = edit(i, kwargs["hidden_states"])
                return None if new is None else (args, {**kwargs, "hidden_states": new})
            raise ValueError(f"relprop: patching found no hidden states among the inputs of {sites[i].name}")
        return hook

    def after(i: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            tensor = _first(output)
            if tensor is None:
                raise ValueError(f"relprop: patching found no tensor in the output of {sites[i].name}")
            new = edit(i, tensor)
            return None if new is None else _with_first(output, new)
        return hook

    try:
        for i, site in enumerate(sites):
            if site.output:
                handles.append(site.module.register_forward_hook(after(i)))
            else:
                handles.append(site.module.register_forward_pre_hook(before(i), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def capture(sites: Sequence[Site]) -> Iterator[list[Tensor | None]]:
    """The tensor at each site, as the forward pass inside the block computes it (the last call's, if several)."""
    found: list[Tensor | None] = [None] * len(sites)

    def keep(i: int, tensor: Tensor) -> None:
        found[i] = tensor

    with _hooks(sites, keep):
        yield found


@contextmanager
def replace(sites: Sequence[Site], edits: dict[int, Edit]) -> Iterator[None]:
    """Replace the tensor at site ``i`` by ``edits[i](tensor)`` in the forward passes inside the block."""
    chosen = [sites[i] for i in edits]
    functions = list(edits.values())
    with _hooks(chosen, lambda i, tensor: functions[i](tensor)):
        yield
