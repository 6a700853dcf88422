"""The relevance of the inputs for one unit of an inner layer: captum's ``Neuron*`` interface on LRP.

A *unit* (a neuron) is an entry of a layer's output (or input), chosen by an
index, or a value computed from it per example, chosen by a function (a
channel's sum, one attention head's output at one position). The layer's
tensor is tapped in the forward pass, as :class:`~relprop.LayerLRP` taps it,
and the backward pass starts there, with the unit's value as the relevance
seeded at the unit and 0 elsewhere: what :class:`~relprop.LRP` gives for the
model cut at the layer and explained at the unit. The rest of the model runs
in the forward pass and gets no relevance.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from relprop.composites import Composite
from relprop.methods._inputs import Inputs, as_given
from relprop.methods.attribution import LRP
from relprop.methods.protocol import Attribution, captum_entry, cyclic_gc_paused
from relprop.methods.layer import Tapper, resolve_module
from relprop.methods.targets import convergence_delta

__all__ = ["NeuronLRP"]

#: an index into the layer's tensor without the batch dimension, or a function of it to one value per example
NeuronSelector = int | tuple[int | slice, ...] | Callable[[Any], Tensor]


class _LayerTensors(Tapper):
    """Taps a layer as :class:`~relprop.LayerLRP` does, and keeps the layer's own tensors of each call.

    A BatchNorm merged into the layer moves the tap's record behind itself (where LayerLRP's relevance
    arrives); a unit of the layer is still the layer's own value.
    """

    def __init__(self, input: bool):
        super().__init__(input)
        self.tensors: list[tuple[Tensor | None, ...]] = []

    def __call__(self, session: Any, value: Any) -> Any:
        calls = len(self.calls)
        tapped = super().__call__(session, value)
        if len(self.calls) > calls:
            self.tensors.append(tuple(None if record is None else record.below for record in self.calls[-1][1]))
        return tapped


class NeuronLRP(Attribution):
    """Relevance of the inputs for one unit of a layer's output (or input), with captum's ``Neuron*`` interface.

    Parameters
    ----------
    model : nn.Module
    layer : module or dotted module name
        A module that runs once per forward pass.
    composite, strict :
        As for :class:`relprop.LRP`.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> import relprop
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    >>> relevance = relprop.NeuronLRP(model, "1").attribute(torch.randn(2, 4), neuron_selector=(5,))
    >>> relevance.shape  # the relevance of the inputs for hidden unit 5
    torch.Size([2, 4])
    """

    multiplies_by_inputs = True

    def __init__(self, model: nn.Module, layer: nn.Module | str, composite: Composite | str | None = None,
                 strict: bool = False):
        self.lrp = LRP(model, composite, strict)
        super().__init__(self.lrp.model)
        self.layer = resolve_module(model, layer)
        self.name = next(name for name, module in model.named_modules() if module is self.layer) or "the model"

    @captum_entry
    def attribute(self, inputs: Inputs, neuron_selector: NeuronSelector, additional_forward_args: Any = None,
                  attribute_to_neuron_input: bool = False, return_convergence_delta: bool = False) -> Any:
        """Relevance of every input feature for the unit that ``neuron_selector`` chooses.

        Parameters
        ----------
        inputs, additional_forward_args :
            As for :meth:`relprop.LRP.attribute`.
        neuron_selector : int, tuple or callable
            An index into the layer's output without the batch dimension (an int for the first
            dimension, or a tuple of ints and slices; fewer indices than dimensions, or slices,
            select several units, explained together as their sum, as in captum). Or a function
            from the layer's output (a tuple of its tensors if it has several, ``None`` where an
            entry does not depend on the inputs) to one value per example, shape ``(B,)``: the
            relevance seeded at the layer is its gradient times the layer's output,
            ``dv/dy * y``. That is exact (it sums to the value) for functions homogeneous of
            degree one: sums and weighted sums of units, index picks, a head's slice, norms;
            for others it is the value's first-order part.
        attribute_to_neuron_input : bool
            Choose the unit in the layer's input instead (its positional tensor arguments).
        return_convergence_delta : bool
            Also return ``unit value - relevance total`` per example (what the rules absorbed).

        Returns
        -------
        Tensor, or tuple of Tensors for tuple inputs, shaped like the inputs (integer token inputs:
        one relevance per token); and the delta if asked.
        """
        tapper = _LayerTensors(attribute_to_neuron_input)
        with torch.inference_mode(False), cyclic_gc_paused():
            explained = self.lrp.record(inputs, additional_forward_args, taps={self.layer: tapper}, reusable=False)
            values = self._tensors(tapper, attribute_to_neuron_input)
            seeds = _seeds(values, neuron_selector, self._where(attribute_to_neuron_input))
            starts = [(value, seed) for value, seed in zip(values, seeds) if value is not None and seed is not None]
            batch = starts[0][0].shape[0]
            if len(starts) == 1:
                (start, seed), = starts
            else:  # one tensor to start from: autograd's cat routes the seed of each part back to it unchanged
                start = torch.cat([value.reshape(batch, -1) for value, _ in starts], 1)
                seed = torch.cat([part.reshape(batch, -1) for _, part in starts], 1)
            total = seed.reshape(batch, -1).sum(1) if return_convergence_delta else None
            explained.logits = start  # the pass is explained from the layer's tensor down
            relevance = explained.propagate(seed, owned=True)
        result = as_given(inputs, relevance)
        if total is None:
            return result
        return result, convergence_delta(total, relevance)

    def compute_convergence_delta(self, attributions: Inputs, output: Tensor) -> Tensor:
        """``output - attributions' total`` per example; ``output`` is the unit's value per example (shape (N,))."""
        return convergence_delta(output, attributions)

    def _where(self, input: bool) -> str:
        return f"the {'input' if input else 'output'} of layer {self.name!r}"

    def _tensors(self, tapper: _LayerTensors, input: bool) -> tuple[Tensor | None, ...]:
        """The layer's tensors in the forward pass (None for entries that do not depend on the inputs)."""
        if len(tapper.tensors) != 1:
            raise ValueError(f"relprop: NeuronLRP needs a layer that runs once per forward pass; {self._where(input)}"
                             f" was tapped {len(tapper.tensors)} times (a tensor or a tuple of tensors, once per call)")
        (values,) = tapper.tensors
        if not values:
            raise ValueError(f"relprop: {self._where(input)} holds no tensor to choose a unit in (a layer's input is "
                             "its positional arguments)")
        if all(value is None for value in values):
            raise ValueError(f"relprop: {self._where(input)} does not depend on the inputs")
        return values


def _seeds(values: tuple[Tensor | None, ...], selector: NeuronSelector, where: str) -> tuple[Tensor | None, ...]:
    """The relevance seeded at each of a layer's tensors (``values``) for the unit ``selector`` chooses.

    ``where`` names the layer's tensor in errors. See :meth:`NeuronLRP.attribute` for the selectors.
    """
    if callable(selector):
        return _selected_by_function(values, selector, where)
    index = (selector,) if isinstance(selector, int) and not isinstance(selector, bool) else selector
    if not isinstance(index, tuple) or not all(isinstance(i, slice) or isinstance(i, int) and not isinstance(i, bool)
                                               for i in index):
        raise TypeError(f"relprop: neuron_selector must be an int, a tuple of ints and slices, or a callable; got "
                        f"{selector!r}")
    if len(values) != 1:
        raise ValueError(f"relprop: an index selects a unit of one tensor, but {where} holds {len(values)} entries; "
                         "pass a callable neuron_selector that takes the tuple")
    (value,) = values
    assert value is not None, "a single entry that does not depend on the inputs is reported before"
    shape = tuple(value.shape)
    if len(index) > len(shape) - 1:
        raise ValueError(f"relprop: neuron_selector {selector!r} has {len(index)} indices, but {where} of shape "
                         f"{shape} has {len(shape) - 1} dimension(s) after the batch dimension")
    for dim, i in enumerate(index, start=1):
        if isinstance(i, int) and not -shape[dim] <= i < shape[dim]:
            raise ValueError(f"relprop: neuron_selector {selector!r} is out of range for {where} of shape {shape}: "
                             f"index {i} on dimension {dim} of size {shape[dim]}")
    mask = torch.zeros_like(value, dtype=torch.bool)
    mask[(slice(None), *index)] = True
    return (torch.where(mask, value.detach(), torch.zeros((), dtype=value.dtype, device=value.device)),)


def _selected_by_function(values: tuple[Tensor | None, ...], selector: Callable[[Any], Tensor],
                          where: str) -> tuple[Tensor | None, ...]:
    """The seeds ``dv/dy * y`` of a function ``v`` of the layer's tensors ``y`` (one value per example)."""
    leaves = tuple(None if value is None else value.detach().requires_grad_() for value in values)
    batch = next(leaf for leaf in leaves if leaf is not None).shape[0]
    with torch.enable_grad():
        picked = selector(leaves[0] if len(leaves) == 1 else leaves)
    if not isinstance(picked, Tensor) or picked.shape != (batch,):
        got = tuple(picked.shape) if isinstance(picked, Tensor) else type(picked).__name__
        raise ValueError(f"relprop: neuron_selector must return one value per example, shape ({batch},), from "
                         f"{where}; it returned {got}")
    wanted = [leaf for leaf in leaves if leaf is not None]
    if not picked.requires_grad:
        raise ValueError(f"relprop: the value neuron_selector returned does not depend on {where}")
    grads = iter(torch.autograd.grad(picked.sum(), wanted, allow_unused=True))
    seeds: list[Tensor | None] = []
    for leaf in leaves:
        grad = None if leaf is None else next(grads)
        seeds.append(None if leaf is None or grad is None else grad * leaf.detach())
    return tuple(seeds)
