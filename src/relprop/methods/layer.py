"""Relevance inside the model: at layers, at every module, and conditioned on channels (concepts).

Relevance at a module's output (or input) is recorded by a *tap*: an identity
node put behind that tensor during the forward pass, which hands the
relevance passing through it to a record during the backward pass. Taps sit
on the tensors the model itself passes on, so later in-place ops (a
``ReLU(inplace=True)``, ``out += identity``) do not disturb them, and the
backward pass stops right below the deepest tap. A tap on a convolution or
dense layer whose output is merged with a following BatchNorm records the
relevance at the BatchNorm's output, as in zennit (the merged BatchNorm is
the identity).

Conditioning (Concept Relevance Propagation, Achtibat et al. 2023) keeps
only the relevance that flows through chosen channels of a layer: the
relevance at the layer is computed once, masked per concept, and propagated
from the layer down to the input for all concepts as one batch. Relevance
that bypasses the layer (a residual skip around it) is not part of any
concept, so on a layer that all relevance must cross (a "cut", such as a
ResNet stage), the concepts of disjoint channel sets add up to the plain
heatmap.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any, Callable

import torch
from torch import Tensor, nn

from relprop._core.tensors import is_activation
from relprop.composites import Composite
from relprop.engine.session import Session
from relprop.methods._inputs import Inputs, Target, one_or_list, tile_target
from relprop.methods.attribution import LRP
from relprop.methods.protocol import Attribution, captum_entry
from relprop.methods.targets import convergence_delta, output_relevance

__all__ = ["LayerLRP", "ModuleRelevance", "module_relevance"]

Reduce = Callable[[Tensor], Tensor]


class _Record:
    """The relevance reaching one tapped tensor of one module call."""

    def __init__(self, reduce: Reduce | None):
        self.reduce = reduce
        self.below: Tensor | None = None  # set by Session.tap: the tapped tensor, where the graph below starts
        self.relevance: Tensor | None = None

    def __call__(self, relevance: Tensor) -> None:
        self.relevance = relevance if self.reduce is None else self.reduce(relevance)

    def value(self) -> Tensor:
        if self.relevance is not None:
            return self.relevance
        assert self.below is not None, "a record is read after its forward pass"
        zeros = torch.zeros_like(self.below)
        return zeros if self.reduce is None else self.reduce(zeros)


class Tapper:
    """Taps a module's output (or its tensor inputs) at every call."""

    def __init__(self, input: bool, reduce: Reduce | None = None):
        self.input = input
        self.reduce = reduce
        self.calls: list[tuple[bool, list[_Record | None]]] = []  # (single tensor?, records) per call

    def __call__(self, session: Session, value: Any) -> Any:
        records: list[_Record | None] = []

        def tap_one(item: Any) -> Any:
            if is_activation(item):
                record = _Record(self.reduce)
                records.append(record)
                return session.tap(item, record)
            records.append(None)
            return item

        if isinstance(value, Tensor):
            self.calls.append((True, records))
            return tap_one(value)
        if isinstance(value, tuple):
            tapped = tuple(tap_one(item) for item in value)
            single = self.input and len(value) == 1
            self.calls.append((single, records))
            return tapped
        return None  # other structures (dicts, ModelOutput) are not tapped

    def records(self) -> list[_Record]:
        return [record for _, records in self.calls for record in records if record is not None]

    def results(self) -> list[Tensor | tuple | None]:
        """One result per call: a tensor, or a tuple for tuple-valued outputs / several inputs."""
        out = []
        for single, records in self.calls:
            values = tuple(record.value() if record is not None else None for record in records)
            out.append(values[0] if single else values)
        return out


def resolve_module(model: nn.Module, layer: nn.Module | str) -> nn.Module:
    if isinstance(layer, nn.Module):
        if not any(module is layer for module in model.modules()):
            raise ValueError(f"relprop: the layer {type(layer).__name__} is not a module of the model")
        return layer
    if isinstance(layer, str):
        try:
            return model.get_submodule(layer)
        except AttributeError as error:
            raise ValueError(f"relprop: the model has no module named {layer!r}") from error
    raise TypeError(f"relprop: a layer is a module or a dotted module name, got {type(layer).__name__}")


def backward_to_taps(logits: Tensor, seed: Tensor, tappers: Sequence[Tapper]) -> None:
    """Propagate the seed down to the deepest tap only."""
    below = [record.below for tapper in tappers for record in tapper.records() if record.below is not None]
    if not below:
        raise RuntimeError("relprop: no relevance reaches the requested layer(s): they did not run in the "
                           "forward pass, or their outputs do not depend on the input")
    torch.autograd.grad(logits, below, seed, allow_unused=True)




class LayerLRP(Attribution):
    """Relevance at a layer's output (default) or input, with captum's interface.

    Parameters
    ----------
    model : nn.Module
    layer : module, dotted module name, or a list of them
        A list returns a list of results. A module called several times in one
        forward pass returns a list with one result per call; a module with a
        tuple output returns a tuple.
    composite, strict :
        As for :class:`relprop.LRP`.
    """

    multiplies_by_inputs = True

    def __init__(self, model: nn.Module, layer: nn.Module | str | Sequence[nn.Module | str],
                 composite: Composite | str | None = None, strict: bool = False):
        self.lrp = LRP(model, composite, strict)
        super().__init__(self.lrp.model)
        self._many = isinstance(layer, (list, tuple))
        layers: Sequence[nn.Module | str] = layer if isinstance(layer, (list, tuple)) else [layer]  # type: ignore
        self.layers = [resolve_module(model, item) for item in layers]

    def _run(self, inputs: Inputs, target: Target, additional_forward_args: Any, attribute_to_layer_input: bool,
             reduce: Reduce | None = None) -> tuple[Tensor, list[Tapper]]:
        tappers = [Tapper(attribute_to_layer_input, reduce) for _ in self.layers]
        with torch.inference_mode(False):
            explained = self.lrp.record(inputs, additional_forward_args, taps=dict(zip(self.layers, tappers)),
                                        reusable=False)
            seed = output_relevance(explained.logits, target)
            backward_to_taps(explained.logits, seed, tappers)
        return seed, tappers

    @captum_entry
    def attribute(self, inputs: Inputs, target: Target = None, additional_forward_args: Any = None,
                  return_convergence_delta: bool = False, attribute_to_layer_input: bool = False) -> Any:
        """Relevance at the layer(s) for the model's output at ``target``.

        Returns
        -------
        For each layer: a tensor shaped like the layer's output (or input), a
        tuple for tuple outputs or several inputs, or a list when the layer ran
        several times. A list of those for a list of layers. With
        ``return_convergence_delta``, also ``seed total - layer relevance total``
        per example (per layer, per call).
        """
        seed, tappers = self._run(inputs, target, additional_forward_args, attribute_to_layer_input)
        results = [one_or_list(tapper.results()) for tapper in tappers]
        result = results if self._many else results[0]
        if not return_convergence_delta:
            return result
        deltas = [one_or_list([convergence_delta(seed, r) for r in tapper.results()]) for tapper in tappers]
        return result, (deltas if self._many else deltas[0])

    def compute_convergence_delta(self, attributions: Inputs, output: Tensor) -> Tensor:
        """``output - layer relevance total`` per example, for one layer's result of one call.

        ``output`` is the explained output value per example (shape ``(N,)``)
        or the whole output relevance (batch first).
        """
        return convergence_delta(output, attributions)

    def channel_relevance(self, inputs: Inputs, target: Target = None,
                          additional_forward_args: Any = None) -> Tensor:
        """Relevance of each channel (dimension 1) of the layer's output, per example: shape (N, C).

        Rank a layer's channels for one input with ``.argsort(descending=True)``,
        or for a batch after ``.sum(0)``.
        """
        self._single_layer()
        _, (tapper,) = self._run(inputs, target, additional_forward_args, False,
                                    reduce=lambda r: r.sum(tuple(range(2, r.dim()))))
        return one_or_list(tapper.results())

    def attribute_concepts(self, inputs: Tensor, concepts: Sequence[Sequence[int]], target: Target = None,
                           additional_forward_args: Any = None) -> Tensor:
        """Input relevance through chosen channels of the layer, for several channel sets at once.

        Parameters
        ----------
        inputs : Tensor (N, ...)
        concepts : sequence of K channel index lists
            Channels along dimension 1 of the layer's output.
        target :
            As for :meth:`relprop.LRP.attribute`.

        Returns
        -------
        Tensor (K, N, ...): the relevance of the inputs that flows through each
        channel set. All K sets are propagated as one batch of K * N examples.
        """
        layer = self._single_layer()
        count = len(concepts)
        if not isinstance(inputs, Tensor) or count == 0:
            raise ValueError("relprop: attribute_concepts takes one input tensor and at least one channel set")
        batch = inputs.shape[0]
        repeated = inputs.repeat(count, *[1] * (inputs.dim() - 1))
        tapper = Tapper(input=False)
        with torch.inference_mode(False):
            explained = self.lrp.record(repeated, additional_forward_args, taps={layer: tapper}, reusable=False)
            (leaf,) = explained.inputs
            if len(tapper.calls) != 1:
                raise ValueError(f"relprop: conditioning needs a layer that runs once, "
                                 f"it ran {len(tapper.calls)} times")
            logits = explained.logits
            backward_to_taps(logits, output_relevance(logits, tile_target(target, count)), [tapper])
            (record,) = tapper.records()
            relevance = record.value()
            mask = torch.zeros(count, relevance.shape[1], dtype=relevance.dtype, device=relevance.device)
            for k, channels in enumerate(concepts):
                channels = list(channels)
                if channels and not all(-relevance.shape[1] <= c < relevance.shape[1] for c in channels):
                    raise ValueError(f"relprop: concept {k} names channels {channels}, but the layer has "
                                     f"{relevance.shape[1]}")
                mask[k, channels] = 1.0
            mask = mask.repeat_interleave(batch, 0).reshape(count * batch, -1, *[1] * (relevance.dim() - 2))
            assert record.below is not None, "the tap of a layer that ran has its tensor"
            (through,) = torch.autograd.grad(record.below, leaf, relevance * mask)
        return through.reshape(count, batch, *inputs.shape[1:])

    def _single_layer(self) -> nn.Module:
        if len(self.layers) != 1:
            raise ValueError("relprop: this needs a single layer")
        return self.layers[0]




class ModuleRelevance(Mapping):
    """Relevance at the outputs of a model's modules, by dotted name, from one attribution.

    Only the modules selected when it was made are recorded, each reduced by
    ``reduce`` as its relevance arrives; a value is assembled when it is
    looked up. ``input`` holds the relevance of the model inputs.
    """

    def __init__(self, tappers: dict[str, Tapper], input: tuple[Tensor, ...]):
        self._tappers = {name: tapper for name, tapper in tappers.items() if tapper.calls}
        self.input = input

    def __getitem__(self, name: str) -> Any:
        return one_or_list(self._tappers[name].results())

    def __iter__(self) -> Iterator[str]:
        return iter(self._tappers)

    def __len__(self) -> int:
        return len(self._tappers)


def module_relevance(model: nn.Module, inputs: Inputs, target: Target = None,
                     composite: Composite | str | None = None, modules: str | Sequence[str] = "*",
                     reduce: Reduce | None = None, additional_forward_args: Any = None) -> ModuleRelevance:
    """Relevance at the output of every selected module, in one forward and one backward pass.

    Parameters
    ----------
    modules : shell pattern or list of patterns on dotted module names
        ``"*"`` selects every submodule (not the model itself).
    reduce : callable, optional
        Applied to each module's relevance as it arrives, e.g.
        ``lambda r: r.sum((2, 3))`` to keep per-channel totals only.
    """
    patterns = [modules] if isinstance(modules, str) else list(modules)
    lrp = LRP(model, composite)
    tappers = {name: Tapper(False, reduce) for name, module in model.named_modules()
               if name and any(fnmatchcase(name, pattern) for pattern in patterns)}
    by_module = {model.get_submodule(name): tapper for name, tapper in tappers.items()}
    with torch.inference_mode(False):
        explained = lrp.record(inputs, additional_forward_args, taps=by_module, reusable=False)
        relevance = explained.relevance(output_relevance(explained.logits, target))
    return ModuleRelevance(tappers, relevance)
