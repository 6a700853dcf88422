"""Relevance per unit of activation: rules that are modified gradients, run as gradients.

Every rule of AttnLRP and CP-LRP hands an input relevance of the form
``R_x = x * c``: LRP-0 of a linear map is ``x * VJP(R / z)``, a uniform split
``x * VJP(R / z) / k``, the softmax rule Gradient x Input. Carried as
``G = R / x`` (the *gradient form*) instead of ``R``, the relevance moves
between such ops as a gradient does: LRP-0 is then the op's own VJP of ``G``,
with no ``1 / z``, no ``x * c`` and no kept output or input, and the relevance
of a tensor ``t`` is ``t * G`` wherever it is read (the model's inputs, the
token embeddings). :class:`InGradientForm` runs a rule's gradient form;
:class:`Converted` runs a rule that has none between neighbours that carry
``G`` (``R = out * G`` in, ``G = R / x`` out).
"""
from __future__ import annotations

from typing import Any

from torch import Tensor

from relprop._core.contract import Call
from relprop._core.rule import Reads, Rule
from relprop._core.tensors import per_unit


class _Wrapped(Rule[Call]):
    """A rule seen through another form: what it applies to, fills and is called is the wrapped rule's."""

    zero_for_zero_input = True

    def __init__(self, rule: Rule):
        self.rule = rule
        self.kinds = rule.kinds

    def accepts(self, call: Call) -> bool:
        return self.rule.accepts(call)

    @property
    def fills_zeros(self) -> bool:
        return self.rule.fills_zeros

    def __repr__(self) -> str:
        return repr(self.rule)


def unwrapped(rule: Any) -> Any:
    """The rule a form runs (``rule`` itself where it is no form of another): rules that hold other rules for
    their own purposes (``SmoothStride(rule=...)``) are rules of their own and stay as they are."""
    return rule.rule if isinstance(rule, _Wrapped) else rule


class InGradientForm(_Wrapped):
    """``rule`` in gradient form: ``propagate`` maps ``G`` at the output to ``G`` at each input (``rule.gradient``).

    Every input relevance is then ``x * G``: an input entry of 0 gets none. The guard checks what such a rule
    hands on for NaN and infinities; relevance totals are not at hand, so no conservation is checked.
    """

    prepares = False

    def __init__(self, rule: Rule, reads: Reads):
        super().__init__(rule)
        self.needs_vjp, self.needs_output, self.needs_inputs, self.native, self.held = reads

    def propagate(self, call: Call, relevance: Tensor) -> tuple[Tensor | None, ...]:
        return self.rule.gradient(call, relevance)


class Converted(_Wrapped):
    """``rule``, which has no gradient form, between neighbours in gradient form.

    ``R = out * G`` arrives, ``rule`` propagates it, and each input gets
    ``R_x / x`` (0 where ``x`` is 0: a rule that gives inputs of value 0
    relevance, ``fills_zeros``, is not converted; the engine carries relevance
    itself then). The call keeps its output and inputs as they are (it is run
    as reusable: the rule writes into neither).
    """

    needs_output = True
    needs_inputs = True

    def __init__(self, rule: Rule):
        super().__init__(rule)
        self.needs_vjp = rule.needs_vjp
        self.prepares = rule.prepares

    def prepares_on(self, call: Call) -> bool:
        return self.rule.prepares_on(call)

    def prepare(self, call: Call) -> Tensor | None:
        return self.rule.prepare(call)

    def propagate(self, call: Call, relevance: Tensor) -> tuple[Tensor | None, ...]:
        result = self.rule.propagate(call, relevance * call.output)
        return tuple(None if r is None else per_unit(r, x) for r, x in zip(result, call.inputs))


def in_gradient_form(rule: Rule, call: Call, cache: dict[Any, Rule]) -> Rule:
    """The form of ``rule`` that carries relevance per unit of activation through ``call``.

    ``cache`` holds one wrapper per rule and what it reads, so that op calls share them (the wrapper keeps the
    rule alive, so that its id stays its own).
    """
    if isinstance(rule, _Wrapped):  # a merged BatchNorm takes its producer's rule
        rule = rule.rule
    reads = rule.gradient_reads(call)
    if reads is not None and reads.vjp and call.vjp_reads_inputs:
        reads = reads._replace(inputs=True)
    key = (id(rule), reads)
    wrapper = cache.get(key)
    if wrapper is None:
        wrapper = cache[key] = InGradientForm(rule, reads) if reads is not None else Converted(rule)
    return wrapper
