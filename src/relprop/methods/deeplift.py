"""DeepLift, DeepLiftShap and LayerDeepLift: input and baseline explained together, as a pair of batches."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relprop._core.errors import ConservationWarning, warn_caller
from relprop._core.kinds import OpKind
from relprop._core.registry import op_name
from relprop._core.signatures import bind
from relprop._core.tensors import is_activation
from relprop.engine.calls import OpCall
from relprop.engine.nodes import write_into
from relprop.engine.session import Session
from relprop.engine.tracking import AliasTracker
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
from relprop.methods.attribution import LRP
from relprop.methods.protocol import Attribution, captum_entry
from relprop.methods.deeplift_reveal import RULES, RevealCancelComposite, Splits, collapse
from relprop.methods.deeplift_rules import _NORMS, DeepLiftComposite, VectorNormRescale
from relprop.methods.gradients import _completeness_delta
from relprop.methods.layer import Tapper, backward_to_taps, resolve_module
from relprop.methods.targets import target_mask
from relprop.ops.elementwise import IN_PLACE_ACTIVATIONS, IN_PLACE_NAMES, INPLACE_FLAG_ACTIVATIONS

_T = torch.Tensor
#: casts that may round: an elementwise function, Rescale'd when they lose precision
_CASTS = frozenset({_T.to, _T.float, _T.half, _T.bfloat16, _T.type, _T.type_as})
#: ops whose handling in the engine is not exact for differences: routing ops that pick entries by value (their
#: gradient) and ``F.normalize`` (elementwise there); a norm that is not a finite p-norm along given dimensions is
#: noted by its rule
_INEXACT = frozenset([getattr(namespace, name) for namespace in (torch, _T)
                      for name in "max min maximum minimum fmax fmin sort topk kthvalue median".split()
                      if hasattr(namespace, name)] + [F.normalize])
#: maxima and minima along dimensions, run as op calls of kind "maxpool" (routing ops of the engine otherwise)
_EXTREMA = {torch.amax: torch.amax, _T.amax: torch.amax, torch.amin: torch.amin, _T.amin: torch.amin,
            torch.max: torch.amax, _T.max: torch.amax, torch.min: torch.amin, _T.min: torch.amin}


#: elementwise ops run in place, and their out-of-place forms (the op families' lists)
_IN_PLACE = {getattr(namespace, name + "_"): getattr(namespace, name) for namespace in (torch, _T, F)
             for name in (*IN_PLACE_NAMES, "sigmoid", "exp", *(f.__name__ for f in IN_PLACE_ACTIVATIONS))
             if hasattr(namespace, name + "_") and hasattr(namespace, name)}
#: routing ops in place: under RevealCancel the target takes the parts of what is written into it
_WRITES = frozenset(getattr(_T, name) for name in ("__setitem__", "copy_", "masked_fill_", "index_copy_", "index_fill_",
                                                  "scatter_", "masked_scatter_", "fill_", "zero_"))
#: activations with an ``inplace=`` argument
_INPLACE_FLAG = frozenset(getattr(F, name) for name in (*INPLACE_FLAG_ACTIVATIONS, "hardsigmoid") if hasattr(F, name))


class _SplitTracker(AliasTracker):
    """The alias tracker of a RevealCancel pass: a tensor overwritten in place takes the parts of what it got."""

    def __init__(self, splits: Splits):
        super().__init__()
        self.splits = splits

    def overwritten(self, tensor: Tensor, result: Tensor | None = None) -> Tensor:
        self.splits.set(tensor, None if result is None else self.splits.recorded(result))
        return super().overwritten(tensor, result)

    def protect(self, tensor: Any, copy: Tensor | None = None) -> None:
        if copy is not None:  # the copy an op in place reads instead of its target
            self.splits.set(copy, self.splits.recorded(tensor))
        super().protect(tensor, copy)


class _DeepLiftSession(Session):
    """The engine's mode, with four changes for DeepLift, and a fifth for RevealCancel.

    Casts that round are elementwise ops (Rescale makes them exact); maxima
    and minima along dimensions are op calls of kind ``"maxpool"``; ops
    without an exact rule are noted with their module paths; elementwise ops
    in place run out of place and are written back after the op that reads
    the old values has kept a copy (the engine's own path lets the new op read
    the overwritten memory when its rule is not ``Pass``). Under RevealCancel
    the op calls, routing ops and taps record the parts of their outputs'
    differences (:class:`~relprop.methods.deeplift_reveal.Splits`).
    """

    accounts = False  # multipliers flow backward, not relevance: their totals are no account

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: ops met whose handling is not exact for differences, with their module paths
        self.inexact: list[str] = []
        #: the machine epsilon of the narrowest floating-point type an op computed in, where narrower than its input:
        #: multipliers through such ops are in that type, which bounds how exact DeepLift can be
        self.precision = 0.0
        #: the parts of the activations' differences, under RevealCancel
        self.splits: Splits | None = getattr(self.composite, "splits", None)
        if self.splits is not None:
            self.aliases = _SplitTracker(self.splits)

    def run(self, call: OpCall, rule: Any = None, source: str = "inherited from the merged layer") -> Any:
        if self.splits is None:
            return super().run(call, rule, source)
        self.splits.enter(call)
        out = super().run(call, rule, source)
        with self._reading():  # the engine computes: no op of the model
            self.splits.leave(call, out)
        return out

    def routed(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        out = super().routed(func, args, kwargs)
        if self.splits is not None:
            with self._reading():
                self.splits.route(func, args, kwargs, out)
        return out

    def tap(self, value: Any, record: Any) -> Any:
        out = super().tap(value, record)
        if self.splits is not None and out is not value:
            self.splits.set(out, self.splits.recorded(value))
        return out

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.splits is not None and func in _WRITES and not self.context.opaque and not self._engine_reads:
            with self._reading():
                parts = self.splits.write(func, args, kwargs)
            out = super().__torch_function__(func, types, args, kwargs)
            self.splits.set(args[0], parts)  # None: the signs, as routing gives them
            return out
        if self.context.opaque or not args or not is_activation(args[0]):
            return super().__torch_function__(func, types, args, kwargs)
        if func in _IN_PLACE or func in _INPLACE_FLAG and bind(func, args, kwargs).get("inplace"):
            return self._out_of_place(func, types, args, kwargs)
        if func in _EXTREMA and (found := self._extremum(func, args, kwargs)) is not None:
            return found
        out = super().__torch_function__(func, types, args, kwargs)
        if func in _INEXACT or func in _NORMS and not self._vector_norm(out):
            self.inexact.append(f"{op_name(func)} in module '{self.module_name or '<root>'}'")
        narrower = (isinstance(out, Tensor) and out.is_floating_point() and args[0].is_floating_point()
                    and torch.finfo(out.dtype).eps > torch.finfo(args[0].dtype).eps)
        if narrower:  # a cast, or an op computing in a narrower type (softmax(..., dtype=torch.float32))
            self.precision = max(self.precision, torch.finfo(out.dtype).eps)
            if func in _CASTS:
                return self.run(OpCall(OpKind.ELEMENTWISE, func, args, kwargs, op_name(func), self.module_name))
        return out

    def _vector_norm(self, out: Any) -> bool:
        """Whether ``out`` is the output of a norm that :class:`VectorNormRescale` propagates exactly."""
        call = self.aliases.producer(out) if isinstance(out, Tensor) else None
        return call is not None and call.rule is not None and isinstance(RevealCancelComposite.unwrap(call.rule),
                                                                          VectorNormRescale)

    def _extremum(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """``amax``/``amin``, and ``max``/``min`` along a dimension, as op calls with the max-pool rule.

        None for the forms that are not a reduction along dimensions of one
        activation (``max(a, b)``, ``max()`` of everything): the engine runs them.
        """
        names = ("input", "dim", "keepdim")
        bound = {**dict(zip(names, args)), **kwargs}
        if set(bound) - set(names) or "dim" not in bound or not isinstance(bound["dim"], (int, tuple, list)):
            return None
        reduce = _EXTREMA[func]
        dim, keepdim = bound["dim"], bound.get("keepdim", False)
        values = self.run(OpCall(OpKind.MAXPOOL, reduce, (bound["input"], dim, keepdim), {}, op_name(func),
                                 self.module_name))
        if func in (torch.amax, _T.amax, torch.amin, _T.amin):
            return values
        with torch.no_grad():  # max/min along a dimension also return where the extrema are
            indices = func(bound["input"].detach(), dim, keepdim).indices
        kind = torch.return_types.max if reduce is torch.amax else torch.return_types.min
        return kind((values, indices))

    def _out_of_place(self, func: Callable, types: Any, args: tuple, kwargs: dict) -> Tensor:
        """An elementwise op in place, as its out-of-place form written into the target."""
        target = args[0]
        if func in _INPLACE_FLAG:
            args, kwargs = (), {**bind(func, args, kwargs), "inplace": False}
        else:
            func = _IN_PLACE[func]
        self.aliases.protect(target)  # the op that made the target keeps what its rule reads
        out = super().__torch_function__(func, types, args, kwargs)
        self.aliases.before_write(target)  # ... and so does the op just made, which read the target
        return self.aliases.overwritten(write_into(target, out), out)


class _DeepLiftLRP(LRP):
    session_class = _DeepLiftSession

    @contextmanager
    def _session(self, taps: Any = None, audit: Any = None, token_inputs: tuple[Tensor, ...] = (),
                 reusable: bool = False, gradient_form: bool = False) -> Iterator[Session]:
        with super()._session(taps, audit, token_inputs, reusable, gradient_form) as session:
            self.last_session: _DeepLiftSession = session  # type: ignore[assignment]
            yield session


# ---------------------------------------------------------------- the joint pass




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
        self.lrp = _DeepLiftLRP(model, composite)
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
