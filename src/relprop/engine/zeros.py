"""Entries an in-place ReLU set to 0 (design notes, section 7): the op calls whose output such a ReLU overwrote in
place read ``relu(z)`` for ``z``, until an op that may give relevance to those entries needs the true output."""
from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from relprop._core.kinds import OpKind
from relprop._core.rule import Pass, Rule
from relprop.engine.calls import OpCall


def maps_zero_to_zero(call: OpCall) -> bool:
    """Whether ``call`` is an elementwise op that, with its constants, maps 0 to 0 (entry by entry)."""
    if call.kind != OpKind.ELEMENTWISE:
        return False
    (x,) = call.inputs
    return bool((call.call_with(call.func, (x.new_zeros((1,) * x.dim()),)) == 0).all())


class ZeroedEntries:
    """Which activations hold entries an in-place ReLU set to 0, and in whose outputs
    (:class:`~relprop.engine.AliasTracker`'s base)."""

    def __init__(self) -> None:
        #: tensor -> the op calls whose output an in-place ReLU set to 0 in entries the tensor holds: they read
        #: ``relu(z)`` for ``z`` unless a later op may give relevance to those entries (:meth:`follow_zeros`)
        self._zeroed: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def zeroed_by(self, out: Tensor, overwritten: OpCall) -> None:
        """An in-place ReLU made ``out`` from ``overwritten``'s output, setting entries to 0."""
        self._zeroed[out] = (*self._zeroed.get(out, ()), overwritten)

    def zeroed_for(self, call: OpCall, rule: Rule | None) -> tuple[OpCall, ...]:
        """The calls whose entries an in-place ReLU set to 0 among ``call``'s inputs, of interest to ``rule``.

        None of interest where ``rule`` gives inputs that are 0 no relevance (``zero_for_zero_input``); a rule
        None (winner-take-all) routes relevance and is asked.
        """
        if not self._zeroed.data or getattr(rule, "zero_for_zero_input", False):
            return ()
        return self.zeroed_in(call.activations)

    def zeroed_in(self, values: Any) -> tuple[OpCall, ...]:
        """The op calls whose output an in-place ReLU set to 0 in entries that ``values`` (tensors, lists) hold."""
        if not self._zeroed.data:
            return ()
        found = []
        for value in values:
            if isinstance(value, Tensor):
                found.extend(self._zeroed.get(value, ()))
            elif isinstance(value, (list, tuple)):
                found.extend(self.zeroed_in(value))
        return tuple(found)

    def carry_zeros(self, zeroed: tuple[OpCall, ...], out: Any) -> None:
        """``out`` holds entries of tensors in which those of ``zeroed`` calls' outputs were set to 0."""
        if not zeroed:
            return
        for value in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(value, Tensor) and value.requires_grad:
                self._zeroed[value] = zeroed

    def follow_zeros(self, call: OpCall, rule: Rule, zeroed: tuple[OpCall, ...], out: Tensor) -> None:
        """``call`` reads entries that an in-place ReLU set to 0 in the outputs of ``zeroed`` calls.

        ``call``'s rule may give relevance to inputs that are 0 (it is not
        :attr:`~relprop.rules.Rule.zero_for_zero_input`), or pass it through an
        op that maps 0 to something else (``sigmoid``): then the ``zeroed``
        calls need their true output back. An elementwise op that maps 0 to 0
        and passes relevance through leaves the question to the ops that read
        its output.
        """
        if type(rule) is Pass and maps_zero_to_zero(call):
            self.carry_zeros(zeroed, out)
            return
        for producer in zeroed:
            producer.restore_output()
