"""A compiled relevance program: Dynamo's graph of a forward pass, each op rewritten into its rule's gradient form.

``torch.compile`` hands a backend the FX graph of the plain forward pass; each node carries the module that
issued it (``meta["nn_module_stack"]``), and each input the real tensor it was traced with
(``meta["grapharg"].example``). :func:`decide` runs that graph once on those tensors under the interception
engine itself (:class:`Decider`, a :class:`~relprop.engine.Session` whose module context is set from the
node's module instead of module hooks): the same op families, composite and rules decide each node's rule,
in gradient form. :func:`rewrite` then turns each node into a traceable form of that decision
(:class:`Form`): the op as it is, with the inputs its rule holds detached, and where the rule rescales the
op's VJP (:class:`~relprop._core.rule.Scaled`) the detach-and-scale ``z.detach() + (s - s.detach())``, whose
value is the op's bitwise and whose gradient is that of ``s`` (``z`` times the rule's factor, the inputs'
shares). The attribution is then the input times the gradient of the compiled program, as in gradient form
under interception.

Whatever the tier cannot write so raises :class:`CannotCompile` with the reason (an op without a rule, a rule
without a traceable form, a handler that decides across ops such as a BatchNorm merged into its layer, an
in-place ReLU read as zeros, an activation module of another library); the caller falls back to interception.
A graph is rewritten whole or not at all.
"""
from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from relprop._core.gradient_form import InGradientForm
from relprop._core.kinds import OpKind
from relprop._core.registry import HANDLERS, op_name
from relprop._core.rule import Rule, Scaled
from relprop._core.signatures import bind
from relprop._core.tensors import per_unit
from relprop.engine.calls import OpCall
from relprop.engine.compiled_attention import FUSED_ROLES, WrittenAttention, fused_node, written_attention
from relprop.engine.plan import _frozen, _module_rule, _same
from relprop.engine.functions import GradientFormUnavailable, _Unhandled
from relprop.engine.session import RuleSource, Session
from relprop.engine.tracking import maps_zero_to_zero


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

    def enter(self, stack: list[str], prefix: str, alone: bool) -> None:
        """The module context of a node issued inside the modules of ``stack`` (outermost first); ``alone``:
        the node is the only op of its innermost module."""
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
            # rule and tag of an activation: its one op is that, unless a func_map names functions
            if not alone or getattr(self.composite, "func_map", None):
                raise CannotCompile(f"relprop: module '{context.module_name}' is an activation module of another "
                                    "library written as several ops, which interception explains as one")
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
        if self.only is not None and n not in self.only and n.op != "placeholder":  # each takes an argument
            return None  # not the model's (the seed, the backward pass and the products of a whole attribution)
        if n.op not in ("call_function", "call_method"):
            if n.op == "call_module":
                raise CannotCompile(f"relprop: the traced graph calls module '{n.target}' as a whole")
            return super().run_node(n)
        decider = self.decider
        stack = [path for path, _ in (n.meta.get("nn_module_stack") or {}).values()]
        decider.enter(stack, self.prefix, self._ops[_innermost(n)] == 1)
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
            raise CannotCompile(f"relprop: the handler of {op_name(_function(n))} in module "
                                f"'{decider.module_name or '<root>'}' "
                                f"decides across ops ({', '.join(effect[0] for effect in made)})")
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
        wrapped = getattr(rule, "rule", rule)
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
        probe = -1
        if rule is not None and wrapped.fills_zeros:
            probe = self._model_input(layer or n, slots)
            if probe < 0:
                raise CannotCompile(f"relprop: rule {wrapped!r} on {call.describe()} gives inputs of value 0 "
                                    "relevance, and its input is not a model input as it is")
        return Decision(call, rule, slots, probe, layer, attention)

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

    def _model_input(self, n: fx.Node, slots: tuple[int, ...]) -> int:
        """The index of the model input that is ``n``'s one activation (a copy of it, as the model sees it), or -1."""
        leaves, _ = tree_flatten((n.args, n.kwargs))
        source = leaves[slots[0]] if len(slots) == 1 else None
        if isinstance(source, fx.Node) and source.op == "call_method" and source.target == "clone":
            source = source.args[0]
        return self.inputs.get(source, -1) if isinstance(source, fx.Node) else -1


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


def _scaled_by(share: float, x: Tensor) -> Tensor:
    """``x`` with the gradient reaching it scaled by ``share``: its value bitwise, held (detached) for 0."""
    if share == 1:
        return x
    if share == 0:
        return x.detach()
    scaled = x * share
    return x.detach() + (scaled - scaled.detach())


class Form:
    """One node of the rewritten graph: the op, its value as it is, its gradient the rule's gradient form."""

    def __init__(self, func: Callable, decision: Decision, scaled: Scaled | None, linearised: Callable | None,
                 layer: Callable | None = None):
        self.func, self.slots, self.scaled, self.linearised = func, decision.slots, scaled, linearised
        rule = decision.rule
        held = rule.held if isinstance(rule, InGradientForm) and rule.native else ()
        self.shares = (scaled.shares if scaled is not None and scaled.shares else
                       tuple(0.0 if hold else 1.0 for hold in held) or (1.0,) * len(self.slots))
        self.embeds = decision.call is None
        #: the input is a ReLU's output (a parametric call's ``input_nonnegative``)
        self.nonnegative = bool(getattr(decision.call, "input_nonnegative", False))
        #: the function of the layer a BatchNorm is merged into, or where the rule modifies the products, the op's
        self.layer = layer
        self.__name__ = f"relprop_form_{getattr(func, '__name__', 'op')}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        probe = kwargs.pop("relprop_probe", None)
        if self.embeds:  # the vectors times ones of the probe: the tokens' relevance is its gradient
            out = self.func(*args, **kwargs)
            return out * probe.to(out.dtype)
        layer_args, layer_kwargs = kwargs.pop("relprop_layer", (args, kwargs))
        if self.layer is not None:
            return self._parametric(args, kwargs, layer_args, layer_kwargs, probe)
        leaves, spec = tree_flatten((args, kwargs))
        inputs = [leaves[slot] for slot in self.slots]
        for slot, share, x in zip(self.slots, self.shares, inputs):
            leaves[slot] = _scaled_by(share, x)
        moved_args, moved_kwargs = tree_unflatten(leaves, spec)
        scaled = self.scaled
        if scaled is not None and scaled.ratio:  # G_x = G * out / x: x times that ratio
            out = self.func(*args, **kwargs)
            (x,) = inputs
            ratio = per_unit(out.detach(), x.detach().expand_as(out))
            return _substitute(out, x * ratio)
        if self.linearised is None:
            z = self.func(*moved_args, **moved_kwargs)
            if scaled is None or scaled.output is None:
                return z
            return _substitute(z, z * scaled.output(z.detach()))
        value = self.func(*args, **kwargs)
        z = self.linearised(*moved_args, **moved_kwargs)
        return _substitute(value, z if scaled is None or scaled.output is None else z * scaled.output(value.detach()))

    def _parametric(self, args: tuple, kwargs: dict, layer_args: tuple, layer_kwargs: dict,
                    probe: Tensor | None) -> Tensor:
        """A convolution or dense layer (a BatchNorm merged into it where ``args`` are the BatchNorm's)."""
        assert self.layer is not None
        value = self.func(*args, **kwargs)
        x, weight, bias, rest = _parametric_arguments(layer_args, layer_kwargs)
        if self.func is not self.layer:  # batch_norm(f(x; W, b)) = f(x; scale W, scale b + shift)
            bound = bind(F.batch_norm, args, kwargs)
            mean, var = bound["running_mean"], bound["running_var"]
            gamma = bound["weight"] if bound["weight"] is not None else torch.ones_like(var)
            scale = gamma / torch.sqrt(var + bound["eps"])
            shift = (bound["bias"] if bound["bias"] is not None else torch.zeros_like(mean)) - mean * scale
            # a transposed convolution holds its output channels in the weight's second dimension
            transposed = getattr(self.layer, "__name__", "").startswith("conv_transpose")
            weight = weight * scale.reshape(((1, -1) if transposed else (-1,)) + (1,) * (weight.dim() - 1 - transposed))
            bias = shift if bias is None else bias * scale + shift

        def evaluate(inp: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
            return self.layer(inp, w, b, *rest[0], **rest[1])  # type: ignore[misc]

        scaled = self.scaled
        if scaled is not None and scaled.modified is not None:
            return _substitute(value, scaled.modified(evaluate, x, weight, bias, value.detach(), probe,
                                                      self.nonnegative))
        z = evaluate(x, weight, bias)
        return _substitute(value, z if scaled is None or scaled.output is None else z * scaled.output(value.detach()))


def _parametric_arguments(args: tuple, kwargs: dict) -> tuple[Tensor, Tensor, Tensor | None, tuple[tuple, dict]]:
    """``f(input, weight, bias, *rest)`` of a convolution or ``F.linear``: input, weight, bias and the rest."""
    kwargs = dict(kwargs)
    values = list(args[:3])
    for index, name in enumerate(("input", "weight", "bias")):
        if index >= len(values):
            values.append(kwargs.pop(name, None))
    x, weight, bias = values
    return x, weight, bias, (tuple(args[3:]), kwargs)


def _substitute(value: Tensor, surrogate: Tensor) -> Tensor:
    """``value`` bitwise (plus an exact 0), with the gradient of ``surrogate``."""
    return value.detach() + (surrogate - surrogate.detach())


def _function(n: fx.Node) -> Callable:
    """The function a node calls (a method by its name on ``Tensor``)."""
    return cast(Callable, getattr(torch.Tensor, n.target) if isinstance(n.target, str) else n.target)


def _is_view(n: fx.Node) -> bool:
    """Whether the value of ``n`` (as Dynamo traced it) is a view of another tensor."""
    value = n.meta.get("example_value")
    return isinstance(value, Tensor) and value._is_view()


def _out_of_place(n: fx.Node, func: Callable, order: dict[fx.Node, int]) -> Callable:
    """``func`` of ``n`` out of place where it writes into its input (``F.hardswish(x, inplace=True)``,
    ``x.sigmoid_()``): its form reads the input as it was. Only where nothing reads the input after it (which
    would read the written values)."""
    try:
        flag = bind(func, n.args, dict(n.kwargs)).get("inplace")
    except TypeError:  # a builtin without a signature: in place by its name alone
        flag = None
    in_place = flag is True or getattr(func, "__name__", "").endswith("_")
    if not in_place:
        return func
    source = n.args[0] if n.args else None
    # a view shares the written memory with its base: of the source, or the source itself
    if (not isinstance(source, fx.Node) or source.op == "placeholder" or _is_view(source)
            or any(order[user] > order[n] or _is_view(user) for user in source.users if user is not n)):
        raise CannotCompile(f"relprop: {getattr(func, '__name__', func)} writes into a tensor that is read after it "
                            "or through a view")
    if flag is True:  # passed by name or by position
        names = list(inspect.signature(func).parameters)
        position = names.index("inplace")
        if position < len(n.args):
            n.args = (*n.args[:position], False, *n.args[position + 1:])
        else:
            n.kwargs = {**n.kwargs, "inplace": False}
        return func
    return getattr(torch.Tensor, func.__name__[:-1])


def rewrite(gm: fx.GraphModule, decisions: dict[fx.Node, Decision], probes: dict[int, fx.Node]) -> fx.GraphModule:
    """``gm`` with each decided node replaced by its :class:`Form`; ``probes``: the placeholder of each model
    input's probe, by its position (ones: ``ids.shape + (1,)`` for token ids, the input's shape else)."""
    decisions = dict(decisions)
    for n, decision in list(decisions.items()):
        if decision.attention is not None:  # written out: the product's value, the gradient of its fused attention
            fused, users = fused_node(gm.graph, n, decision.attention), list(n.users)
            with gm.graph.inserting_after(fused):
                explained = gm.graph.call_function(_substitute, (n, fused))
            for user in users:
                user.replace_input_with(n, explained)
            del decisions[n]
            decisions[fused] = decision._replace(attention=None)
    # as traced: a merged BatchNorm's layer may be rewritten before it
    functions = {n: _function(n) for n in decisions}
    order = {n: index for index, n in enumerate(gm.graph.nodes)}
    arguments = {n: (n.args, dict(n.kwargs)) for n in decisions}
    # a layer read only by the BatchNorms merged into it: their forms carry its relevance, so it runs as it is
    merged = {n for n in decisions if n.users and all(user in decisions and decisions[user].layer is n
                                                      for user in n.users)}
    for n, decision in decisions.items():
        if n in merged:
            continue
        func = functions[n]
        call, rule = decision.call, decision.rule
        layer = None
        if call is None:  # an embedding of token ids
            form = Form(func, decision, None, None)
        else:
            wrapped = getattr(rule, "rule", rule)
            native = rule is None or (isinstance(rule, InGradientForm) and rule.native)
            scaled = None if native or wrapped is None else wrapped.scaled(call)
            linearised = call.linearised_function if call.linearised else None
            if (decision.layer in merged and decision.probe < 0 and (scaled is None or scaled.modified is None)):
                # the layer runs as it is: through the BatchNorm's own gradient (its scale) and the layer's, a plain
                # rule's gradient is the merged layer's, without a second product of the merged weight
                decision = decision._replace(slots=(0,), layer=None)
            parametric = hasattr(call, "evaluate") and (decision.layer is not None or (
                scaled is not None and scaled.modified is not None))
            if not parametric and native and linearised is None and not (isinstance(rule, InGradientForm)
                                                                         and any(rule.held)):
                continue  # the op's own gradient is its gradient form
            if parametric:
                layer = func if decision.layer is None else functions.get(decision.layer) or _function(decision.layer)
                if decision.layer is not None:
                    n.kwargs = {**n.kwargs, "relprop_layer": arguments.get(decision.layer, (decision.layer.args,
                                                                                            decision.layer.kwargs))}
            func = _out_of_place(n, func, order)
            form = Form(func, decision, scaled, linearised, layer)
        if decision.probe >= 0:
            if decision.probe not in probes:
                raise CannotCompile(f"relprop: the traced graph reads model input {decision.probe} without its probe")
            n.kwargs = {**n.kwargs, "relprop_probe": probes[decision.probe]}
        n.op, n.target = "call_function", form
    gm.graph.lint()
    gm.recompile()
    return gm


class Key:
    """What the decisions of a compiled graph depend on besides the traced ops: the modules, the rules set on them
    and their forward hooks (Dynamo does not guard hooks added after it traced a module), the composite's settings
    and each rule's, as a captured plan's state (``relprop.engine.plan``) but for the modules' paths, which a
    traced graph keeps, and with the hooks."""

    def __init__(self, composite: Any, model: nn.Module, rules: list[Any]):
        self.rules = rules
        self.state = self._of(composite, model)

    def _of(self, composite: Any, model: nn.Module) -> Any:
        modules = list(model.modules())
        own = tuple([_module_rule(module) for module in modules])
        hooks = tuple([(tuple(module._forward_hooks), tuple(module._forward_pre_hooks)) for module in modules])
        registry = nn.modules.module  # and the hooks registered for every module (register_module_forward_hook)
        everywhere = (tuple(registry._global_forward_hooks), tuple(registry._global_forward_pre_hooks))
        return (tuple(modules), own, hooks, everywhere, type(composite), _frozen(vars(composite)),
                tuple([(id(rule), _frozen(vars(rule))) for rule in self.rules]))

    def holds(self, composite: Any, model: nn.Module) -> bool:
        return _same(self._of(composite, model), self.state)
