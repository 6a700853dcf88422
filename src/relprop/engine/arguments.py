"""An op's arguments as a rule sees them: the activations among them, the rest as constants, and the op called
again with other values in the activations' places."""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from relprop._core.tensors import holds_activation, is_activation, positional_activations


class Arguments:
    """The arguments of one op call (:class:`~relprop.engine.OpCall`'s base): its activation inputs, detached, and
    everything else as it was given.

    Parameters
    ----------
    func : callable
        The torch function called.
    args, kwargs :
        Its arguments. Tensors that require grad are the activation inputs, everything else is a constant.
    """

    def __init__(self, func: Callable, args: tuple, kwargs: dict):
        self.func = func
        self._bind(args, kwargs)

    def _bind(self, args: tuple, kwargs: dict) -> None:
        """Take ``args`` and ``kwargs`` as the op's arguments: its activations become :attr:`inputs`."""
        leaves, slots = positional_activations(args)
        self._spec: TreeSpec | None = None
        self._constants: dict = kwargs
        if slots is None or (kwargs and holds_activation(kwargs)):
            leaves, self._spec = tree_flatten((args, kwargs))
            self._constants = {}
            slots = [i for i, leaf in enumerate(leaves) if is_activation(leaf)]
        # else the common case, activations among the positional arguments only: no pytree needed
        self._slots = slots
        self._outer: tuple[Tensor, ...] | None = tuple([leaves[i] for i in slots])
        inputs = []
        for slot, x in zip(slots, self._outer):
            leaves[slot] = value = x.detach()
            inputs.append(value)
        #: the op's activation arguments, detached, in the order of the call's arguments
        self.inputs: tuple[Tensor, ...] = tuple(inputs)
        self._leaves = leaves

    @property
    def slots(self) -> list[int] | None:
        """The positions of the activations among the positional arguments; None where a container holds one."""
        return self._slots if self._spec is None else None

    def arguments_of(self) -> tuple[tuple, dict]:
        """The arguments the call was made with (its activations as the model's tensors), while it holds them."""
        leaves = list(self._leaves)
        for slot, x in zip(self._slots, self.activations):
            leaves[slot] = x
        if self._spec is None:
            return tuple(leaves), self._constants
        return tree_unflatten(leaves, self._spec)

    @property
    def activations(self) -> tuple[Tensor, ...]:
        """The activation inputs as the outer autograd graph knows them (until :meth:`release`)."""
        if self._outer is None:
            raise RuntimeError("relprop: the op call no longer holds the model's tensors")
        return self._outer

    def release(self) -> None:
        """Drop the model's own tensors once the node exists: the backward pass needs only detached values.

        Keeping them would close a reference cycle through the autograd graph
        (node -> call -> input -> its later in-place op -> node) that Python's
        garbage collector cannot see.
        """
        self._outer = None

    def call_with(self, func: Callable, inputs: Sequence[Tensor]) -> Tensor:
        leaves = list(self._leaves)
        for slot, value in zip(self._slots, inputs):
            leaves[slot] = value
        if self._spec is None:
            return func(*leaves, **self._constants)
        args, kwargs = tree_unflatten(leaves, self._spec)
        return func(*args, **kwargs)

    @property
    def arguments(self) -> dict[str, Any] | None:
        """The op's arguments other than its activation inputs, by the names its torch function gives them.

        Bound to the function's signature with its defaults filled in
        (``kernel_size``, ``stride``, ... of ``F.max_pool2d``); None where the
        function has no signature to bind to, or the activations are nested in
        containers (no single input to replace).
        """
        if self._spec is not None:
            return None
        # F.max_pool2d and kin dispatch on return_indices between two functions of one signature
        func = torch._jit_internal.boolean_dispatched.get(self.func, {}).get("if_false", self.func)
        try:
            bound = inspect.signature(func).bind(*self._leaves, **self._constants)
        except (TypeError, ValueError):  # a builtin without a signature, or arguments it does not take
            return None
        bound.apply_defaults()
        return {name: value for name, value in bound.arguments.items() if not any(value is x for x in self.inputs)}
