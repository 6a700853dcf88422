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

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from relprop._core.errors import RuleError
from relprop._core.gradient_form import Converted, InGradientForm, in_gradient_form
from relprop._core.kinds import OpKind
from relprop._core.registry import ALWAYS_HANDLED, HANDLERS, op_name, resolve
from relprop._core.rule import Rule
from relprop._core.tensors import has_activation, has_parameter, is_activation
from relprop.engine.calls import OpCall
from relprop.engine.context import ModuleContext
from relprop.engine.functions import GradientFormUnavailable, Unruled, _Unhandled
from relprop.engine.guard import Guard
from relprop.engine.hooks import ModuleHooks
from relprop.engine.nodes import propagate, substitute, tap, watch
from relprop.engine.parametric import model_input
from relprop.engine.sign_parts import Workspace
from relprop.engine.plan import Recording, Replay
from relprop.engine.tracking import AliasTracker, aliases

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

    def function_rule(self, function: type) -> Rule | None:
        """The rule given to a custom ``torch.autograd.Function`` (``func_map`` by class), if any."""


class Session(Guard, Unruled, ModuleHooks):
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
    gradient_form : bool
        Carry relevance per unit of activation, ``R / x``, between the ops
        (:mod:`relprop._core.gradient_form`): rules with a gradient form run as
        the op's own VJP, others are converted on both sides. What reaches the
        model's inputs (and what the seed must be) is then per unit too, and the
        guard checks the ops for NaN and infinities only.
    """

    def __init__(self, model: nn.Module, composite: RuleSource, strict: bool = False,
                 taps: Mapping[nn.Module, Any] | None = None, audit: Callable[..., None] | None = None,
                 token_inputs: tuple[Tensor, ...] = (), guard: bool = True, reusable: bool = False,
                 gradient_form: bool = False):
        super().__init__()
        #: relevance per unit of activation flows between the ops (see the class's parameters)
        self.gradient_form = gradient_form
        # what flows backward in gradient form is no relevance whose total the ops account for
        self.accounts = self.accounts and not gradient_form
        #: one gradient-form wrapper per rule and what it reads (:func:`~relprop._core.gradient_form.in_gradient_form`)
        self._in_gradient_form: dict[Any, Any] = {}
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
        #: per op reached in the backward pass: the call, the relevance it handed on, the relevance that arrived
        #: and, if its rule conserves, that summed in absolute value; checked together once the pass ends
        #: (:meth:`_check`)
        self._totals: list[tuple[Any, Tensor, Tensor, Tensor | None]] = []
        #: whether the caller checks the totals with the seed and the inputs' relevance (:meth:`check_pass`)
        self._deferred = False
        #: the module of an op that read activations with gradients off (as a custom Function's forward does) since
        #: the last op with gradients on: where a Function found among the next op's arguments was applied
        self._applied_in = ""
        #: whether the engine itself is reading tensors (:meth:`_reading`)
        self._engine_reads = False
        #: the plan this pass is recorded into, if any (:mod:`relprop.engine.plan`)
        self.recording: Recording | None = None
        #: the plan this pass follows instead of intercepting each op, if any
        self.replay: Replay | None = None

    # ------------------------------------------------------------ module context

    def module_rule(self) -> Rule | None:
        """The rule set on the innermost module as ``module.rule``, if any."""
        return self.composite.own_rule(self.context.module)

    def record(self, kind: OpKind, func: Callable, args: tuple, kwargs: dict,
               linearised: Callable | None = None) -> OpCall:
        """An op call of ``kind`` for ``func(*args, **kwargs)``, issued by the current module (see :class:`OpCall`)."""
        return OpCall(kind, func, args, kwargs, op_name(func), self.context.module_name, linearised)

    def token_embedding(self, ids: Any, vectors: Tensor) -> Tensor:
        """Embedded vectors of an integer model input become leaves that collect its tokens' relevance."""
        for index, tokens in enumerate(self._token_inputs):
            if aliases(ids, tokens) and ids.numel() == tokens.numel():
                leaf = vectors.detach().requires_grad_()
                self.embeddings.setdefault(index, []).append(leaf)
                out = leaf.clone()  # not the leaf itself, so that in-place ops on the embeddings are allowed
                self._note("embedded", out)
                return out
        self._note("embedded", vectors)
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
        # a plan rebuilds the call from the op's arguments: which of them it was made with, before a node drops them
        made_with = call.arguments_of() if self.recording is not None else None
        if self.gradient_form and rule is not None:
            if not call.explains_its_output:  # relevance per unit of the model's output is no unit of the rule's
                raise GradientFormUnavailable(f"relprop: {call.describe()} is explained as another output")
            rule = in_gradient_form(rule, call, self._in_gradient_form)
            if rule.fills_zeros:  # relevance it gives inputs of value 0 has no unit to be carried in
                raise GradientFormUnavailable(f"relprop: rule {rule!r} on {call.describe()} fills inputs of value 0")
            if isinstance(rule, InGradientForm) and rule.native and call.runs_as_autograd:
                out = self.native(call, rule.held)
                self._check_accepts(call, rule, source)
                self._note("native", call, made_with, rule, out)
                return out
        # entries an in-place ReLU set to 0 among the inputs: of interest unless they get no relevance
        zeroed = self.aliases.zeroed_for(call, rule)
        if rule is None:  # winner-take-all: the gradient is the rule
            out = call.call_with(call.func, call.activations)
            self.aliases.carry_zeros(zeroed, out)
            self._note("native" if not (zeroed or call.linearised) else "zeroed", call, made_with, None, out)
            return out
        out = self.node(call, rule)
        self._check_accepts(call, rule, source)
        if zeroed:
            self.aliases.follow_zeros(call, rule, zeroed, out)
        call.settle()
        self.aliases.recorded(call, out)
        self._note("node" if not zeroed else "zeroed", call, made_with, rule, out)
        return out

    def node(self, call: OpCall, rule: Rule) -> Tensor:
        """``call`` as a relevance node with ``rule`` (as the pass carries it): the op's output, bitwise."""
        # a converted rule reads the output and inputs as they came: it must write into neither
        call.reusable = self.reusable or isinstance(rule, Converted)
        return propagate(call, rule, self._observe if self.guard else self.audit)

    @staticmethod
    def native(call: OpCall, held: tuple[bool, ...]) -> Tensor:
        """``call`` as plain autograd, the inputs flagged in ``held`` held constant (gates): no relevance node.

        The relevance per unit of activation is the op's own gradient there (what computed a gate is freed after
        the forward pass); for an op the rule linearises (a norm with its statistic held), the linearised form's
        gradient under the model's own output.
        """
        held = held or (False,) * len(call.inputs)
        activations = [x.detach() if hold else x for x, hold in zip(call.activations, held)]
        if not call.linearised:
            out = call.call_with(call.func, activations)
        else:
            with torch.no_grad():
                value = call.call_with(call.func, call.inputs)
            out = substitute(value, call.call_with(call.linearised_function, activations))
        call.output = out.detach()
        return out

    def _note(self, *effect: Any) -> None:
        """Tell the recording plan what the op being intercepted did (see :meth:`relprop.engine.plan.Recording.note`)."""
        if self.recording is not None:
            self.recording.note(*effect)

    @staticmethod
    def _check_accepts(call: OpCall, rule: Rule, source: str) -> None:
        """Raise :class:`~relprop.RuleError` if ``rule`` (from ``source``) cannot apply to ``call``, which has run."""
        if not rule.accepts(call):
            shapes = ", ".join(str(tuple(x.shape)) for x in call.inputs)
            raise RuleError(f"relprop: rule {rule!r} ({source}) cannot apply to {call.describe()} (op kind "
                            f"'{call.kind}', input shapes {shapes}, output shape {tuple(call.output.shape)})")

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

    # ------------------------------------------------------------ the mode

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self._engine_reads:
            return func(*args, **kwargs)
        if self.replay is not None:
            return self.replay.run(self, func, args, kwargs)
        if self.recording is not None:
            return self.recording.intercept(self, func, args, kwargs)
        return self.intercept(func, args, kwargs)

    def intercept(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """``func(*args, **kwargs)`` handed to its op family: the op runs with its rule."""
        handler = HANDLERS.get(func)
        if handler is None and (resolved := resolve(func, args, kwargs)) is not None:
            handler, func, args, kwargs = resolved
        if self.context.opaque or (handler not in ALWAYS_HANDLED and not has_activation(args, kwargs)):
            return self.constant_op(func, args, kwargs)
        # custom Functions' outputs among the arguments, each op (a Function whose forward runs no torch op on
        # activations, as a compiled extension's, is seen nowhere else): named after the module of an op run inside
        # its forward (with gradients off), else after the module reading it
        self.custom_functions(args, self._applied_in or self.module_name)
        self._applied_in = "" if torch.is_grad_enabled() else self.module_name
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

    def constant_op(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """An op without an activation among its arguments: a constant out (also what is computed from parameters
        alone); inside an activation module, whose output becomes one op in the exit hook, every op."""
        with_parameters = bool(self.context.opaque) or has_parameter(args, kwargs)
        out = self.constant(func, args, kwargs, with_parameters)
        self._note("constant", with_parameters, out)
        return out

    @staticmethod
    def constant(func: Callable, args: tuple, kwargs: dict, with_parameters: bool) -> Any:
        """An op on constants: as it is, or ``with_parameters`` (or inside an activation module) as a constant.

        Ops on plain constants run as they are: a view of a fresh buffer made under no_grad could not take
        activations in place later (``buf[:, :4].copy_(h)``).
        """
        if not with_parameters:
            return func(*args, **kwargs)
        with torch.no_grad():
            return _constant_output(func(*args, **kwargs), args)

    def routed(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """A routing op: run as it is (its gradient re-routes relevance exactly); a tag of its input carries over."""
        out = func(*args, **kwargs)
        self.aliases.routed(args, kwargs, out)
        self._note("routed", out)
        return out
