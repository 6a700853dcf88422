"""What an op call keeps of the forward pass, and how it stays right where the model writes in place: copies of
inputs before they are overwritten, its autograd graph built anew, the output handed to a rule to write into once
nothing else references its memory, stand-ins of the inputs' shapes where the rule reads no more."""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from relprop._core.kinds import OpKind
from relprop._core.tensors import is_alias_of, storage_address, storage_use_count
from relprop.engine.arguments import Arguments


def _storage_count(tensor: Tensor) -> int:
    """References to ``tensor``'s memory: from tensors (views and aliases included) and from storage objects.

    It asks by address: ``tensor.untyped_storage()`` would make a storage
    object that lives as long as the memory and counts as a reference, and
    autograd then adds every gradient that arrives after a relevance in that
    memory into a new tensor instead of into it.
    """
    assert storage_use_count is not None  # see _lone_storage_count
    return storage_use_count(storage_address(tensor))


@functools.cache
def _lone_storage_count() -> int | None:
    """:func:`_storage_count` of a tensor that nothing else references, as this PyTorch version counts it.

    None if PyTorch does not expose the count of a storage's references.
    """
    if storage_use_count is None:
        return None
    return _storage_count(torch.empty(1))


#: op kinds whose autograd backward saves inputs and parameters only, never the op's output (a ``tanh``, a softmax
#: or a fused attention saves its output)
_SAVES_NO_OUTPUT = frozenset({OpKind.CONV, OpKind.DENSE, OpKind.BATCHNORM, OpKind.SUM, OpKind.NORM, OpKind.PRODUCT,
                              OpKind.MAXPOOL})


class CallMemory(Arguments):
    """The memory of one op call (:class:`~relprop.engine.OpCall`'s base): what it keeps, copies and frees."""

    # set by OpCall
    kind: OpKind
    in_place: bool
    overwrites: CallMemory | None
    reusable: bool
    finished: bool
    versions: tuple[int, ...]
    output_nonnegative: bool
    _linearised: Callable
    _graph: tuple[list[Tensor], Tensor] | None
    _output: Tensor | None
    _restore: bool

    def describe(self) -> str:
        """The op and its module, for messages (:meth:`OpCall.describe <relprop.engine.OpCall.describe>`)."""
        raise NotImplementedError

    def keep_inputs_from(self, target: Tensor) -> None:
        """Before ``target`` is overwritten in place: the inputs in its memory become copies, for the rule to read.

        Plain autograd allows ``y = a + 1; a[0] = 0`` as long as no op saved
        ``a``; every rule here reads its inputs, so each op that read ``a``
        keeps a copy instead (:meth:`check_inputs` raises otherwise). An op
        run in place on ``target`` itself reads only the shape of its input.
        """
        if self.finished:  # the backward pass went through this op already
            return
        kept = [i for i, x in enumerate(self.inputs)
                if is_alias_of(x, target)
                and not (self.in_place and i == 0)]
        if not kept:
            return
        inputs = list(self.inputs)
        for i in kept:
            inputs[i] = inputs[i].clone()
            self._leaves[self._slots[i]] = inputs[i]
        self.inputs = tuple(inputs)
        self.versions = tuple(x._version for x in inputs)
        if self._graph is not None:  # it may have saved the old memory (a product saves its factors)
            self._build_graph()

    def detach_graph(self) -> None:
        """Before the output is modified in place: the kept autograd graph built anew if it may have saved it.

        The output is the kept graph's own output, and the backward of an
        elementwise op (``tanh``, ``sigmoid``, ``exp``), a softmax or an
        attention saves it; linear ops save only their inputs.
        """
        if self._graph is not None and self._linearised is self.func and self.kind not in _SAVES_NO_OUTPUT:
            self._build_graph()

    def _build_graph(self) -> None:
        """The op's private autograd graph, built (or built again) on :attr:`~relprop.engine.OpCall.inputs`."""
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in self.inputs]
            self._graph = (leaves, self.call_with(self._linearised, leaves))

    def check_inputs(self) -> None:
        """Raise if an input was modified in place after the op read it: the rule would read the new values.

        Plain autograd refuses the same for ops that save their input; every
        rule reads its inputs. An op run in place overwrote its own input, and
        its rule reads only the shape.
        """
        for index, (x, version) in enumerate(zip(self.inputs, self.versions)):
            if x._version != version and not (self.in_place and index == 0):
                raise RuntimeError(f"relprop: input {index} of {self.describe()} was modified in place after the op "
                                   "read it, so its relevance cannot be computed; modify a copy instead "
                                   "(x = x.clone()) or use the out-of-place op")

    def run_in_place(self, overwrites: CallMemory | None) -> None:
        """Run the op in place on its one activation input, whose producer ``overwrites`` still reads that memory.

        Only for a rule that reads nothing but the input's shape (see ``relprop.ops.inplace._in_place_pass``).
        """
        self.in_place = True
        self.overwrites = overwrites

    def zeroed_in_place(self) -> None:
        """An in-place ReLU overwrote the output in its memory: it holds ``relu(z) >= 0``
        (see :meth:`restore_output`)."""
        self.output_nonnegative = True

    def take_output(self) -> Tensor | None:
        """:attr:`output` for the rule to write into, if no other tensor shares its memory; else None.

        By the time the relevance reaches an op, every op that read its output
        has passed the relevance on and freed its inputs; if the model, the
        user or a hook kept no tensor in the same memory either, nothing can
        read it any more, and the rule may write into it instead of into a
        new tensor of the same size. The call then drops its own reference,
        so the memory is freed as soon as the rule is done with it. The check
        counts the references to the memory (views, aliases and storage
        objects included); where PyTorch does not expose the count, the answer
        is None.
        """
        lone = _lone_storage_count()
        output = self._output
        if self.reusable:  # the next backward pass reads it again
            return None
        if output is None or lone is None or _storage_count(output) != lone:
            return None
        self._output = None
        return output

    def restore_output(self) -> None:
        """Have the rule read the true output after all, though an in-place ReLU overwrote it (see ``ops``).

        An op that reads the ReLU's output may give relevance to the entries
        the ReLU set to 0 (its rule is not :attr:`~relprop.rules.Rule.zero_for_zero_input`),
        so ``relu(z)`` no longer serves for ``z`` there: the output is computed
        again from the inputs before the rule prepares (again, if it already has).
        """
        self._restore = True

    def recompute(self) -> Tensor:
        """The output computed again from :attr:`~relprop.engine.OpCall.inputs`."""
        inputs = (self.inputs[0].clone(), *self.inputs[1:]) if self.in_place else self.inputs
        with torch.no_grad():
            return self.call_with(self.func, inputs)

    @property
    def keeps_inputs(self) -> bool:
        """Whether :attr:`~relprop.engine.OpCall.inputs` hold the inputs' values (not stand-ins of their shapes)."""
        return not any(x.is_meta for x in self.inputs)

    def keep_input_shapes(self) -> None:
        """Hold meta stand-ins of the inputs' shapes and dtypes, for a rule that reads no more (``needs_inputs``).

        The inputs' memory is freed once nothing else holds it; no later write into it concerns this call.
        """
        inputs = tuple([torch.empty_like(x, device="meta") for x in self.inputs])
        for slot, x in zip(self._slots, inputs):
            self._leaves[slot] = x
        self.inputs = inputs
        self.versions = ()
