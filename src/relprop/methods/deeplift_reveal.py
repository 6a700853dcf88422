"""DeepLift's RevealCancel rule (Shrikumar et al. 2017, section 3.5.3) on the relevance engine.

The difference ``Delta t = t[:N] - t[N:]`` of every activation is split into
a positive and a negative part, ``Delta t = P + M`` with ``P >= 0 >= M``,
held as one tensor ``cat([P, M])`` shaped like ``t`` (its *parts*), and the
multiplier arriving at ``t`` is a pair too: ``cat([m+, m-])``, one for each
part, in place of DeepLift's ``cat([m, 0])``. Each op's rule keeps
``sum m+_in P_in + m-_in M_in = sum m+ P + m- M``, so the attributions sum
to ``f(x) - f(x0)`` exactly, as under Rescale.

==============================  ==============================================================
op                              parts, and multipliers
==============================  ==============================================================
model input, output of an op    the signs of the difference: ``P = max(Delta, 0)``,
that is not linear              ``M = min(Delta, 0)``; the multiplier of the entry is ``m+``
                                where ``Delta > 0``, ``m-`` where ``Delta < 0``, their mean at 0
conv, dense (BatchNorm merged)  the paper's terms: ``P_out = W+ P + W- M`` (the positive terms
                                ``w * Delta a``), ``M_out = W+ M + W- P``; multipliers transposed
other linear ops (sums,         per input: the positive entries of ``L_k(P_k)`` and ``L_k(M_k)``
differences, scalings, means,   go to ``P_out``, the negative ones to ``M_out`` (the same as
pooling, routing)               per term wherever an input enters an output with one sign)
elementwise ``y = f(x)``        RevealCancel: ``Delta y+ = (f(x0 + P) - f(x0)) / 2 + (f(x) -
                                f(x0 + M)) / 2``, ``Delta y-`` alike, ``m+_x = m Delta y+ / P``,
                                ``m-_x = m Delta y- / M``; where ``P`` (``M``) is tiny, the mean
                                of ``f'`` at the midpoints of the two steps
other ops (products, softmax,   their Rescale rule, one multiplier for both parts of each input
norms, attention, max pooling)
==============================  ==============================================================

Nothing else differs from Rescale: where no unit sees both a positive and a
negative part, RevealCancel's attributions are Rescale's.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from relprop import rules
from relprop._core.contract import is_parametric
from relprop._core.kinds import OpKind
from relprop._core.tensors import is_activation, sum_to
from relprop.engine.calls import OpCall
from relprop.methods.deeplift_rules import DeepLiftComposite, Rescale, _halves, _tiny

__all__ = ["RULES", "Collapsed", "RevealCancel", "RevealCancelComposite", "SplitLinear", "Splits"]

#: the names of DeepLift's rules, for ``DeepLift(model, rule=...)``
RULES = ("rescale", "reveal_cancel")


def sign_parts(t: Tensor, pairs: int) -> Tensor | None:
    """``cat([max(Delta, 0), min(Delta, 0)])`` of an activation; None where it has not the joint batch first."""
    if t.dim() == 0 or t.shape[0] != 2 * pairs:
        return None
    delta = t[:pairs].detach() - t[pairs:].detach()
    return torch.cat([delta.clamp(min=0), delta.clamp(max=0)])


def collapse(multipliers: Tensor, delta: Tensor, pairs: int) -> Tensor:
    """A multiplier per entry of ``cat([m+, m-])``: ``m+`` where ``delta > 0``, ``m-`` where ``< 0``, else the mean."""
    plus, minus = multipliers[:pairs], multipliers[pairs:]
    return torch.where(delta > 0, plus, torch.where(delta < 0, minus, (plus + minus) / 2))


def _swap(t: Tensor, pairs: int) -> Tensor:
    """``cat([b, a])`` of ``cat([a, b])``."""
    return torch.cat([t[pairs:], t[:pairs]])


class Splits:
    """The parts of the activations of one pass, where they are not the signs of their difference.

    The session records the parts of each output of a linear op or a routing
    op (:meth:`leave`, :meth:`route`) and of every op call's inputs
    (:meth:`enter`), which its rule reads in the backward pass. An entry
    holds for the version of the tensor it was made for: a tensor changed in
    place without the session's knowledge is taken for its signs again.
    """

    def __init__(self, pairs: int):
        self.pairs = pairs
        self._tensors: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._calls: weakref.WeakKeyDictionary[OpCall, tuple[Tensor | None, ...]] = weakref.WeakKeyDictionary()

    def recorded(self, t: Any) -> Tensor | None:
        """The parts recorded for ``t``, if any and ``t`` has not changed since."""
        found = self._tensors.get(t) if isinstance(t, Tensor) else None
        if found is None or found[1] != t._version:
            return None
        return found[0]

    def of(self, t: Tensor) -> Tensor | None:
        """The parts of ``t``: as recorded, else its signs (None where ``t`` is not batch first)."""
        found = self.recorded(t)
        return found if found is not None else sign_parts(t, self.pairs)

    def set(self, t: Any, parts: Tensor | None) -> None:
        """Record ``parts`` for ``t`` (None: its signs)."""
        if not isinstance(t, Tensor):
            return
        if parts is None:
            self._tensors.pop(t, None)
        else:
            self._tensors[t] = (parts.detach(), t._version)

    def enter(self, call: OpCall) -> None:
        """Before ``call`` runs: the parts recorded for its activation inputs."""
        self._calls[call] = tuple(self.recorded(x) for x in call.activations)

    def inputs(self, call: OpCall) -> tuple[Tensor, ...]:
        """The parts of each of ``call.inputs``."""
        recorded = self._calls.get(call, ())
        found = []
        for i, x in enumerate(call.inputs):
            parts = recorded[i] if i < len(recorded) else None
            parts = parts if parts is not None else sign_parts(x, self.pairs)
            if parts is None:
                _halves(call, x, self.pairs)  # raises, naming the op
            found.append(parts)
        return tuple(found)  # type: ignore[arg-type]

    def leave(self, call: OpCall, out: Any) -> None:
        """After ``call`` ran: the parts of its output, from its inputs' where its rule maps parts linearly."""
        rule = call.rule
        parts = None
        if isinstance(rule, SplitLinear):
            parts = rule.split(call, self.inputs(call))
        elif isinstance(rule, rules.Gradient) and call.kind != OpKind.UNKNOWN \
                and any(p is not None for p in self._calls.get(call, ())):  # routing with constants mixed in
            parts = sum(_each_input(call, self.inputs(call)))  # type: ignore[assignment]
        self.set(out, parts)

    def write(self, func: Callable, args: tuple, kwargs: dict) -> Tensor | None:
        """Before a routing op in place (``t[i] = v``, ``copy_``, ``masked_fill_``): the parts ``args[0]`` will
        have, where any activation among the arguments has recorded parts (else None: the signs, as routed)."""
        leaves, spec = tree_flatten((args, kwargs))
        if not any(is_activation(x) and self.recorded(x) is not None for x in leaves):
            return None
        target = args[0]
        start = self.of(target) if is_activation(target) else sign_parts(torch.zeros_like(target), self.pairs)
        parts = [self.of(x) if is_activation(x) else x for x in leaves]
        if start is None or any(p is None for p, x in zip(parts, leaves) if is_activation(x)):
            return None
        zeros = [torch.zeros_like(x) if is_activation(x) else x for x in leaves]
        found = []
        for values, first in ((parts, start.clone()), (zeros, torch.zeros_like(start))):
            values = [first if x is target else v for v, x in zip(values, leaves)]
            new_args, new_kwargs = tree_unflatten(values, spec)
            func(*new_args, **new_kwargs)
            found.append(first)
        return found[0] - found[1]  # constants written in place are no part of a difference

    def route(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        """A routing op: its outputs' parts are its inputs' routed alike, where any input has recorded parts."""
        leaves, spec = tree_flatten((args, kwargs))
        if not any(is_activation(x) and self.recorded(x) is not None for x in leaves):
            return
        parts = [self.of(x) if is_activation(x) else x for x in leaves]
        if any(p is None for p, x in zip(parts, leaves) if is_activation(x)):
            return
        new_args, new_kwargs = tree_unflatten(parts, spec)
        found = func(*new_args, **new_kwargs)
        outs, routed = (out, found) if isinstance(out, (tuple, list)) else ((out,), (found,))
        for o, p in zip(outs, routed):
            if isinstance(o, Tensor) and isinstance(p, Tensor) and p.shape == o.shape:
                self.set(o, p)


def _each_input(call: OpCall, parts: tuple[Tensor, ...]) -> list[Tensor]:
    """``L_k(parts_k)`` of a linear op ``f = sum_k L_k + c`` for each input ``k``: ``f(.., parts_k, ..) - f(0)``."""
    zeros = [torch.zeros_like(x) for x in call.inputs]
    with torch.no_grad():
        constant = call.call_with(call.func, [z.clone() for z in zeros])  # clones: an op in place writes into them
        found = []
        for k, p in enumerate(parts):
            values = [z.clone() for z in zeros]
            values[k] = p.to(call.inputs[k].dtype).clone()
            found.append(call.call_with(call.func, values) - constant)
    return found


class SplitLinear(rules.Rule):
    """RevealCancel's rule of a linear op: the parts of its output are the positive and negative terms.

    A convolution or dense layer (BatchNorm merged) splits by term, as the
    paper: ``P_out = W+ P + W- M``, ``M_out = W+ M + W- P``, and
    ``m+_in = W+^T m+ + W-^T m-``, ``m-_in = W+^T m- + W-^T m+``. Other
    linear ops ``f = sum_k L_k + c`` split by input: the positive entries of
    ``L_k(P_k)`` and of ``L_k(M_k)`` go to ``P_out``, the negative ones to
    ``M_out`` (an entry of 0 takes the mean of both multipliers).
    """

    kinds = frozenset(OpKind)
    needs_vjp = True
    needs_output = False

    def __init__(self, splits: Splits):
        self.splits = splits

    def split(self, call: OpCall, parts: tuple[Tensor, ...]) -> Tensor:
        """The parts of the output, given the parts of the inputs."""
        if is_parametric(call):
            return self._parametric(call, parts[0].to(call.inputs[0].dtype))
        pairs = self.splits.pairs
        total: Tensor | None = None
        for term in _each_input(call, parts):
            positive, negative = term.clamp(min=0), term.clamp(max=0)
            found = torch.cat([positive[:pairs] + positive[pairs:], negative[:pairs] + negative[pairs:]])
            total = found if total is None else total + found
        assert total is not None, "a linear op call has an activation input"
        return total

    def _parametric(self, call: Any, parts: Tensor) -> Tensor:
        weight = call.weight
        pairs = self.splits.pairs
        return (call.evaluate(parts, weight.clamp(min=0), None)
                + _swap(call.evaluate(parts, weight.clamp(max=0), None), pairs))

    def propagate(self, call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
        pairs = self.splits.pairs
        if is_parametric(call):
            with torch.enable_grad():
                leaf = torch.zeros_like(call.inputs[0]).requires_grad_()
                (found,) = torch.autograd.grad(self._parametric(call, leaf), leaf, relevance.to(leaf.dtype))
            return (found,)
        plus, minus = relevance[:pairs], relevance[pairs:]
        doubled = torch.cat([plus, plus]), torch.cat([minus, minus])
        found_inputs: list[Tensor | None] = []
        for k, term in enumerate(_each_input(call, self.splits.inputs(call))):
            grad = torch.where(term > 0, doubled[0], torch.where(term < 0, doubled[1], (doubled[0] + doubled[1]) / 2))
            found_inputs.append(call.vjp(grad)[k])
        return tuple(found_inputs)


class RevealCancel(Rescale):
    """RevealCancel on an elementwise op ``y = f(x)``: the positive and negative parts of ``Delta x`` in turn.

    With ``P``, ``M`` the parts of ``Delta x`` and ``x0`` the baseline,
    ``Delta y+ = (f(x0 + P) - f(x0)) / 2 + (f(x) - f(x0 + M)) / 2`` and
    ``Delta y- = (f(x0 + M) - f(x0)) / 2 + (f(x) - f(x0 + P)) / 2``: each part
    is measured once before and once after the other. ``m+_x = m Delta y+ / P``
    and ``m-_x = m Delta y- / M``, with ``m`` the multiplier of ``y``; where
    ``P`` is tiny, ``m+_x`` is the mean of ``f'`` at the midpoints of the two
    steps of ``P`` (``M`` alike). Where ``M = 0`` it is Rescale. An op that
    cannot be evaluated again (an activation module run as one op) takes
    Rescale for both parts.
    """

    def __init__(self, pairs: int, splits: Splits):
        super().__init__(pairs)
        self.splits = splits

    def propagate(self, call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = call.inputs
        pairs = self.pairs
        dtype = torch.promote_types(x.dtype, call.output.dtype)
        x1, x0 = (half.to(dtype) for half in self.halves(call, x))
        y1, y0 = (half.to(dtype) for half in self.halves(call, call.output))
        m = collapse(relevance.to(dtype), y1 - y0, pairs)
        (parts,) = self.splits.inputs(call)
        plus, minus = (half.to(dtype) for half in (parts[:pairs], parts[pairs:]))

        with torch.enable_grad():  # f after each part alone, x0 + P and x0 + M
            steps = call.call_with(call.func, [torch.cat([x0 + plus, x0 + minus]).to(x.dtype).requires_grad_()])
        if not (isinstance(steps, Tensor) and steps.requires_grad):  # secants only: Rescale for both parts
            (found,) = super().propagate(call, torch.cat([m, torch.zeros_like(m)]).to(relevance.dtype))
            assert found is not None
            return (torch.cat([found[:pairs], found[:pairs]]),)
        steps = steps.detach().to(dtype)
        after_plus, after_minus = steps[:pairs], steps[pairs:]
        rise_plus = ((after_plus - y0) + (y1 - after_minus)) / 2
        rise_minus = ((after_minus - y0) + (y1 - after_plus)) / 2
        results = []
        for part, other, rise in ((plus, minus, rise_plus), (minus, plus, rise_minus)):
            wide = part.expand_as(y1)
            tiny = (_tiny(wide, (x0 + part).expand_as(y1), x0.expand_as(y1))
                    | _tiny(wide, x1.expand_as(y1), (x0 + other).expand_as(y1)))
            result = sum_to(m * torch.where(tiny, 0.0, rise / torch.where(tiny, 1.0, wide)), x1.shape)
            if bool(tiny.any()):  # the mean derivative at the midpoints of the two steps of this part
                with torch.enable_grad():
                    leaf = torch.cat([x0 + part / 2, x0 + other + part / 2]).to(x.dtype).requires_grad_()
                    grad_out = torch.where(tiny, m / 2, 0.0)
                    (derivative,) = torch.autograd.grad(call.call_with(call.func, [leaf]), leaf,
                                                        torch.cat([grad_out, grad_out]).to(leaf.dtype))
                result = result + (derivative[:pairs] + derivative[pairs:]).to(dtype)
            results.append(result)
        return (torch.cat(results).to(x.dtype),)


class Collapsed(rules.Rule):
    """A DeepLift rule of an op that is not linear, under RevealCancel: the parts of its output are their signs.

    The pair of multipliers arriving at the output collapses to one per
    entry (:func:`collapse`), ``rule`` maps it as under Rescale, and both
    parts of each input take what it gives.
    """

    needs_output = True

    def __init__(self, rule: rules.Rule, pairs: int):
        self.rule, self.pairs = rule, pairs
        self.kinds = rule.kinds
        self.needs_vjp = rule.needs_vjp

    def accepts(self, call: OpCall) -> bool:
        return self.rule.accepts(call)

    def propagate(self, call: OpCall, relevance: Tensor) -> tuple[Tensor | None, ...]:
        y1, y0 = _halves(call, call.output, self.pairs)
        m = collapse(relevance, (y1 - y0).to(relevance.dtype), self.pairs)
        found = self.rule.propagate(call, torch.cat([m, torch.zeros_like(m)]))
        return tuple(None if r is None else torch.cat([r[:self.pairs], r[:self.pairs]]) for r in found)

    def __repr__(self) -> str:
        return f"Collapsed({self.rule!r})"


class RevealCancelComposite(DeepLiftComposite):
    """The RevealCancel rule of every op (see the module's table), with the parts of the pass in :attr:`splits`."""

    def __init__(self, pairs: int):
        super().__init__(pairs)
        #: the parts of the activations of the pass
        self.splits = Splits(pairs)
        self._split_linear = SplitLinear(self.splits)
        self._reveal = RevealCancel(pairs, self.splits)
        self._collapsed: dict[int, Collapsed] = {}

    def rule_for(self, call: OpCall, module: Any, name: str) -> tuple[rules.Rule | None, str]:
        rule, source = super().rule_for(call, module, name)
        if rule is self._gradient:
            return self._split_linear, "DeepLift RevealCancel (linear)"
        if type(rule) is Rescale:
            return self._reveal, "DeepLift RevealCancel"
        if rule is None:
            return rule, source
        if id(rule) not in self._collapsed:
            self._collapsed[id(rule)] = Collapsed(rule, self.pairs)
        return self._collapsed[id(rule)], "DeepLift RevealCancel (" + type(rule).__name__ + ")"

    @staticmethod
    def unwrap(rule: Any) -> Any:
        """The Rescale rule inside a :class:`Collapsed` one."""
        return rule.rule if isinstance(rule, Collapsed) else rule

    def __repr__(self) -> str:
        return f"RevealCancelComposite(pairs={self.pairs})"


