"""MLP neurons as components of patching: each hidden unit of each layer's MLP.

A neuron is one entry of the input of the MLP's down projection (``(B, T, d_mlp)``):
``act(fc(x))`` in GPT-2, ``act(gate(x)) * up(x)`` in Llama. The down projection is
linear, so for attribution patching the neurons' estimates of one layer, summed over
units, equal that layer's ``mlp_out`` estimates summed over positions (up to the
down projection's bias, which is the same in both runs).

- ``"neurons"``: ``(B, layers, d_mlp)``, a unit at all positions at once (activation
  patching swaps that unit's clean value in at every position, as for heads);
- ``"neuron_positions"``: ``(B, layers, T, d_mlp)``, a unit at one position (for the
  estimates: activation patching runs once per unit and position).
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from relprop.workflows.components import Component, register
from relprop.workflows.decoders import Decoder, Site

__all__ = ["NeuronPositions", "Neurons", "sampled"]


def _neuron_sites(decoder: Decoder) -> tuple[Site, ...]:
    return decoder.neurons  # none where not found: patching captures every kind's sites in one pass


def _width(decoder: Decoder) -> int:
    if not decoder.neurons:
        raise ValueError("relprop: found no MLP neurons in this decoder: the input of a down projection named "
                         "down_proj, c_proj, fc2, dense_4h_to_h, w2, fc_out or wo in every layer's MLP, of one width")
    return decoder.neuron_count


class Neurons(Component):
    """One unit per hidden unit of an MLP, at all positions: ``(B, layers, d_mlp)``."""

    def __init__(self, name: str = "neurons") -> None:
        super().__init__(name, _neuron_sites, "(B, layers, d_mlp): each MLP hidden unit (the input of the down "
                         "projection), summed over positions")

    def units(self, decoder: Decoder, length: int) -> int:
        """``d_mlp``."""
        return _width(decoder)

    def reduce(self, product: Tensor, decoder: Decoder) -> Tensor:
        """Summed over positions: ``(B, d_mlp)``."""
        return product.sum(1)

    def select(self, mask: Tensor, tensor: Tensor, decoder: Decoder) -> Tensor:
        """A unit's entries at every position."""
        rows, length, width = tensor.shape
        return mask.view(rows, 1, width).expand(tensor.shape)


class NeuronPositions(Component):
    """One unit per hidden unit of an MLP and position: ``(B, layers, T, d_mlp)``."""

    def __init__(self, name: str = "neuron_positions") -> None:
        super().__init__(name, _neuron_sites, "(B, layers, T, d_mlp): each MLP hidden unit at each position")
        self._width = 0

    def units(self, decoder: Decoder, length: int) -> int:
        """``T * d_mlp``."""
        return length * _width(decoder)

    def reduce(self, product: Tensor, decoder: Decoder) -> Tensor:
        """Each entry its own unit: ``(B, T * d_mlp)``."""
        return product.reshape(product.shape[0], -1)

    def select(self, mask: Tensor, tensor: Tensor, decoder: Decoder) -> Tensor:
        """The entry of each chosen unit."""
        return mask.view(tensor.shape)

    def shape(self, effects: Tensor) -> Tensor:
        """``(B, layers, T, d_mlp)``: the positions split from the units, ``d_mlp`` read from the last decoder
        whose sites were found (every call of patching finds them before it shapes its results)."""
        return effects.view(*effects.shape[:2], -1, self._width)

    def sites(self, decoder: Decoder) -> tuple[Site, ...]:
        """The neurons' sites; their width is kept for :meth:`shape`."""
        self._width = decoder.neuron_count
        return super().sites(decoder)


register(Neurons())
register(NeuronPositions())


def sampled(pair: Any, kind: Component, count: int, seed: int = 0) -> Tensor:
    """A ``(sites * units,)`` mask of ``count`` units of ``kind`` drawn at random (without replacement), for
    activation patching of a sample; a ``UserWarning`` says how many of how many."""
    total = len(kind.sites(pair.decoder)) * kind.units(pair.decoder, pair.length)
    if count < 1:
        raise ValueError(f"relprop: sample must be a positive number of units, got {count}")
    mask = torch.zeros(total, dtype=torch.bool)
    mask[torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:count]] = True
    if count < total:
        warnings.warn(f"relprop: activation patching measured {count} of the {total} units of {kind.name!r}, drawn "
                      f"at random (seed {seed}); the others are NaN", UserWarning, stacklevel=4)
    return mask
