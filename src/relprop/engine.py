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
:class:`~relprop.tracking.AliasTracker`; handlers see the session through the
:class:`~relprop.ops.OpHost` protocol.
"""
from __future__ import annotations

import functools
import math
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from . import rules
from .contract import Call
from .graph import OpCall, OpKind, Workspace, is_activation, model_input, propagate, sum_to, tap, watch
from .ops import ALWAYS_HANDLED, HANDLERS, from_aten, has_activation, has_parameter, op_name
from .tracking import AliasTracker, aliases

if TYPE_CHECKING:
    from .composites import Composite

__all__ = ["Session", "ModuleContext", "RuleError", "UnsupportedOpError", "UnhandledOpWarning", "ConservationWarning"]


class RuleError(ValueError):
    """A rule was assigned to an op it cannot propagate through."""


class UnsupportedOpError(RuntimeError):
    """Relevance reached an op without a rule (raised in strict mode)."""


class UnhandledOpWarning(UserWarning):
    """Relevance reached an op without a rule; its plain gradient was used."""


class ConservationWarning(UserWarning):
    """An op's rule handed on NaN or infinite relevance, or created relevance where it should conserve it."""


#: how far the relevance an op hands on may exceed the relevance arriving (its absolute values summed) before a
#: rule that conserves is reported. A conservative rule with a stabiliser hands on sum_k R_k z_k / (z_k + eps),
#: never more than sum_k |R_k|: any excess is relevance created, and no stabiliser can cause it
CONSERVATION_MARGIN = 1e-2


#: the rounding the account of a whole backward pass allows at least, relative to the relevance it sums
_FLOAT32_ROUNDING = math.sqrt(torch.finfo(torch.float32).eps)

_current = threading.local()

def _stored(x: Tensor, value: Tensor) -> Tensor:
    """The op of an activation module: its output was computed by the module itself."""
    return value


_ACTIVATION_NAME = re.compile(r"(Activation|GELU|Gelu|GeLU|SiLU|Swish|Mish)\w*$")


@functools.cache
def _is_activation_class(cls: type) -> bool:
    return bool(_ACTIVATION_NAME.search(cls.__name__)) and not cls.__module__.startswith("torch.")


def _is_activation_module(module: nn.Module) -> bool:
    """Activation modules of other libraries (Hugging Face's ``NewGELUActivation``) are treated as one op.

    Recognised by name, and only if they are leaves without parameters (not ``Conv2dNormActivation``).
    """
    return (_is_activation_class(type(module))  # type: ignore[arg-type]  # nn.Module's __hash__ stub
            and not module._modules and not module._parameters)


def _sums_to(shape: torch.Size, target: torch.Size) -> bool:
    """Whether a tensor of ``shape`` sums to ``target`` along broadcast dimensions."""
    if len(target) > len(shape):
        return False
    return all(t in (1, s) for s, t in zip(reversed(shape), reversed(target)))


def _exact(rule: rules.Rule) -> bool:
    """Whether ``rule``, where it conserves, conserves exactly: it has no stabiliser (``epsilon = 0``), or is Pass."""
    return isinstance(rule, rules.Pass) or getattr(rule, "epsilon", getattr(rule, "stabilizer", None)) == 0


def _fills_zeros(rule: rules.Rule) -> bool:
    """Whether ``rule`` gives inputs of value 0 relevance of their own (Flat, WSquare, ZBox's bounds).

    Where such an input is padding (``F.pad`` before a first layer, a routing op), that relevance reaches a
    constant and is lost there, out of any op's account.
    """
    return isinstance(rule, (rules.BasicRule, rules.SmoothStride)) and not rule.zero_for_zero_input


class _Unhandled(rules.Gradient):
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


@functools.cache
def _custom_function(node_type: type) -> type | None:
    """The ``torch.autograd.Function`` whose backward nodes are of ``node_type``; None for autograd's own nodes
    and relprop's.

    ``Function.apply`` is not a torch function: a torch function mode sees only the ops inside the Function's
    forward, run with gradients off, and the output comes out with the Function's own backward as its history.
    """
    function = getattr(node_type, "_forward_cls", None)
    if not isinstance(function, type) or function.__module__.split(".", 1)[0] == "relprop":
        return None
    return function


class FunctionCall:
    """A custom ``torch.autograd.Function`` applied in the forward pass, as the guard and the audit see it.

    Relevance crosses it through a hook on its autograd node (:meth:`Session.custom_functions`): its rule is
    the composite's ``func_map`` entry for the class (``rules.Pass`` or ``rules.Gradient``), else its own
    backward, reported.
    """

    kind = OpKind.UNKNOWN

    def __init__(self, function: type, module_name: str, rule: rules.Rule):
        self.function = function
        self.func = function.apply
        self.name = f"{function.__module__}.{function.__qualname__}"
        self.module_name = module_name
        self.rule = rule

    def describe(self) -> str:
        return f"custom autograd Function {self.name} in module '{self.module_name or '<root>'}'"


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


class ModuleContext:
    """Which module issued each op: the stack of module forwards running, kept by forward hooks.

    Parameters
    ----------
    model : nn.Module
        The model whose modules (and their dotted paths) are followed.
    """

    def __init__(self, model: nn.Module) -> None:
        self.names = {module: name for name, module in model.named_modules()}
        self._stack: list[nn.Module] = []
        #: the dotted path of :attr:`module` (``""`` for the root or outside any module); read by every op
        self.module_name = ""
        #: depth inside activation modules run as one elementwise op (their ops are not intercepted one by one)
        self.opaque = 0

    @property
    def module(self) -> nn.Module | None:
        """The innermost module whose forward is running."""
        return self._stack[-1] if self._stack else None

    def enter(self, module: nn.Module) -> None:
        """``module``'s forward starts."""
        self._stack.append(module)
        self.module_name = self.names.get(module, "")
        if self.opaque or _is_activation_module(module):
            self.opaque += 1

    def is_innermost(self, module: nn.Module) -> bool:
        """Whether ``module`` is the innermost module running (its forward hook belongs to this pass)."""
        return bool(self._stack) and self._stack[-1] is module

    def end_opaque(self) -> bool:
        """The innermost module's forward ends: whether it is the outermost of nested activation modules.

        Its output then becomes one op, while the module is still the innermost (:meth:`exit` follows).
        """
        if not self.opaque:
            return False
        self.opaque -= 1
        return not self.opaque

    def exit(self) -> None:
        """The innermost module's forward has ended."""
        self._stack.pop()
        self.module_name = self.names.get(self._stack[-1], "") if self._stack else ""

    def clear(self) -> None:
        self._stack.clear()
        self.opaque = 0
        self.module_name = ""


class Session(TorchFunctionMode):
    """One attribution forward pass of ``model`` with rules from ``composite``.

    Parameters
    ----------
    model : nn.Module
        The model whose modules provide the context of each op.
    composite : relprop.composites.Composite
        Chooses the rule of each op.
    strict : bool
        Raise :class:`UnsupportedOpError` when relevance reaches an op without
        a rule, instead of warning.
    taps : mapping of module to tapper, optional
        For each module, a callable ``tapper(session, value) -> value`` applied
        to the module's inputs (if ``tapper.input``) or output, typically
        putting :meth:`tap` nodes on them (see :mod:`relprop.layer`).
    audit : callable, optional
        Called as ``audit(call, relevance, input_relevances)`` after every
        propagation (see :mod:`relprop.audit`).
    token_inputs : tuple of integer tensors
        Model inputs of token ids: their embedding lookups collect relevance
        (:meth:`token_embedding`).
    guard : bool
        Report ops whose rule hands on NaN or infinite relevance, or creates
        relevance where it should conserve it (:class:`ConservationWarning`).
    """

    #: whether what flows backward is relevance, whose total the ops account for (:meth:`check_pass`); DeepLift's
    #: multipliers are not
    accounts = True

    def __init__(self, model: nn.Module, composite: Composite, strict: bool = False,
                 taps: Mapping[nn.Module, Any] | None = None, audit: Callable[..., None] | None = None,
                 token_inputs: tuple[Tensor, ...] = (), guard: bool = True):
        super().__init__()
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
        #: scratch memory the parametric op calls share (see :class:`relprop.graph.Workspace`)
        self.workspace = Workspace()
        #: per op reached in the backward pass: the call, the relevance it handed on, the relevance that arrived
        #: and, if its rule conserves, that summed in absolute value; checked together once the pass ends
        #: (:meth:`_check`)
        self._totals: list[tuple[Any, Tensor, Tensor, Tensor | None]] = []
        #: whether the caller checks the totals with the seed and the inputs' relevance (:meth:`check_pass`)
        self._deferred = False
        #: whether an op has read activations with gradients off (as a custom Function's forward does): the ops
        #: then look for custom Functions among their arguments (:meth:`custom_functions`)
        self._custom = False
        #: the module of the last op that read activations with gradients off: where a Function was applied
        self._applied_in = ""

    # ------------------------------------------------------------ module context

    @property
    def module_name(self) -> str:
        """The dotted path of the innermost module whose forward is running."""
        return self.context.module_name

    def module_rule(self) -> rules.Rule | None:
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
        if isinstance(output, Tensor):  # a custom Function's output, named after the module that applied it
            self.custom_functions((output,), self.module_name)
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

    def rule_for(self, call: OpCall) -> tuple[rules.Rule | None, str]:
        """The composite's rule for ``call`` in the current module, and where it came from."""
        return self.composite.rule_for(call, self.context.module, self.context.module_name)

    def run(self, call: OpCall, rule: rules.Rule | None = None, source: str = "inherited from the merged layer") -> Any:
        """Run ``call`` as a relevance node with its rule (``rule``, from ``source``, or the composite's choice)."""
        if rule is None:
            rule, source = self.rule_for(call)
        # entries an in-place ReLU set to 0 among the inputs: of interest unless they get no relevance
        zeroed = self.aliases.zeroed_for(call, rule)
        if rule is None:  # winner-take-all: the gradient is the rule
            out = call._call(call.func, call.activations)
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
        totals = [seed.sum(), *(r.sum() for r in relevance)] if self.guard and self.accounts else None
        self._check(totals)

    def _check(self, account: list[Tensor] | None = None) -> None:
        """Report the ops of the backward pass that made NaN or infinite relevance, or created relevance.

        Also, among the ops whose rule conserves with no stabiliser, those whose relevance handed on differs from
        what arrived beyond rounding (the largest imbalances first); and, with ``account`` (the seed's total and
        the inputs' totals), relevance that no op's rule accounts for.
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
        fills = False  # whether a rule gave relevance to inputs of value 0: some may be padding, where it is lost
        for call, _, _, mass in entries:  # in the order the relevance reached them
            fills = fills or _fills_zeros(call.rule)
            total, arrived = next(numbers), next(numbers)
            bound = next(numbers) if mass is not None else math.inf
            absorbed += arrived - total
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
        if account is None or not first_infinite or fills:
            return
        seed, *inputs = (next(numbers) for _ in account)
        unaccounted = seed - sum(inputs) - absorbed
        scale += abs(seed) + sum(abs(r) for r in inputs)
        # relevance may cross casts to float32 between the ops (Llama-like models compute RMSNorm, RoPE and the
        # softmax in float32): no less than float32's rounding
        if abs(unaccounted) > max(tolerance, _FLOAT32_ROUNDING) * scale:
            self.report_pass(f"relprop: {unaccounted:.6g} of the relevance is not accounted for: the seed totals "
                             f"{seed:.6g}, the inputs got {sum(inputs):.6g} and the ops absorbed {absorbed:.6g}; "
                             "relevance was created or lost by an op relprop does not see (an autograd op outside "
                             "the engine's ops), a bug to report")

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

    def unknown(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """An op without a rule: its plain gradient, reported if relevance flows through it."""
        call = self.record(OpKind.UNKNOWN, func, args, kwargs)
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in call.inputs]
            out = call._call(func, leaves)
        if is_activation(out):
            call.keep_graph(leaves, out)
            return self.run(call, rule=_Unhandled(self))
        if not isinstance(out, (tuple, list)) or not any(isinstance(o, Tensor) and o.requires_grad for o in out):
            return out  # nothing differentiable came out
        # several outputs: run on the model's graph and report where relevance enters
        return watch(call._call(func, call.activations), lambda relevance: self.report(call.describe(), relevance))

    def custom_functions(self, args: tuple | list, module_name: str) -> None:
        """Give every custom autograd Function whose output is among ``args`` its rule, once (a hook on its node).

        The Function's forward is not intercepted as one op (see :func:`_custom_function`); its output is seen
        when the module that applied it returns it or, once an op has read activations with gradients off (as
        the ops of a Function's forward do), when the first op reads it. ``module_name``: the module that applied
        it (for an op, the module of the last op that ran with gradients off).
        """
        for value in args:
            if not isinstance(value, Tensor):
                if type(value) in (list, tuple):
                    self.custom_functions(value, module_name)
                continue
            node = value.grad_fn
            if node is None or (function := _custom_function(type(node))) is None or hasattr(node, "_relprop_seen"):
                continue
            node._relprop_seen = True  # a Function's node is its ctx: it takes attributes
            rule = self.composite.function_rule(function)
            call = FunctionCall(function, module_name, rule if rule is not None else _Unhandled(self))
            node.register_hook(functools.partial(self._custom_backward, call))

    def _custom_backward(self, call: FunctionCall, grad_inputs: tuple, grad_outputs: tuple) -> tuple | None:
        """The relevance crossing a custom Function: its rule's, or its own backward's (reported)."""
        arriving = [g for g in grad_outputs if g is not None]
        if not arriving:
            return None
        relevance = arriving[0] if len(arriving) == 1 else torch.cat([g.reshape(-1) for g in arriving])
        result = tuple(grad_inputs)
        if isinstance(call.rule, rules.Pass):
            slots = [i for i, g in enumerate(grad_inputs) if g is not None]
            if len(slots) != 1 or len(arriving) != 1 or not _sums_to(relevance.shape, grad_inputs[slots[0]].shape):
                raise RuleError(f"relprop: rule {call.rule!r} (func_map entry) cannot apply to {call.describe()}: "
                                "it needs one differentiable input and one output that sums back to its shape")
            result = tuple(sum_to(relevance, g.shape) if g is not None else None for g in grad_inputs)
        elif isinstance(call.rule, _Unhandled):
            self.report(call.describe(), relevance, consequence="its own backward was used as its gradient")
        observe = self._observe if self.guard else self.audit
        if observe is not None:
            observe(call, relevance, result)
        return result if isinstance(call.rule, rules.Pass) else None

    def report(self, description: str, relevance: Tensor, gradient: bool = True, consequence: str | None = None) -> None:
        """Relevance reached an op without a rule: warn once (raise in strict mode).

        ``gradient``: whether the op's plain gradient carries the relevance on; else it stops there.
        ``consequence``: what became of the relevance, if neither.
        """
        consequence = consequence or ("its plain gradient was used" if gradient else
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
        if handler is None and (resolved := from_aten(func, args, kwargs)) is not None:
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
        if not torch.is_grad_enabled():
            # an op on activations with gradients off: in a custom Function's forward (or a no_grad block); from
            # here on, the ops look for custom Functions' outputs among their arguments
            self._custom, self._applied_in = True, self.module_name
        if self._custom:
            self.custom_functions(args, self._applied_in)
        try:
            if handler is None:
                return self.unknown(func, args, kwargs)
            return handler(self, func, args, kwargs)
        except Exception as error:
            if not getattr(error, "_relprop_noted", False):
                error._relprop_noted = True  # type: ignore[attr-defined]
                error.add_note(f"relprop: raised by {op_name(func)} in module '{self.module_name or '<root>'}' "
                               "during the attribution forward pass")
            raise

