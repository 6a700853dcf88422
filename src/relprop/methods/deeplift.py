"""DeepLift, DeepLiftShap and LayerDeepLift: input and baseline explained together, as a pair of batches."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from relprop._core.errors import ConservationWarning, warn_caller
from relprop.methods._inputs import (
    Inputs,
    Target,
    as_tuple,
    format_baselines,
    format_inputs,
    forward_arguments,
    one_or_list,
    repeat_arguments,
    repeat_target,
    tile_arguments,
)
from relprop.methods.protocol import Attribution, captum_entry
from relprop.methods.deeplift_reveal import RULES, RevealCancelComposite, Splits, collapse
from relprop.methods.deeplift_rules import DeepLiftComposite
from relprop.methods.deeplift_session import DeepLiftLRP
from relprop.methods.gradients import _completeness_delta
from relprop.methods.layer import Tapper, backward_to_taps, resolve_module
from relprop.methods.targets import target_mask

class _Joint:
    """One forward pass over ``cat([inputs, baselines])`` under the DeepLift rules, and its seed."""

    def __init__(self, model: nn.Module, items: tuple[Tensor, ...], starts: tuple[Tensor, ...], target: Target,
                 additional_forward_args: Any, rule: str, taps: Any = None):
        batch = items[0].shape[0]
        if any(x.shape[0] != batch for x in items):
            raise ValueError(f"relprop: every input needs the same batch size, got {[x.shape[0] for x in items]}")
        self.batch, self.items, self.starts = batch, items, starts
        composite = RevealCancelComposite(batch) if rule == "reveal_cancel" else DeepLiftComposite(batch)
        #: the parts of the activations' differences under RevealCancel, else None
        self.splits: Splits | None = getattr(composite, "splits", None)
        self.lrp = DeepLiftLRP(model, composite)
        positional, keywords = tile_arguments(forward_arguments(additional_forward_args), batch)
        joined = tuple(torch.cat([x, start]) for x, start in zip(items, starts))
        with torch.inference_mode(False):
            self.explained = self.lrp.record(joined, keywords or positional, taps=taps, reusable=False)
        logits = self.explained.logits
        if logits.dim() == 0 or logits.shape[0] != 2 * batch:
            raise ValueError(f"relprop: DeepLift needs the model output batch first ({2 * batch} rows for inputs "
                             f"and baselines), got shape {tuple(logits.shape)}")
        values = logits.detach()
        mask = target_mask(values[:batch], target)
        #: the multiplier seeded at the output: 1 at the target of each input, nothing for the baselines; under
        #: RevealCancel 1 for both parts of the target's difference
        self.seed = torch.cat([mask, mask if self.splits is not None else torch.zeros_like(mask)]).to(values.dtype)
        explained = (values * torch.cat([mask, mask])).reshape(2 * batch, -1).sum(1)
        #: f(x) - f(x0) at the target, and |f(x)| + |f(x0)|, per example
        self.difference = explained[:batch] - explained[batch:]
        self.size = explained[:batch].abs() + explained[batch:].abs()

    def deltas(self) -> tuple[Tensor, ...]:
        return tuple(x - start for x, start in zip(self.items, self.starts))

    def multipliers(self, found: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """The multiplier of each input entry, from what reached the inputs (under RevealCancel, a pair)."""
        if self.splits is None:
            return tuple(m[:self.batch] for m in found)
        return tuple(collapse(m, d, self.batch) for m, d in zip(found, self.deltas()))

    def contributions(self, found: Tensor, below: Tensor) -> tuple[Tensor, Tensor]:
        """The contributions and multipliers of a tapped tensor ``below``, given what reached it."""
        difference = below[:self.batch].detach() - below[self.batch:].detach()
        if self.splits is None:
            m = found[:self.batch]
            return m * difference, m
        parts = self.splits.of(below)
        assert parts is not None, "a tapped tensor that got multipliers has the joint batch first"
        share = found * parts
        contribution = share[:self.batch] + share[self.batch:]
        tiny = difference == 0
        mean = (found[:self.batch] + found[self.batch:]) / 2
        return contribution, torch.where(tiny, mean, contribution / torch.where(tiny, 1.0, difference))

    def delta(self, attributions: Sequence[Tensor]) -> Tensor:
        """captum's delta per example: ``attributions total - (f(x) - f(x0))``."""
        total = sum(a.reshape(self.batch, -1).sum(1) for a in attributions)
        return total - self.difference  # type: ignore[return-value]

    def check(self, attributions: Sequence[Tensor]) -> Tensor:
        """:meth:`delta`, with a warning where it is more than rounding."""
        delta = self.delta(attributions)
        session = self.lrp.last_session
        scale = sum(a.reshape(self.batch, -1).abs().sum(1) for a in attributions) + self.size
        # rounding: of the quotients (sqrt(eps), see _tiny), and of multipliers where the model computes in a
        # narrower type than its output (Hugging Face's RMSNorm in float32): autograd keeps them in that type
        tolerance = max(math.sqrt(torch.finfo(delta.dtype).eps), 100 * session.precision) * scale
        if bool((delta.abs() > tolerance).any()):
            inexact = sorted(set(session.inexact))
            cause = (f"ops without an exact rule: {', '.join(inexact)}" if inexact else
                     "an op without an exact rule, or an op that mixes examples of the batch")
            warn_caller(f"relprop: DeepLift attributions miss f(x) - f(baseline) by up to "
                        f"{delta.abs().max().item():.3g} (of {self.difference.abs().max().item():.3g}): {cause}",
                        ConservationWarning)
        return delta


def _format(inputs: Inputs, baselines: Any) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:

    items = format_inputs(inputs)
    return items, format_baselines(items, baselines)


def _rule(rule: str) -> str:
    if rule not in RULES:
        raise ValueError(f"relprop: DeepLift has no rule {rule!r}; the rules are {', '.join(map(repr, RULES))}")
    return rule


class DeepLift(Attribution):
    """DeepLift, Rescale or RevealCancel rule (Shrikumar et al. 2017), on relprop's engine with captum's interface.

    Inputs and baselines run as one batch (one forward pass); each op's rule
    maps multipliers so that the attributions sum to ``f(x) - f(baseline)``
    at the target exactly, also through functional ops, modules called
    several times, residual sums, ``cat``, in-place ops, max pooling,
    softmax and normalisation (the table in :mod:`relprop.methods.deeplift_rules`).

    Parameters
    ----------
    model : nn.Module
        The model; batch first in every tensor it computes from the inputs.
    multiply_by_inputs : bool
        True (default): ``(x - baseline) * multiplier``; False: the multipliers (captum's flag).
    rule : {"rescale", "reveal_cancel"}
        The rule of the nonlinearities: Rescale (default), or RevealCancel, which splits each unit's input
        difference into its positive and negative terms and measures each part's effect averaged over the
        two orders (the table in :mod:`relprop.methods.deeplift_reveal`).

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> import relprop
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    >>> images, labels = torch.randn(2, 4), torch.tensor([0, 2])
    >>> deeplift = relprop.methods.DeepLift(model)
    >>> attributions, delta = deeplift.attribute(images, target=labels, return_convergence_delta=True)
    >>> attributions.shape  # baselines: zeros
    torch.Size([2, 4])
    >>> bool(delta.abs().max() < 1e-5)  # they sum to f(x) - f(baseline)
    True
    >>> reveal = relprop.methods.DeepLift(model, rule="reveal_cancel")
    >>> attributions, delta = reveal.attribute(images, target=labels, return_convergence_delta=True)
    >>> bool(delta.abs().max() < 1e-5)  # complete too
    True
    """

    def __init__(self, model: nn.Module, multiply_by_inputs: bool = True, rule: str = "rescale"):
        if not isinstance(model, nn.Module):
            raise TypeError(f"relprop: model must be a torch.nn.Module, got {type(model).__name__}")
        super().__init__(model)
        self.model = model
        self.multiplies_by_inputs = multiply_by_inputs
        self.rule = _rule(rule)

    @captum_entry
    def attribute(self, inputs: Inputs, baselines: Any = None, target: Target = None,
                  additional_forward_args: Any = None, return_convergence_delta: bool = False) -> Any:
        """DeepLift attributions of the target output, shaped like the inputs.

        Parameters
        ----------
        inputs : Tensor or tuple of Tensors
            Floating-point, batch first.
        baselines : None (zeros), number, Tensor or tuple of them
            One per input, broadcast to its shape.
        target, additional_forward_args :
            As for :meth:`relprop.LRP.attribute`; batch-first tensor arguments
            serve the inputs and the baselines alike.
        return_convergence_delta : bool
            Also return captum's delta per example: ``attributions total - (f(x) - f(baseline))``.

        Warns
        -----
        ConservationWarning
            Where the attributions miss ``f(x) - f(baseline)`` by more than
            rounding, naming the ops without an exact rule that the model used.
        """
        items, starts = _format(inputs, baselines)
        joint = _Joint(self.model, items, starts, target, additional_forward_args, self.rule)
        with torch.inference_mode(False):
            multipliers = joint.multipliers(joint.explained.relevance(joint.seed))
        contributions = tuple(m * d for m, d in zip(multipliers, joint.deltas()))
        delta = joint.check(contributions)
        found = contributions if self.multiplies_by_inputs else multipliers
        result = found[0] if isinstance(inputs, Tensor) else found
        return (result, delta) if return_convergence_delta else result

    def compute_convergence_delta(self, attributions: Inputs, start_point: Any, end_point: Inputs,
                                  target: Target = None, additional_forward_args: Any = None) -> Tensor:
        """captum's ``attributions total - (f(end_point) - f(start_point))`` per example."""

        return _completeness_delta(self.model, attributions, start_point, end_point, target, additional_forward_args)


class DeepLiftShap(DeepLift):
    """DeepLift averaged over a distribution of baselines (captum's ``DeepLiftShap``).

    Every input is paired with every baseline of the distribution, and all
    pairs run as one batch.
    """

    @captum_entry
    def attribute(self, inputs: Inputs, baselines: Any = None, target: Target = None,
                  additional_forward_args: Any = None, return_convergence_delta: bool = False) -> Any:
        """Mean DeepLift attributions over the baselines, shaped like the inputs.

        Other parameters as for :meth:`DeepLift.attribute`.

        Parameters
        ----------
        baselines : Tensor or tuple of Tensors
            One distribution per input: ``K`` baselines shaped like one
            example, stacked (``(K, *input.shape[1:])``).
        return_convergence_delta : bool
            Also return the delta of every (input, baseline) pair, example-major:
            shape ``(N * K,)``, as captum.
        """

        items = format_inputs(inputs)
        given = as_tuple(baselines)
        if len(given) != len(items) or not all(isinstance(b, Tensor) and b.dim() == x.dim() and b.shape[1:] ==
                                               x.shape[1:] for b, x in zip(given, items)):
            raise ValueError("relprop: DeepLiftShap takes one tensor of baselines per input, shaped (K, *input "
                             "shape after the batch)")
        count, batch = given[0].shape[0], items[0].shape[0]
        if any(b.shape[0] != count for b in given):
            raise ValueError("relprop: every input needs the same number of baselines")
        copies = tuple(x.repeat_interleave(count, 0) for x in items)
        starts = tuple(b.to(x).repeat(batch, *[1] * (b.dim() - 1)) for b, x in zip(given, items))
        arguments = repeat_arguments(forward_arguments(additional_forward_args), batch, count)
        found, delta = DeepLift.attribute.__wrapped__(  # type: ignore[attr-defined]
            self, copies, starts, repeat_target(target, count), arguments[1] or arguments[0], True)
        means = tuple(a.reshape(batch, count, *a.shape[1:]).mean(1) for a in found)
        result = means[0] if isinstance(inputs, Tensor) else means
        return (result, delta) if return_convergence_delta else result


class LayerDeepLift(Attribution):
    """DeepLift attributions of a layer's output (or input), with captum's ``LayerDeepLift`` interface.

    The multipliers reach the layer through the engine's graph, so the
    layer's output gets exactly what the ops that read it hand back: through
    a max pooling or activation after it, a module called several times (one
    result per call) or functional ops. With ``multiply_by_inputs`` the
    attributions are ``multiplier * (layer output - its value for the baseline)``
    and sum to ``f(x) - f(baseline)`` where all of the target's dependence
    on the inputs passes through the layer.

    Parameters
    ----------
    model : nn.Module
    layer : module or dotted module name
    multiply_by_inputs : bool
    rule : {"rescale", "reveal_cancel"}
        As for :class:`DeepLift`. Under RevealCancel a unit's attribution is
        ``m+ P + m- M`` over the parts of its difference, and its multiplier
        that divided by the difference.
    """

    def __init__(self, model: nn.Module, layer: nn.Module | str, multiply_by_inputs: bool = True,
                 rule: str = "rescale"):
        super().__init__(model)
        self.model = model
        self.layer = resolve_module(model, layer)
        self.multiplies_by_inputs = multiply_by_inputs
        self.rule = _rule(rule)

    @captum_entry
    def attribute(self, inputs: Inputs, baselines: Any = None, target: Target = None,
                  additional_forward_args: Any = None, return_convergence_delta: bool = False,
                  attribute_to_layer_input: bool = False) -> Any:
        """DeepLift attributions at the layer for the model's output at ``target``.

        Returns
        -------
        Tensor, tuple or list
            A tensor shaped like the layer's output (or input), a tuple for tuple
            outputs or several inputs, a list when the layer ran several times; with
            ``return_convergence_delta``, also ``attributions total - (f(x) - f(baseline))``
            per example (for each call).
        """
        items, starts = _format(inputs, baselines)
        tapper = Tapper(attribute_to_layer_input)
        joint = _Joint(self.model, items, starts, target, additional_forward_args, self.rule,
                       taps={self.layer: tapper})
        with torch.inference_mode(False):
            backward_to_taps(joint.explained.logits, joint.seed, [tapper])
        results, deltas = [], []
        for single, records in tapper.calls:
            found: list[Tensor | None] = []
            for record in records:
                if record is None:
                    found.append(None)
                    continue
                assert record.below is not None, "a record of a layer that ran has its tensor"
                contribution, m = joint.contributions(record.value(), record.below)
                found.append(contribution if self.multiplies_by_inputs else m)
            if return_convergence_delta:
                deltas.append(joint.delta([a for a in found if a is not None]))
            results.append(found[0] if single else tuple(found))
        result = one_or_list(results)
        return (result, one_or_list(deltas)) if return_convergence_delta else result
