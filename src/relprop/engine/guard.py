"""The guard: each backward pass checked for relevance that is NaN, created, dropped or not accounted for.

Each op's totals are kept as tensors while the relevance passes (:meth:`Guard._observe`) and read together
once the pass ends, one synchronisation per backward pass: the relevance each op hands on, what arrived,
and, where its rule conserves, what arrived summed in absolute value. The whole pass is accounted for too:
the seed against the relevance of the inputs plus what the ops absorbed (:meth:`Guard.check_pass`), and what the
stabilisers changed of the total against the seed (:data:`STABILISER_BOUND`).
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from relprop._core.errors import ConservationWarning, UnsupportedOpError
from relprop._core.rule import Pass, Rule
from relprop._core.tensors import rounding
from relprop.engine.calls import OpCall

#: how far the relevance an op hands on may exceed the relevance arriving (its absolute values summed) before a
#: rule that conserves is reported. A conservative rule with a stabiliser hands on sum_k R_k z_k / (z_k + eps),
#: never more than sum_k |R_k|: any excess is relevance created, and no stabiliser can cause it
CONSERVATION_MARGIN = 1e-2
#: how far the stabilisers of a pass may move its relevance total, as a multiple of the seed's absolute total, before
#: the pass is reported. A stabiliser shrinks each neuron's relevance towards 0 (by ``eps / (|z| + eps)``), so where
#: relevance does not cancel, the stabilisers of all ops together absorb at most the whole seed, of its sign. They
#: move the total further only where relevance of both signs nearly cancels and they shrink the two parts by
#: different factors: that creates relevance, of either sign. Counted are the ops whose rule conserves but for its
#: stabiliser (no bias takes a share there), down to the first rule that gives inputs of value 0 relevance (Flat,
#: WSquare, ZBox); biases and the other non-conserving rules move the total by design
STABILISER_BOUND = 1.0


def _exact(rule: Rule) -> bool:
    """Whether ``rule``, where it conserves, conserves exactly: it has no stabiliser (``epsilon = 0``), or is Pass."""
    return isinstance(rule, Pass) or getattr(rule, "epsilon", getattr(rule, "stabilizer", None)) == 0



class Guard:
    """The guard's part of a :class:`~relprop.engine.Session`: totals kept per op, checked once per pass."""

    strict: bool
    guard: bool
    audit: Callable[..., None] | None
    unhandled: list[str]
    #: whether what flows backward is relevance, whose total the ops account for (:meth:`check_pass`); DeepLift's
    #: multipliers are not
    accounts = True
    #: per op reached in the backward pass: the call, the relevance it handed on, the relevance that arrived
    #: and, if its rule conserves, that summed in absolute value; checked together once the pass ends
    _totals: list[tuple[Any, Tensor, Tensor, Tensor | None]]
    #: whether the caller checks the totals with the seed and the inputs' relevance (:meth:`check_pass`)
    _deferred: bool

    def _observe(self, call: Any, relevance: Tensor, result: tuple[Tensor | None, ...]) -> None:
        """After ``call`` propagated ``relevance``: the audit, if any, and the guard's totals.

        An op that hands on the very relevance that arrived (an activation's Pass) has nothing to check.
        """
        if self.audit is not None:
            self.audit(call, relevance, result)
        handed = [r for r in result if r is not None]
        if handed and all(r is relevance for r in handed):
            return
        if not self._totals and not self._deferred:  # the first op of this backward pass: check all when it ends
            torch.autograd.Variable._execution_engine.queue_callback(self._check)
        total = handed[0].sum() if handed else relevance.new_zeros(())  # nothing handed on: all absorbed
        for r in handed[1:]:  # one addition per further input: fewer ops than stacking their sums
            total = total + r.sum()
        # the relevance arriving, and for a rule that conserves its absolute sum: such a rule never hands on more
        arrived = relevance.sum()
        mass = relevance.abs().sum() if call.rule.conserves(call) else None  # faster than vector_norm(r, 1) on CPU
        # kept as tensors and read once at the end: one synchronisation per backward pass on a GPU, not one per op
        self._totals.append((call, total, arrived, mass))

    def defer_check(self) -> None:
        """The caller of the next backward pass checks its totals, with the seed and the inputs (:meth:`check_pass`)."""
        self._deferred = True

    def check_pass(self, seed: Tensor, relevance: list[Tensor]) -> None:
        """After a backward pass from ``seed`` gave the inputs ``relevance``: the per-op checks and the account.

        The relevance that reached the inputs plus what the ops absorbed is the seed, up to rounding, when every op
        that changes the total is an op relprop sees (routing ops move relevance as it is); anything else is
        relevance created or lost out of sight, reported (:meth:`_check`).
        """
        self._deferred = False
        totals = [seed.sum(), seed.abs().sum(), *(r.sum() for r in relevance)] if self.guard and self.accounts else None
        self._check(totals)

    def _check(self, account: list[Tensor] | None = None) -> None:
        """Report the ops of the backward pass that made NaN or infinite relevance, or created relevance.

        Also, among the ops whose rule conserves with no stabiliser, those whose relevance handed on differs from
        what arrived beyond rounding (the largest imbalances first); and, with ``account`` (the seed's total and
        the inputs' totals), relevance that no op's rule accounts for, and stabilisers that moved the total by more
        than :data:`STABILISER_BOUND` times the seed (:meth:`_check_stabilisers`).
        """
        entries, self._totals = self._totals, []
        if not entries and not account:
            return
        values = [value for _, total, arrived, mass in entries for value in (total, arrived, mass)
                  if value is not None] + (account or [])
        dtypes = {value.dtype for value in values}
        if len(dtypes) > 1:
            values = [value.double() for value in values]
        numbers = iter(torch.stack(values).tolist())
        # rounding: sums of relevance differ from their exact value by about eps * sqrt(n) relative to the mass
        tolerance = max(math.sqrt(torch.finfo(d).eps) for d in dtypes if d.is_floating_point or d.is_complex)
        first_infinite = True
        absorbed = scale = 0.0
        imbalanced: list[tuple[float, Any, str]] = []
        stabilised: list[tuple[float, Any]] = []  # what each op whose rule conserves but for its stabiliser absorbed
        fills = False  # whether a rule gave relevance to inputs of value 0: some may be padding, where it is lost
        for call, _, _, mass in entries:  # in the order the relevance reached them
            fills = fills or call.rule.fills_zeros
            total, arrived = next(numbers), next(numbers)
            bound = next(numbers) if mass is not None else math.inf
            absorbed += arrived - total
            # below a rule that gives inputs of value 0 relevance, outputs of value 0 receive some, and the
            # stabiliser takes it whole, as it should: those ops' stabilisers are not held to the bound
            if mass is not None and not _exact(call.rule) and not fills:
                stabilised.append((arrived - total, call))
            scale += abs(total) + (bound if mass is not None else abs(arrived))
            if not math.isfinite(total):
                if first_infinite:  # the ops after it only pass it on
                    self.report_rule(call, "hands on NaN or infinite relevance (the first op that does)")
                first_infinite = False
            elif abs(total) > (1 + CONSERVATION_MARGIN) * bound + 1e-12:
                self.report_rule(call, f"created relevance: it handed on {total:.6g}, more than the {bound:.6g} "
                                       "that arrived (in absolute value)")
            elif total == 0 and 0 < bound < math.inf:
                self.report_rule(call, f"dropped all the relevance that arrived ({bound:.6g} in absolute value)")
            elif mass is not None and _exact(call.rule) and abs(arrived - total) > tolerance * bound:
                imbalanced.append((abs(arrived - total), call, f"handed on {total:.6g} of the {arrived:.6g} that "
                                   f"arrived ({bound:.6g} in absolute value), though its rule conserves exactly"))
        for _, call, problem in sorted(imbalanced, key=lambda item: -item[0])[:3]:  # the largest imbalances
            self.report_rule(call, problem)
        if account is None or not first_infinite:
            return
        seed, seed_mass, *inputs = (next(numbers) for _ in account)
        self._check_stabilisers(stabilised, seed, seed_mass, sum(inputs))
        if fills:
            return
        unaccounted = seed - sum(inputs) - absorbed
        scale += abs(seed) + sum(abs(r) for r in inputs)
        # relevance may cross casts to float32 between the ops (Llama-like models compute RMSNorm, RoPE and the
        # softmax in float32): no less than float32's rounding
        if abs(unaccounted) > max(tolerance, rounding(torch.float32)) * scale:
            self.report_pass(f"relprop: {unaccounted:.6g} of the relevance is not accounted for: the seed totals "
                             f"{seed:.6g}, the inputs got {sum(inputs):.6g} and the ops absorbed {absorbed:.6g}; "
                             "relevance was created or lost by an op relprop does not see (an autograd op outside "
                             "the engine's ops), a bug to report")

    def _check_stabilisers(self, stabilised: list[tuple[float, Any]], seed: float, seed_mass: float,
                           inputs: float) -> None:
        """Report stabilisers that moved the total by more than :data:`STABILISER_BOUND` times the seed.

        ``stabilised``: what each op whose rule conserves but for its stabiliser absorbed, with its call;
        ``seed_mass``: the seed summed in absolute value (over a batch whose logits differ in sign, the seed's
        total may be near 0); ``inputs``: the inputs' relevance total. The ops named are those that moved the
        total most in the direction the stabilisers moved it together.
        """
        moved = -sum(absorbed for absorbed, _ in stabilised)
        if not abs(moved) > STABILISER_BOUND * seed_mass:  # also False for NaN
            return
        movers = sorted(((-absorbed, call) for absorbed, call in stabilised if -absorbed * moved > 0),
                        key=lambda item: -abs(item[0]))
        by_rule: dict[str, list[str]] = {}  # the ops that moved it most, grouped by their rule
        for change, call in movers[:3]:
            op = f"'{call.module_name or '<root>'}' ({call.name}, {change:+.3g})"
            by_rule.setdefault(repr(call.rule), []).append(op)
        where = " and ".join(f"of {rule} at {', '.join(ops)}" for rule, ops in by_rule.items())
        others = f" (and {len(movers) - 3} more ops)" if len(movers) > 3 else ""
        self.report_pass(
            f"relprop: the stabilisers {where}{others} changed the relevance total by {moved:.3g} for a seed of "
            f"{seed:.3g}, more than {STABILISER_BOUND:g} times the seed's absolute total ({seed_mass:.3g}); the "
            f"inputs got {inputs:.3g} in all. Relevance of both signs nearly cancels there, and a stabiliser shrinks "
            "the two parts by different factors, which creates relevance: use a larger epsilon or a conserving rule "
            "there (Epsilon(0.0) conserves exactly)")

    def report_pass(self, message: str) -> None:
        """The relevance of a whole backward pass cannot be right: warn once (raise in strict mode)."""
        if self.strict:
            raise UnsupportedOpError(message)
        if message not in self.unhandled:
            self.unhandled.append(message)
            warnings.warn(message, ConservationWarning, stacklevel=2)

    def report_rule(self, call: OpCall, problem: str) -> None:
        """A rule's relevance cannot be right: warn once per op (raise in strict mode)."""
        message = f"relprop: {call.describe()} with rule {call.rule!r} {problem}"
        if self.strict:
            raise UnsupportedOpError(message)
        if message not in self.unhandled:
            self.unhandled.append(message)
            warnings.warn(message, ConservationWarning, stacklevel=2)

