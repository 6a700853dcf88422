"""Alias and in-place tracking for one attribution forward pass (docs/design.md, section 7).

An :class:`AliasTracker` knows, for the activations of the pass, which op call produced each one, what each one
is (its tag: a gate, a statistic, attention weights), which op calls read which memory, and which outputs an
in-place ReLU overwrote. Op families (:mod:`relprop.ops`) ask it before and after an op writes into an
activation, so that every rule still reads the values it needs when the relevance comes."""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from relprop._core.tensors import is_alias_of, storage_address
from relprop.engine.calls import OpCall
from relprop.engine.zeros import ZeroedEntries

__all__ = ["AliasTracker", "aliases", "KEEPS_NONZERO"]

#: in-place ops that leave every nonzero entry as it was: the ReLUs (see :meth:`AliasTracker.before_in_place`)
KEEPS_NONZERO = frozenset({F.relu, F.relu_, torch.relu_, Tensor.relu_})
#: ReLUs, in place or not: their outputs are >= 0
_RELU = KEEPS_NONZERO | {torch.relu, Tensor.relu}


def aliases(value: Any, target: Tensor) -> bool:
    """Whether ``value`` is a tensor in ``target``'s memory (``target`` itself, or a view of it)."""
    # not by their storage objects: made once, one lives as long as the memory (see relprop.engine.memory._storage_count)
    return isinstance(value, Tensor) and is_alias_of(value, target)


class AliasTracker(ZeroedEntries):
    """Producers, tags, readers and in-place overwrites of the activations of one forward pass.

    Tables hold tensors weakly: an activation the model drops is forgotten with it.
    """

    # every op asks whether a table is empty: by its dict of weak references (``.data``), as the table's own
    # ``__len__`` costs a Python call; a table whose keys all died but are not yet removed then counts as non-empty,
    # and its lookups find nothing

    def __init__(self) -> None:
        super().__init__()
        #: output tensor -> the op call that produced it
        self._producers: WeakIdKeyDictionary = WeakIdKeyDictionary()
        #: tensors tagged with what produced them ("sigmoid", "activation", "statistic", "softmax", "exp")
        self._tags: WeakIdKeyDictionary = WeakIdKeyDictionary()
        #: attention written out, on its way: scores ``q @ k_t`` (scaled, masked) and their softmax -> what they were
        #: computed from (``relprop.ops.attention.EagerScores``)
        self._scores: WeakIdKeyDictionary = WeakIdKeyDictionary()
        #: address of an input's memory -> the op calls that read it (see :meth:`before_write`)
        self._readers: dict[int, list[weakref.ref[OpCall]]] = {}

    # ------------------------------------------------------------ producers and tags

    def producer(self, x: Any) -> OpCall | None:
        """The op call that produced ``x`` (as it is now: an op that overwrote it in place takes over)."""
        return self._producers.get(x)

    def relu_output(self, x: Tensor) -> bool:
        """Whether ``x`` is the output of a ReLU, as it left it: every entry ``>= 0``."""
        producer = self._producers.get(x)
        return producer is not None and producer.func in _RELU

    def tag(self, x: Any) -> str | None:
        """What produced ``x`` (``"sigmoid"``, ``"softmax"``, ...), if it is tagged."""
        return self._tags.get(x) if self._tags.data else None

    def set_tag(self, out: Any, tag: str | None) -> None:
        """Tag ``out`` (a tensor, or the tensors of a ``chunk``/``split`` result); None removes a tensor's tag."""
        if isinstance(out, Tensor):
            if tag is None:
                self._tags.pop(out, None)
            elif out.requires_grad:
                self._tags[out] = tag
        elif isinstance(out, (tuple, list)):  # named tuples too: topk's values stay gates (a MoE router's weights)
            for value in out:
                self.set_tag(value, tag)

    def scores(self, x: Any) -> Any:
        """What the attention scores or weights ``x`` were computed from, if it is known (else None)."""
        entry = self._scores.get(x) if self._scores.data and isinstance(x, Tensor) else None
        # written into since (in place, or through a view: they share the version counter): no longer what was noted
        return entry[0] if entry is not None and entry[1] == x._version else None

    def set_scores(self, out: Any, scores: Any) -> None:
        """``out`` holds attention scores or weights computed from ``scores`` (as long as nothing writes into it)."""
        if isinstance(out, Tensor) and out.requires_grad:
            self._scores[out] = (scores, out._version)

    def routed(self, args: tuple, kwargs: dict, out: Any) -> None:
        """``out`` was routed from ``args`` (reshaped, indexed, cast): it keeps the first argument's tag (a
        reshaped gate is a gate), and entries an in-place ReLU set to 0 keep their meaning wherever they go."""
        # each lookup in a weak table makes a weak reference: none while the table is empty (CNNs have no tags)
        if self._tags.data and args and isinstance(args[0], Tensor) and (tag := self._tags.get(args[0])) is not None:
            self.set_tag(out, tag)
        if self._zeroed.data:
            self.carry_zeros(self.zeroed_in((*args, *kwargs.values())), out)

    def recorded(self, call: OpCall, out: Tensor) -> None:
        """``call`` ran and produced ``out``: it is ``out``'s producer and a reader of its inputs' memory (if it
        keeps them: a call that keeps their shapes alone reads no memory)."""
        self._producers[out] = call
        if not call.keeps_inputs:
            return
        reader = weakref.ref(call)
        for x in call.inputs:
            self._readers.setdefault(storage_address(x), []).append(reader)

    def rectified(self, call: OpCall, out: Tensor) -> None:
        """``call`` ran as plain autograd (no relevance node) and produced ``out``: where it is a ReLU, ``out`` is
        known to be ``>= 0`` (:meth:`relu_output`), as for a recorded ReLU."""
        if call.func in _RELU:
            self._producers[out] = call

    def alias(self, out: Tensor, of: Tensor) -> None:
        """``out`` stands for ``of`` (a tap node on it): it has ``of``'s producer."""
        producer = self._producers.get(of)
        if producer is not None:
            self._producers[out] = producer

    # ------------------------------------------------------------ writes in place

    def overwritten(self, tensor: Tensor, result: Tensor | None = None) -> Tensor:
        """``tensor`` was modified in place: it takes ``result``'s producer and tag, or loses its own.

        Else a BatchNorm after ``conv -> bn -> relu_`` would be merged into the
        convolution across the ReLU.
        """
        for table in (self._producers, self._tags, self._zeroed, self._scores):
            if result is not None and result in table:
                table[tensor] = table[result]
            elif tensor in table:
                del table[tensor]
        return tensor

    def protect(self, tensor: Any, copy: Tensor | None = None) -> None:
        """Before ``tensor`` is modified in place, let the call that produced it keep what it needs.

        ``copy``, a copy of ``tensor`` that nothing will modify, serves instead of one of its own. The calls
        that read ``tensor`` keep copies of what they read (:meth:`before_write`).
        """
        if not isinstance(tensor, Tensor):
            return
        call = self._producers.get(tensor)
        if call is not None:
            call.protect(copy)
        self._written_through(tensor, call)
        self.before_write(tensor)

    def escaped(self, tensor: Tensor) -> None:
        """``tensor``'s memory was handed to code the engine does not follow (``tensor.data``), which may write
        into it unseen and without a version bump: it is protected as before a write, and taken for written."""
        self.protect(tensor)
        self.overwritten(tensor)

    def _written_through(self, view: Tensor, producer: OpCall | None) -> None:
        """``view`` is about to be written into: where it is a view of another tensor, the memory of that tensor
        changes too. Its producer keeps what it needs, and it is no longer what its producer computed (no
        ReLU's output for the kernels, no convolution's for a BatchNorm to merge into)."""
        base = view._base
        if base is None:
            return
        owner = self._producers.get(base)
        if owner is not None and owner is not producer:
            owner.protect()
        self.overwritten(base)

    def before_write(self, target: Tensor) -> None:
        """``target``, an activation, is about to be overwritten in place: the ops that read it keep copies."""
        for reader in self._readers.pop(storage_address(target), ()):
            call = reader()
            if call is not None:
                call.keep_inputs_from(target)

    def before_in_place(self, func: Callable, target: Tensor) -> None:
        """Let the op that produced ``target`` keep what it needs before ``func`` overwrites it in place.

        An in-place ReLU needs nothing kept: it changes only entries it sets to 0,
        and relevance there is 0 where the ops that read them give relevance in
        proportion to their inputs' values, so the producer may read ``relu(z)``
        for ``z`` later. This saves one copy of every activation a ReLU
        overwrites. Where a later op may give relevance to those entries, the
        producer computes ``z`` again (:meth:`follow_zeros`).
        """
        if func not in KEEPS_NONZERO or target._base is not None:  # through a view: a write into another tensor
            self.protect(target)
            return
        call = self._producers.get(target)
        if call is not None:
            call.detach_graph()
        self.before_write(target)

    def in_place_relu(self, call: OpCall) -> OpCall | None:
        """``call`` runs in place on its one input: the producer it overwrites, marked if ``call`` is a ReLU.

        A ReLU leaves the producer reading ``relu(z)`` in place of its output ``z``: its output is ``>= 0`` now.
        """
        target = call.activations[0]
        overwrites = self._producers.get(target)
        call.run_in_place(overwrites)
        if overwrites is not None and call.func in KEEPS_NONZERO and aliases(overwrites.kept_output, target):
            overwrites.zeroed_in_place()
            return overwrites
        return None
