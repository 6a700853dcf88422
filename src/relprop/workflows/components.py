"""The kinds of component patching measures: where each reads the forward pass, and how a site splits into units.

A *kind of component* (heads, MLPs, the residual stream per position, ...) is a
:class:`Component`: its sites in the decoder (one tensor of the forward pass per
layer, :mod:`relprop.workflows.decoders`), how many units one site holds, how a
site's ``(B, T, width)`` product ``(a_clean - a_corrupted) * c`` sums to units
(the estimates), and which entries of a site's tensor a unit covers (activation
patching swaps exactly those). :data:`COMPONENTS` maps names to the kinds
``relprop.patching`` knows; :func:`register` adds one, and ``components=``
also takes a :class:`Component` directly, for a kind that needs more than the
decoder (an SAE spliced at a module, say).

Three shapes of unit cover the kinds here:

- :class:`Heads`: a site's last dimension holds one slice per head, all positions;
- :class:`Whole`: the whole site is one unit (an MLP's output, all positions);
- :class:`Positions`: one unit per position (the residual stream, an attention
  or MLP output at each token).
"""
from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from relprop.workflows.decoders import Decoder, Site

__all__ = ["COMPONENTS", "Component", "Heads", "Positions", "Whole", "register", "resolve"]


class Component:
    """A kind of component: its sites in a decoder and its units per site.

    Subclasses say how a site splits into units (:meth:`units`, :meth:`reduce`, :meth:`select`); the sites are
    found by ``locate``, a function of the :class:`~relprop.workflows.decoders.Decoder` (override :meth:`sites`
    for sites that need more than the decoder).

    Parameters
    ----------
    name : str
        The key of the results (``components=`` of ``relprop.patching``).
    locate : callable
        ``decoder -> sites``: the sites, one tensor of shape ``(B, T, width)`` each, in layer order.
    description : str
        What one unit is, for documentation and messages.
    """

    def __init__(self, name: str, locate: Callable[[Decoder], tuple[Site, ...]], description: str = ""):
        self.name = name
        self.description = description
        self._locate = locate

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def sites(self, decoder: Decoder) -> tuple[Site, ...]:
        """The tensors of the forward pass this kind reads and patches, in layer order."""
        return self._locate(decoder)

    def units(self, decoder: Decoder, length: int) -> int:
        """The number of units of one site, for prompts of ``length`` tokens."""
        raise NotImplementedError

    def reduce(self, product: Tensor, decoder: Decoder) -> Tensor:
        """A site's ``(B, T, width)`` tensor summed over each unit's entries: ``(B, units)``."""
        raise NotImplementedError

    def select(self, mask: Tensor, tensor: Tensor, decoder: Decoder) -> Tensor:
        """A ``(N, units)`` boolean mask spread over the entries of a site's ``(N, T, width)`` tensor."""
        raise NotImplementedError

    def shape(self, effects: Tensor) -> Tensor:
        """The ``(B, sites, units)`` effects as ``relprop.patching`` returns them (by default, as they are)."""
        return effects


class Heads(Component):
    """One unit per head: the head's slice of the site's last dimension, all positions."""

    def units(self, decoder: Decoder, length: int) -> int:
        """The number of (query) heads."""
        return decoder.head_count

    def reduce(self, product: Tensor, decoder: Decoder) -> Tensor:
        """Summed over positions and each head's slice: ``(B, heads)``."""
        batch, length, _ = product.shape
        return product.view(batch, length, decoder.head_count, -1).sum((1, 3))

    def select(self, mask: Tensor, tensor: Tensor, decoder: Decoder) -> Tensor:
        """Each head's slice at every position."""
        rows, length, width = tensor.shape
        heads = decoder.head_count
        return mask.view(rows, 1, heads, 1).expand(rows, length, heads, width // heads).reshape(tensor.shape)


class Whole(Component):
    """One unit per site: all its entries at all positions. Returned as ``(B, sites)``."""

    def units(self, decoder: Decoder, length: int) -> int:
        """One."""
        return 1

    def reduce(self, product: Tensor, decoder: Decoder) -> Tensor:
        """Summed over positions and width: ``(B, 1)``."""
        return product.sum((1, 2)).unsqueeze(1)

    def select(self, mask: Tensor, tensor: Tensor, decoder: Decoder) -> Tensor:
        """Every entry."""
        return mask.view(tensor.shape[0], 1, 1).expand(tensor.shape)

    def shape(self, effects: Tensor) -> Tensor:
        """``(B, sites)``: the one unit's dimension dropped."""
        return effects.squeeze(-1)


class Positions(Component):
    """One unit per position: the site's whole width at one token."""

    def units(self, decoder: Decoder, length: int) -> int:
        """The number of positions."""
        return length

    def reduce(self, product: Tensor, decoder: Decoder) -> Tensor:
        """Summed over the width: ``(B, T)``."""
        return product.sum(2)

    def select(self, mask: Tensor, tensor: Tensor, decoder: Decoder) -> Tensor:
        """The whole width at each chosen position."""
        rows, length, _ = tensor.shape
        return mask.view(rows, length, 1).expand(tensor.shape)


#: the kinds of component ``relprop.patching`` knows, by name
COMPONENTS: dict[str, Component] = {}


def register(component: Component) -> Component:
    """Add a kind of component to :data:`COMPONENTS` under its name (replacing one of that name); returned."""
    if not isinstance(component, Component):
        raise TypeError(f"relprop: a component kind must be a relprop.workflows.components.Component, got "
                        f"{type(component).__name__}")
    COMPONENTS[component.name] = component
    return component


def resolve(component: str | Component) -> Component:
    """The :class:`Component` of a name in :data:`COMPONENTS`, or the one given."""
    if isinstance(component, Component):
        return component
    if isinstance(component, str) and component in COMPONENTS:
        return COMPONENTS[component]
    raise ValueError(f"relprop: unknown components {component!r}; choose from {', '.join(COMPONENTS)} or give a "
                     "relprop.workflows.components.Component")


register(Heads("heads", lambda decoder: decoder.heads,
               "(B, layers, heads): each head's slice of the input of the attention's output projection, all "
               "positions"))
register(Whole("mlps", lambda decoder: decoder.mlps, "(B, layers): each MLP's output, all positions"))
register(Positions("residual", lambda decoder: decoder.residual,
                   "(B, layers + 1, T): the hidden state entering each layer and leaving the last, per position"))
register(Positions("attn_out", lambda decoder: decoder.attentions,
                   "(B, layers, T): each attention block's output, per position"))
register(Positions("mlp_out", lambda decoder: decoder.mlps, "(B, layers, T): each MLP's output, per position"))
