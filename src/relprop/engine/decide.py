"""Which rule each node of a traced graph takes: the graph run once under interception itself.

``torch.compile`` hands a backend the FX graph of the plain forward pass; each node carries the module that
issued it (``meta["nn_module_stack"]``), and each input the real tensor it was traced with
(``meta["grapharg"].example``). :func:`decide` runs that graph once on those tensors under the interception
engine (:class:`Decider`, a :class:`~relprop.engine.Session` whose module context is set from the node's
module instead of module hooks): the same op families, composite and rules decide each node's rule, in
gradient form, kept as its :class:`Decision` for :func:`relprop.engine.compiled.rewrite`. Whatever the tier
cannot write raises :class:`CannotCompile` with the reason (an op without a rule, a rule without a traceable
form, a handler that decides across ops, an in-place ReLU read as zeros, an activation module of another
library); the caller falls back to interception.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.utils._pytree import tree_flatten

from relprop._core.errors import user_location
from relprop._core.gradient_form import InGradientForm, unwrapped
from relprop._core.kinds import OpKind
from relprop._core.registry import HANDLERS, op_name
from relprop._core.rule import Rule
from relprop.engine.calls import OpCall
from relprop.engine.compiled_attention import FUSED_ROLES, WrittenAttention, written_attention
from relprop.engine.functions import GradientFormUnavailable, _Unhandled
from relprop.engine.session import RuleSource, Session
from relprop.engine.zeros import maps_zero_to_zero


class CannotCompile(RuntimeError):
    """The compiled tier cannot write this forward pass: it runs under interception instead (the reason)."""


def module_path(stack_entry: str, prefix: str) -> str:
    """A module's dotted path (``named_modules``'), from a Dynamo ``nn_module_stack`` entry less ``prefix``."""
    # "": the model itself, what calls it, or a module outside the model (a function that transformers wraps as a
    # hub kernel): interception hooks the model's modules alone, and explains such a module's ops as its caller's
    if prefix.startswith(stack_entry) or not stack_entry.startswith(prefix):
        return ""
    rest = stack_entry[len(prefix):]
    return re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", rest).lstrip(".")


class Decision(NamedTuple):
    """What interception did with one node: the op call, its rule (in gradient form, or as it is where it fills
    zeros) and where its activations are among the flattened ``(args, kwargs)`` of the node (of ``layer``)."""

    call: OpCall | None
    rule: Rule | None
    slots: tuple[int, ...]
    #: the index of the model input whose probe this node reads (an embedding of token ids, a first layer whose
    #: rule fills zeros), else -1
    probe: int = -1
    #: a BatchNorm merged into the layer that produced its input: that layer's node
    layer: fx.Node | None = None
    #: attention written out: ``weights @ value``, explained as ``call``, its fused attention (of these nodes)
    attention: WrittenAttention | None = None
    #: the views between the probe's model input and this node (a first layer behind ``nn.Flatten``), in order:
    #: the probe is viewed alike
    views: tuple[fx.Node, ...] = ()


class Decider(Session):
    """Interception of a traced graph's ops, node by node: what each decides, for :func:`rewrite`.

    Runs in gradient form, reusable (it never carries relevance). Its module context is set per node from
    Dynamo's ``nn_module_stack`` (:meth:`enter`), not by module hooks.
    """

    def __init__(self, model: nn.Module, composite: RuleSource, token_inputs: tuple[Tensor, ...]):
        super().__init__(model, composite, token_inputs=token_inputs, guard=False, reusable=True,
                         gradient_form=True)
        self.effects: list[tuple] = []
        self.calls: dict[int, tuple[Tensor, ...]] = {}  # id(call) -> its activations, before a node drops them
        self._by_path = {name: module for module, name in self.context.names.items()}

    def _note(self, *effect: Any) -> None:
        if effect[0] == "native":  # a layer behind a ReLU skips its rule's terms of negative inputs, as interception
            self.aliases.rectified(effect[1], effect[-1])
        self.effects.append(effect)

    def run(self, call: OpCall, rule: Rule | None = None, source: str = "inherited from the merged layer") -> Any:
        self.calls[id(call)] = call.activations
        if rule is None:
            rule, source = self.rule_for(call)
        try:
            return super().run(call, rule, source)
        except GradientFormUnavailable:
            if rule is None or not rule.fills_zeros:
                raise
        # a rule that gives inputs of value 0 relevance: a first layer's reaches the input's probe (rewrite). Its
        # node as the relevance form makes it: later ops see its output as interception does (no first layer
        # behind it, a BatchNorm to merge into it)
        out = self.node(call, rule)
        self.aliases.recorded(call, out)
        self._note("node", call, None, rule, out)
        return out

    def enter(self, stack: list[str], prefix: str, alone: bool, func: Any) -> None:
        """The module context of a node of ``func`` issued inside the modules of ``stack`` (outermost first);
        ``alone``: the node is the only op of its innermost module."""
        context = self.context
        context.clear()
        context.enter(self._by_path[""])
        for entry in stack:
            path = module_path(entry, prefix)
            if path:
                module = self._by_path.get(path)
                if module is None:  # a module the model holds under another path too: known by its first
                    try:
                        module = self._by_path[""].get_submodule(path)
                    except AttributeError:
                        raise CannotCompile(f"relprop: the traced graph names a module '{path}' the model lacks")
                context.enter(module)
        if context.opaque:
            # interception explains an activation module of another library as one op on its output, with the
            # rule and tag of an activation: its one op is that, unless the func_map names its function
            if not alone:
                raise CannotCompile(f"relprop: module '{context.module_name}' is an activation module of another "
                                    "library written as several ops, which interception explains as one")
            maps = getattr(self.composite, "maps_function", None)  # a composite's; any other source: any entry
            if maps(func) if maps is not None else getattr(self.composite, "func_map", None):
                raise CannotCompile(f"relprop: module '{context.module_name}' is an activation module of another "
                                    "library, which interception explains as one op that no func_map entry matches, "
                                    "and the func_map names its function")
            context.opaque = 0


class _Deciding(fx.Interpreter):
    """Runs a graph on real tensors, each call under the :class:`Decider`; keeps each node's :class:`Decision`."""

    def __init__(self, gm: fx.GraphModule, decider: Decider, prefix: str, inputs: dict[fx.Node, int],
                 tokens: list[int], only: set[fx.Node] | None = None):
        super().__init__(gm, garbage_collect_values=False)  # a merged BatchNorm reads its layer's arguments
        self.decider, self.prefix, self.only = decider, prefix, only
        #: the placeholder of each model input, and its position among them; the position of each token input
        self.inputs, self.tokens = inputs, tokens
        self.decisions: dict[fx.Node, Decision] = {}
        innermost = [_innermost(n) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
        self._ops = {path: innermost.count(path) for path in set(innermost)}

    def run_node(self, n: fx.Node) -> Any:
        try:
            return self._run_node(n)
        except CannotCompile as error:  # where in the user's code the node comes from
            where = user_location(n.meta.get("stack_trace") or "")
            if where is None or where in str(error.args[0]):
                raise
            raise CannotCompile(f"{error.args[0]} (at {where})") from error

    def _run_node(self, n: fx.Node) -> Any:
        if self.only is not None and n not in self.only and n.op != "placeholder":  # each takes an argument
            return None  # not the model's (the seed, the backward pass and the products of a whole attribution)
        if n.op not in ("call_function", "call_method"):
            if n.op == "call_module":
                raise CannotCompile(f"relprop: the traced graph calls module '{n.target}' as a whole")
            return super().run_node(n)
        decider = self.decider
        stack = [path for path, _ in (n.meta.get("nn_module_stack") or {}).values()]
        method = n.op == "call_method" and isinstance(n.target, str)
        decider.enter(stack, self.prefix, self._ops[_innermost(n)] == 1,
                      getattr(torch.Tensor, str(n.target), n.target) if method else n.target)
        decider.effects, decider.calls = [], {}
        embedded = {index: len(leaves) for index, leaves in decider.embeddings.items()}
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        target = n.target
        if n.op == "call_function" and target not in HANDLERS and (getattr(target, "__module__", "") == "torch._C._nn"
                                                                   or target is torch.rms_norm):
            # Dynamo traces into some of torch.nn.functional's wrappers (F.pad calls torch._C._nn.pad, F.rms_norm
            # torch.rms_norm): interception sees the wrapper of the same name, which takes the same arguments
            wrapper = getattr(F, getattr(target, "__name__", ""), None)
            target = wrapper if wrapper in HANDLERS else target
        with decider:
            out = getattr(self, n.op)(target, args, kwargs)
        decision = self._decision(n, args, kwargs, embedded)
        if decision is not None:
            self.decisions[n] = decision
        return out

    def _decision(self, n: fx.Node, args: tuple, kwargs: dict, embedded: dict[int, int]) -> Decision | None:
        decider = self.decider
        made = [effect for effect in decider.effects if effect[0] not in ("constant", "routed")]
        if not made:
            return None
        # "zeroed": an in-place ReLU's zeros among the inputs, which the relevance form keeps track of; relevance
        # per unit of activation crosses the ReLU as its gradient, 0 there
        if len(made) > 1 or made[0][0] not in ("native", "node", "zeroed", "embedded"):
            raise CannotCompile(f"relprop: {op_name(_function(n))} in module '{decider.module_name or '<root>'}' is "
                                f"explained by its handler as {len(made)} steps "
                                f"({', '.join(_STEPS.get(effect[0], effect[0]) for effect in made)}): it decides "
                                "across ops, which one node of the program cannot write")
        if made[0][0] == "embedded":
            index = next((i for i, leaves in decider.embeddings.items() if len(leaves) > embedded.get(i, 0)), -1)
            return Decision(None, None, (), self.tokens[index]) if index >= 0 else None
        _, call, _, rule, _ = made[0]
        layer, slots, attention = None, self._slots(call, args, kwargs), None
        if slots is None and isinstance(n.args[0], fx.Node) and call.name.endswith("+batch_norm"):
            layer = n.args[0]  # a BatchNorm merged into the layer that produced its input
            slots = self._slots(call, *self.fetch_args_kwargs_from_env(layer))
        if slots is None and call.kind is OpKind.ATTENTION and len(args) == 2:
            attention = written_attention(decider.aliases.scores(args[0]), getattr(call, "roles", ()),
                                          decider.calls.get(id(call), ()), args[1], self.env)
            slots = None if attention is None else tuple(range(len(FUSED_ROLES)))
        if slots is None:
            raise CannotCompile(f"relprop: {call.describe()} is explained over other tensors than its arguments")
        wrapped = unwrapped(rule)
        if isinstance(wrapped, _Unhandled):
            raise CannotCompile(f"relprop: {call.describe()} has no rule")
        native = isinstance(rule, InGradientForm) and rule.native
        scaled = None if rule is None or native else wrapped.scaled(call)
        if scaled is not None and scaled.ratio and self._moves_zeros(call):
            # G * out / x carries no relevance where x = 0, which interception hands on as it is
            raise CannotCompile(f"relprop: rule {wrapped!r} on {call.describe()} hands relevance on to inputs of "
                                "value 0 (the op maps 0 elsewhere), which relevance per unit of activation cannot "
                                "carry")
        if rule is not None and not native and (scaled is None or (scaled.modified is None
                                                                   and not isinstance(rule, InGradientForm))):
            raise CannotCompile(f"relprop: rule {wrapped!r} on {call.describe()} has no traceable gradient form")
        probe, views = -1, tuple[fx.Node, ...]()
        if rule is not None and wrapped.fills_zeros:
            probe, views = self._model_input(layer or n, slots)
            if probe < 0:
                raise CannotCompile(f"relprop: rule {wrapped!r} on {call.describe()} gives inputs of value 0 "
                                    "relevance, and its input is not a model input as it is, or a view of one")
        return Decision(call, rule, slots, probe, layer, attention, views)

    def _moves_zeros(self, call: OpCall) -> bool:
        """Whether ``call`` maps 0 elsewhere on inputs that hold a ReLU's zeros, whose relevance interception hands
        on as it is (a composite without gradient form). Zeros of other origins are rare in floating point, and
        lost as under interception in gradient form."""
        decider = self.decider
        if getattr(decider.composite, "gradient_form", False) or maps_zero_to_zero(call):
            return False
        activations = decider.calls.get(id(call), ())
        return any(decider.aliases.relu_output(x) for x in activations) or bool(decider.aliases.zeroed_in(activations))

    def _slots(self, call: OpCall, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        """Where ``call``'s activations are among ``(args, kwargs)``, flattened; None where one is not."""
        leaves, _ = tree_flatten((args, kwargs))
        slots = []
        for x in self.decider.calls.get(id(call), ()):  # a tensor passed twice (h * h) has two slots
            slot = next((i for i, leaf in enumerate(leaves) if leaf is x and i not in slots), None)
            if slot is None:
                return None
            slots.append(slot)
        return tuple(slots)

    def _model_input(self, n: fx.Node, slots: tuple[int, ...]) -> tuple[int, tuple[fx.Node, ...]]:
        """The index of the model input that is ``n``'s one activation (a copy of it, as the model sees it, or a
        view of that copy), or -1; and the views in between, in the order they apply."""
        leaves, _ = tree_flatten((n.args, n.kwargs))
        source = leaves[slots[0]] if len(slots) == 1 else None
        views: list[fx.Node] = []
        while (isinstance(source, fx.Node) and source.op in ("call_method", "call_function") and source.args
               and _name(source.target) in _VIEWS):
            views.insert(0, source)
            source = source.args[0]
        if isinstance(source, fx.Node) and source.op == "call_method" and source.target == "clone":
            source = source.args[0]
        index = self.inputs.get(source, -1) if isinstance(source, fx.Node) else -1
        return index, tuple(views) if index >= 0 else ()


#: functions that only view their first argument in another shape: a probe is viewed alike
_VIEWS = frozenset({"flatten", "view", "reshape", "unflatten", "unsqueeze", "squeeze", "permute", "transpose",
                    "contiguous"})


def _name(target: Any) -> str:
    """A node's function or method, by name."""
    return target if isinstance(target, str) else getattr(target, "__name__", "")


#: what each kind of step a handler takes is, in words
_STEPS = {"native": "an op run as its gradient", "node": "a relevance node", "zeroed": "zeros written in place",
          "embedded": "a token embedding"}


def _innermost(n: fx.Node) -> str:
    """The innermost module of the stack a node was issued in (Dynamo's name for it)."""
    return next(reversed((n.meta.get("nn_module_stack") or {}).values()), ("",))[0]


def decide(gm: fx.GraphModule, model: nn.Module, composite: RuleSource, values: list[Any],
           inputs: dict[fx.Node, int], leaves: tuple[Tensor, ...], prefix: str,
           only: set[fx.Node] | None = None) -> dict[fx.Node, Decision]:
    """Each node's decision, from one run of ``gm`` on ``values`` (its inputs) under interception in gradient form.

    ``inputs``: the placeholders of the model inputs ``leaves``, by position; ``only``: the nodes run (else all).
    Raises :class:`CannotCompile` with the reason where a node has no traceable form.
    """
    tokens = [i for i, x in enumerate(leaves) if not x.is_floating_point()]
    decider = Decider(model, composite, tuple(leaves[i] for i in tokens))
    interpreter = _Deciding(gm, decider, prefix, inputs, tokens, only)
    try:
        with torch.enable_grad():
            interpreter.run(*values)
    except CannotCompile:
        raise
    except Exception as error:  # under interception the same error is raised again with its op and module
        raise CannotCompile(f"relprop: deciding the rules raised {type(error).__name__}: {error}") from error
    finally:
        decider.context.clear()
    return interpreter.decisions


def _function(n: fx.Node) -> Callable:
    """The function a node calls (a method by its name on ``Tensor``)."""
    return cast(Callable, getattr(torch.Tensor, n.target) if isinstance(n.target, str) else n.target)
