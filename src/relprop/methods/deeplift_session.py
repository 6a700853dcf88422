"""The session of a DeepLift pass: input and baseline run as one batch of pairs, with the ops whose handling in the
engine is not exact for differences run as DeepLift needs them (extrema, casts, writes in place under
RevealCancel), and the explainer that runs it."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from relprop._core.kinds import OpKind
from relprop._core.registry import op_name
from relprop._core.signatures import bind
from relprop._core.tensors import is_activation
from relprop.engine.calls import OpCall
from relprop.engine.nodes import write_into
from relprop.engine.session import Session
from relprop.engine.tracking import AliasTracker
from relprop.methods.attribution import LRP
from relprop.methods.deeplift_reveal import RevealCancelComposite, Splits
from relprop.methods.deeplift_rules import _NORMS, VectorNormRescale
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


class DeepLiftSession(Session):
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


class DeepLiftLRP(LRP):
    session_class = DeepLiftSession

    @contextmanager
    def _session(self, taps: Any = None, audit: Any = None, token_inputs: tuple[Tensor, ...] = (),
                 reusable: bool = False, gradient_form: bool = False) -> Iterator[Session]:
        with super()._session(taps, audit, token_inputs, reusable, gradient_form) as session:
            self.last_session: DeepLiftSession = session  # type: ignore[assignment]
            yield session


# ---------------------------------------------------------------- the joint pass
