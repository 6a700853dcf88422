"""The module hooks of an explained forward pass: which module issued each op, an activation module of another
library explained as one op on its output, taps on modules' inputs and outputs, and the pass's set-up and
tear-down (hooks on, eval mode, the torch function mode; all undone on exit, also when the forward raises)."""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Self

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode, handle_torch_function, has_torch_function

from relprop._core.kinds import OpKind
from relprop._core.modules import evaluation
from relprop._core.registry import register
from relprop._core.tensors import is_activation
from relprop.engine.calls import OpCall
from relprop.engine.context import ModuleContext
from relprop.engine.tracking import AliasTracker

_current = threading.local()


def _stored(x: Tensor, value: Tensor) -> Tensor:
    """The op of an activation module: its output ``value`` was computed by the module itself from ``x``.

    Called under the session's mode (from the module's forward hook), it reaches the mode as any op does
    (:func:`_activation_op`), so that a plan records and checks it as one. As the op itself, a tensor of its own
    over ``value``'s memory: the node's output gets the node as its ``grad_fn``, and ``value`` is kept among the
    call's arguments, so returning it would close a reference cycle through the autograd graph (node -> call ->
    argument -> node) that Python's garbage collector cannot see.
    """
    if has_torch_function((x, value)):
        return handle_torch_function(_stored, (x, value), x, value)
    return value.detach()


def _activation_op(session: ModuleHooks, func: Callable, args: tuple, kwargs: dict) -> Tensor:
    """An activation module written as several ops (GPT-2's tanh GELU): one elementwise op, identity rule."""
    call = OpCall(OpKind.ELEMENTWISE, func, args, kwargs, type(session.context.module).__name__, session.module_name)
    out = session.run(call)
    session.aliases.set_tag(out, "activation")
    return out


register(_activation_op, [_stored])


class ModuleHooks(TorchFunctionMode):
    """The torch function mode of one pass with its module hooks (:class:`~relprop.engine.Session`'s base)."""

    # set by Session
    context: ModuleContext
    aliases: AliasTracker
    _taps: dict[nn.Module, Any]
    _engine_reads: bool

    def run(self, call: OpCall) -> Any:
        """Run ``call`` as a relevance node (:meth:`Session.run <relprop.engine.Session.run>`)."""
        raise NotImplementedError

    def custom_functions(self, args: tuple | list, module_name: str) -> None:
        """Name custom Functions' outputs after their module (:class:`~relprop.engine.functions.Unruled`)."""
        raise NotImplementedError

    @property
    def module_name(self) -> str:
        """The dotted path of the innermost module whose forward is running."""
        return self.context.module_name

    def _enter_module(self, module: nn.Module, args: Any) -> Any:
        if getattr(_current, "session", None) is not self:
            return None
        self.context.enter(module)
        tapper = self._taps.get(module)
        if tapper is not None and tapper.input:
            return tapper(self, args)
        return None

    def _exit_module(self, module: nn.Module, args: Any, output: Any) -> Any:
        if getattr(_current, "session", None) is not self or not self.context.is_innermost(module):
            return None
        if self.context.end_opaque() and output is not None:
            output = self._activation_module(module, args, output)
        if isinstance(output, Tensor):  # a custom Function's output, named after the module that applied it
            with self._reading():
                self.custom_functions((output,), self.module_name)
        self.context.exit()
        tapper = self._taps.get(module)
        if tapper is not None and not tapper.input and output is not None:
            return tapper(self, output)
        return output

    def _activation_module(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """An activation module written as several ops: one op on its output (:func:`_activation_op`)."""
        x = args[0] if len(args) == 1 else None
        with self._reading():
            if not any(is_activation(a) for a in args):
                return output  # constants in, constant out
            if not (is_activation(x) and isinstance(output, Tensor) and output.shape == x.shape):
                raise RuntimeError(f"relprop: activation module '{self.module_name}' ({type(module).__name__}) must "
                                   "map one tensor to one tensor of the same shape")
            value = output.detach()
        return _stored(x, value)

    @contextmanager
    def _reading(self) -> Iterator[None]:
        """The engine reads tensors in a module hook (flags, autograd nodes): those reads are no ops of the model."""
        self._engine_reads = True
        try:
            yield
        finally:
            self._engine_reads = False

    @contextmanager
    def active(self) -> Iterator[Self]:
        """Hooks, eval mode and the torch function mode for one forward pass; all undone on exit."""
        handles = []
        previous = getattr(_current, "session", None)
        model = next(iter(self.context.names))  # named_modules() yields the model first
        with evaluation(model, "relprop: the model is in training mode; it is explained in eval mode (dropout off, "
                        "BatchNorm running statistics) and put back afterwards"):
            try:
                for module in self.context.names:
                    handles.append(module.register_forward_pre_hook(self._enter_module))
                    handles.append(module.register_forward_hook(self._exit_module, always_call=True))
                _current.session = self
                with self:
                    yield self
            finally:
                _current.session = previous
                self.context.clear()
                for handle in handles:
                    handle.remove()
