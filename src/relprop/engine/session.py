"""The interception engine: one attribution forward pass under a torch function mode.

A :class:`Session` is a :class:`torch.overrides.TorchFunctionMode` that is
entered only for the forward pass being explained. Every torch function the
model calls reaches :meth:`Session.__torch_function__`, which hands it to its
op family (:mod:`relprop.ops`). Forward pre/post hooks, placed on the
model's modules for the duration of the pass, keep a :class:`ModuleContext`
that tells which module issued each op, so rules can be chosen per module. On
exit every hook is removed and every module's training flag is as before,
also when the forward raises. What the pass knows about its activations
(producers, tags, readers, in-place overwrites) lives in one
:class:`~relprop.engine.AliasTracker`; handlers see the session through the
:class:`~relprop.ops.OpHost` protocol."""
from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from relprop._core.contract import Call
from relprop._core.errors import ConservationWarning, RuleError, UnhandledOpWarning, UnsupportedOpError
from relprop._core.kinds import OpKind
from relprop._core.registry import ALWAYS_HANDLED, HANDLERS, op_name, resolve
from relprop._core.rule import Gradient, Rule
from relprop._core.tensors import has_activation, has_parameter, is_activation
from relprop.engine.calls import OpCall
from relprop.engine.context import ModuleContext
from relprop.engine.nodes import propagate, tap, watch
from relprop.engine.parametric import Workspace, model_input
from relprop.engine.tracking import AliasTracker, aliases

#: how far the relevance an op hands on may exceed the relevance arriving (its absolute values summed) before a
#: rule that conserves is reported. A conservative rule with a stabiliser hands on sum_k R_k z_k / (z_k + eps),
#: never more than sum_k |R_k|: any excess is relevance created, and no stabiliser can cause it
CONSERVATION_MARGIN = 1e-2


_current = threading.local()

def _stored(x: Tensor, value: Tensor) -> Tensor:
    """The op of an activation module: its output was computed by the module itself."""
    return value


class _Unhandled(Gradient):
    """The plain gradient for an op without a rule, reported when relevance reaches it."""

    def __init__(self, session: "Session"):
        self._session = session

    def propagate(self, call: Call, relevance: Tensor) -> tuple[Tensor | None, ...]:
        result = super().propagate(call, relevance)
        # an op without an autograd kernel (a custom or quantized kernel) has no gradient either
        self._session.report(call.describe(), relevance, gradient=any(r is not None for r in result))
        return result

    def __repr__(self) -> str:
        return "none"


def _constant_output(out: Any, args: tuple) -> Any:
    """``out``, computed from constants alone, as constants.

    A view of a parameter made under ``no_grad`` still requires grad
    (``scale.view(1, C)``, ``cls_token.expand(B, -1, -1)``), so it would pass
    for an activation and take relevance in products and sums. A tensor the
    op returns as it was given (in place) stays what it is.
    """
    if isinstance(out, Tensor):
        return out.detach() if out.requires_grad and not any(out is a for a in args) else out
    if type(out) in (tuple, list):  # chunk, split, unbind; not named tuples (their fields stay as they are)
        return type(out)(_constant_output(o, args) for o in out)
    return out


class RuleSource(Protocol):
    """What the engine asks of a composite (:class:`relprop.composites.Composite` implements it)."""

    def rule_for(self, call: OpCall, module: nn.Module | None, name: str) -> tuple[Rule | None, str]:
        """The rule for ``call``, issued by ``module`` (dotted path ``name``), and where it came from."""

    def own_rule(self, module: nn.Module | None) -> Rule | None:
        """The rule set on ``module`` itself (``module.rule``), if any."""


class Session(TorchFunctionMode):
    """One attribution forward pass of ``model`` with rules from ``composite``.

    Parameters
    ----------
    model : nn.Module
        The model whose modules provide the context of each op.
    composite : relprop.composites.Composite
        Chooses the rule of each op.
    strict : bool
        Raise :class:`~relprop.UnsupportedOpError` when relevance reaches an op without
        a rule, instead of warning.
    taps : mapping of module to tapper, optional
        For each module, a callable ``tapper(session, value) -> value`` applied
        to the module's inputs (if ``tapper.input``) or output, typically
        putting :meth:`tap` nodes on them (see :class:`relprop.LayerLRP`).
    audit : callable, optional
        Called as ``audit(call, relevance, input_relevances)`` after every
        propagation (see :func:`relprop.audit`).
    token_inputs : tuple of integer tensors
        Model inputs of token ids: their embedding lookups collect relevance
        (:meth:`token_embedding`).
    guard : bool
        Report ops whose rule hands on NaN or infinite relevance, or creates
        relevance where it should conserve it (:class:`~relprop.ConservationWarning`).
    reusable : bool
        Every op call serves several backward passes (many seeds from one
        forward pass): it keeps what it holds, and its rule writes nothing in place.
    """

    def __init__(self, model: nn.Module, composite: RuleSource, strict: bool = False,
                 taps: Mapping[nn.Module, Any] | None = None, audit: Callable[..., None] | None = None,
                 token_inputs: tuple[Tensor, ...] = (), guard: bool = True, reusable: bool = False):
        super().__init__()
        #: op calls serve several backward passes (:attr:`~relprop.engine.OpCall.reusable`)
        self.reusable = reusable
        self.composite = composite
        self.strict = strict
        self.audit = audit
        self.guard = guard
        self._taps = dict(taps or {})
        self._token_inputs = token_inputs
        #: index of an integer model input -> leaves of its embedded vectors (relevance collects there)
        self.embeddings: dict[int, list[Tensor]] = {}
        #: which module issued each op
        self.context = ModuleContext(model)
        #: producers, tags, readers and in-place overwrites of the activations
        self.aliases = AliasTracker()
        #: tap output -> its record (so that a BatchNorm merged across a tap keeps it)
        self.tapped: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.unhandled: list[str] = []
        #: scratch memory the parametric op calls share (see :class:`relprop.engine.Workspace`)
        self.workspace = Workspace()
        #: per op reached in the backward pass: the call, the relevance it handed on and, if its rule conserves, the
        #: relevance that arrived summed in absolute value; checked together once the pass ends (:meth:`_check`)
        self._totals: list[tuple[OpCall, Tensor, Tensor | None]] = []

    # ------------------------------------------------------------ module context

    @property
    def module_name(self) -> str:
        """The dotted path of the innermost module whose forward is running."""
        return self.context.module_name

    def module_rule(self) -> Rule | None:
        """The rule set on the innermost module as ``module.rule``, if any."""
        return self.composite.own_rule(self.context.module)

    def record(self, kind: OpKind, func: Callable, args: tuple, kwargs: dict,
               linearised: Callable | None = None) -> OpCall:
        """An op call of ``kind`` for ``func(*args, **kwargs)``, issued by the current module (see :class:`OpCall`)."""
        return OpCall(kind, func, args, kwargs, op_name(func), self.context.module_name, linearised)

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
        self.context.exit()
        tapper = self._taps.get(module)
        if tapper is not None and not tapper.input and output is not None:
            return tapper(self, output)
        return output

    def _activation_module(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """An activation module written as several ops (GPT-2's tanh GELU): one elementwise op, identity rule."""
        x = args[0] if len(args) == 1 else None
        if not any(is_activation(a) for a in args):
            return output  # constants in, constant out
        if not (is_activation(x) and isinstance(output, Tensor) and output.shape == x.shape):
            raise RuntimeError(f"relprop: activation module '{self.module_name}' ({type(module).__name__}) must map "
                               "one tensor to one tensor of the same shape")
        value = output.detach()
        call = OpCall(OpKind.ELEMENTWISE, _stored, (x, value), {}, type(module).__name__, self.module_name)
        out = self.run(call)
        self.aliases.set_tag(out, "activation")
        return out

    def token_embedding(self, ids: Any, vectors: Tensor) -> Tensor:
        """Embedded vectors of an integer model input become leaves that collect its tokens' relevance."""
        for index, tokens in enumerate(self._token_inputs):
            if aliases(ids, tokens) and ids.numel() == tokens.numel():
                leaf = vectors.detach().requires_grad_()
                self.embeddings.setdefault(index, []).append(leaf)
                return leaf.clone()  # not the leaf itself, so that in-place ops on the embeddings are allowed
        return vectors

    def tap(self, value: Any, record: Any) -> Any:
        """Put a tap node on ``value`` that hands the relevance reaching it to ``record``.

        ``record.below`` is set to the tapped tensor, the start of the graph
        below the tap. The tap is transparent to BatchNorm merging.
        """
        if not is_activation(value):
            return value
        record.below = value
        out = tap(value, record)
        self.aliases.alias(out, value)
        self.tapped[out] = record
        return out

    @contextmanager
    def active(self) -> Iterator["Session"]:
        """Hooks, eval mode and the torch function mode for one forward pass; all undone on exit."""
        training = [module for module in self.context.names if module.training]
        if training:
            warnings.warn("relprop: the model is in training mode; it is explained in eval mode "
                          "(dropout off, BatchNorm running statistics) and put back afterwards", stacklevel=2)
        handles = []
        previous = getattr(_current, "session", None)
        try:
            for module in training:
                module.training = False
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
            for module in training:
                module.training = True

    # ------------------------------------------------------------ helpers for op families

    def fed_by_input(self, x: Tensor) -> bool:
        """Whether ``x`` comes from a model input through routing ops only (the op is a first layer)."""
        return model_input(x) is not None

    def rule_for(self, call: OpCall) -> tuple[Rule | None, str]:
        """The composite's rule for ``call`` in the current module, and where it came from."""
        return self.composite.rule_for(call, self.context.module, self.context.module_name)

    def run(self, call: OpCall, rule: Rule | None = None, source: str = "inherited from the merged layer") -> Any:
        """Run ``call`` as a relevance node with its rule (``rule``, from ``source``, or the composite's choice)."""
        if rule is None:
            rule, source = self.rule_for(call)
        call.reusable = self.reusable
        # entries an in-place ReLU set to 0 among the inputs: of interest unless they get no relevance
        zeroed = self.aliases.zeroed_for(call, rule)
        if rule is None:  # winner-take-all: the gradient is the rule
            out = call.call_with(call.func, call.activations)
            self.aliases.carry_zeros(zeroed, out)
            return out
        out = propagate(call, rule, self._observe if self.guard else self.audit)
        if not rule.accepts(call):
            shapes = ", ".join(str(tuple(x.shape)) for x in call.inputs)
            raise RuleError(f"relprop: rule {rule!r} ({source}) cannot apply to {call.describe()} (op kind "
                            f"'{call.kind}', input shapes {shapes}, output shape {tuple(call.output.shape)})")
        if zeroed:
            self.aliases.follow_zeros(call, rule, zeroed, out)
        call.settle()
        self.aliases.recorded(call, out)
        return out

    def _observe(self, call: OpCall, relevance: Tensor, result: tuple[Tensor | None, ...]) -> None:
        """After ``call`` propagated ``relevance``: the audit, if any, and the guard's totals.

        An op that hands on the very relevance that arrived (an activation's Pass) has nothing to check.
        """
        if self.audit is not None:
            self.audit(call, relevance, result)
        handed = [r for r in result if r is not None]
        if all(r is relevance for r in handed):
            return
        if not self._totals:  # the first op of this backward pass: check them all when it ends
            torch.autograd.Variable._execution_engine.queue_callback(self._check)
        total = handed[0].sum()
        for r in handed[1:]:  # one addition per further input: fewer ops than stacking their sums
            total = total + r.sum()
        # the relevance arriving, summed in absolute value: a conservative rule never hands on more
        mass = relevance.abs().sum() if call.rule.conserves(call) else None  # faster than vector_norm(r, 1) on CPU
        # kept as tensors and read once at the end: one synchronisation per backward pass on a GPU, not one per op
        self._totals.append((call, total, mass))

    def _check(self) -> None:
        """Report the ops of the backward pass that made NaN or infinite relevance, or created relevance."""
        entries, self._totals = self._totals, []
        if not entries:
            return
        values = [value for _, total, mass in entries for value in (total, mass) if value is not None]
        if len({value.dtype for value in values}) > 1:
            values = [value.double() for value in values]
        numbers = iter(torch.stack(values).tolist())
        first_infinite = True
        for call, _, mass in entries:  # in the order the relevance reached them
            total = next(numbers)
            bound = next(numbers) if mass is not None else math.inf
            if not math.isfinite(total):
                if first_infinite:  # the ops after it only pass it on
                    self.report_rule(call, "hands on NaN or infinite relevance (the first op that does)")
                first_infinite = False
            elif abs(total) > (1 + CONSERVATION_MARGIN) * bound + 1e-12:
                self.report_rule(call, f"created relevance: it handed on {total:.6g}, more than the {bound:.6g} "
                                       "that arrived (in absolute value)")
            elif total == 0 and 0 < bound < math.inf:
                self.report_rule(call, f"dropped all the relevance that arrived ({bound:.6g} in absolute value)")

    def report_rule(self, call: OpCall, problem: str) -> None:
        """A rule's relevance cannot be right: warn once per op (raise in strict mode)."""
        message = f"relprop: {call.describe()} with rule {call.rule!r} {problem}"
        if self.strict:
            raise UnsupportedOpError(message)
        if message not in self.unhandled:
            self.unhandled.append(message)
            warnings.warn(message, ConservationWarning, stacklevel=2)

    def unknown(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """An op without a rule: its plain gradient, reported if relevance flows through it."""
        call = self.record(OpKind.UNKNOWN, func, args, kwargs)
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in call.inputs]
            out = call.call_with(func, leaves)
        if is_activation(out):
            call.keep_graph(leaves, out)
            return self.run(call, rule=_Unhandled(self))
        if not isinstance(out, (tuple, list)) or not any(isinstance(o, Tensor) and o.requires_grad for o in out):
            return out  # nothing differentiable came out
        # several outputs: run on the model's graph and report where relevance enters
        return watch(call.call_with(func, call.activations), lambda relevance: self.report(call.describe(), relevance))

    def report(self, description: str, relevance: Tensor, gradient: bool = True) -> None:
        """Relevance reached an op without a rule: warn once (raise in strict mode).

        ``gradient``: whether the op's plain gradient carries the relevance on; else it stops there.
        """
        consequence = ("its plain gradient was used" if gradient else
                       "it has no gradient either, so the relevance stops there")
        if self.strict:
            raise UnsupportedOpError(f"relprop: no rule for {description}; {consequence} (strict mode)")
        if description not in self.unhandled:
            self.unhandled.append(description)
            warnings.warn(f"relprop: no rule for {description}; {consequence}", UnhandledOpWarning, stacklevel=2)

    # ------------------------------------------------------------ the mode

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        handler = HANDLERS.get(func)
        if handler is None and (resolved := resolve(func, args, kwargs)) is not None:
            handler, func, args, kwargs = resolved
        opaque = self.context.opaque
        if opaque or (handler not in ALWAYS_HANDLED and not has_activation(args, kwargs)):
            # no activation in: a constant out (also what is computed from parameters alone); inside an
            # activation module, its output becomes one op in the exit hook. Ops on plain constants run as they
            # are: a view of a fresh buffer made under no_grad could not take activations in place later
            # (`buf[:, :4].copy_(h)`)
            if not (opaque or has_parameter(args, kwargs)):
                return func(*args, **kwargs)
            with torch.no_grad():
                return _constant_output(func(*args, **kwargs), args)
        try:
            if handler is None:
                return self.unknown(func, args, kwargs)
            return handler(self, func, args, kwargs)
        except Exception as error:
            if not getattr(error, "_relprop_noted", False):
                setattr(error, "_relprop_noted", True)
                error.add_note(f"relprop: raised by {op_name(func)} in module '{self.module_name or '<root>'}' "
                               "during the attribution forward pass")
            raise
