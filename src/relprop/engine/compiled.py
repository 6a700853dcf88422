"""A compiled relevance program: each decided node of Dynamo's graph rewritten into its rule's gradient form.

:func:`rewrite` turns each node that :func:`relprop.engine.decide.decide` decided into a traceable form of that
decision (:class:`Form`): the op as it is, with the inputs its rule holds detached, and where the rule rescales
the op's VJP (:class:`~relprop._core.rule.Scaled`) the detach-and-scale ``z.detach() + (s - s.detach())``, whose
value is the op's bitwise and whose gradient is that of ``s`` (``z`` times the rule's factor, the inputs'
shares). The attribution is then the input times the gradient of the compiled program, as in gradient form
under interception. A graph is rewritten whole or not at all. What a form holds is :func:`~relprop._core.held.held`:
detached, but in a differentiable pass (``create_graph=True``) kept for the derivative of the relevance.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from relprop._core.gradient_form import InGradientForm, unwrapped
from relprop._core.held import held
from relprop._core.rule import Scaled
from relprop._core.signatures import bind, inplace_position, writes_into
from relprop._core.stabilizers import inverse_denominator
from relprop._core.tensors import agrees, per_unit
from relprop.engine.compiled_attention import fused_node
from relprop.engine.decide import CannotCompile, Decision, _function
from relprop.engine.parametric import batch_norm_affine, scaled_output_channels


def _scaled_by(share: float, x: Tensor) -> Tensor:
    """``x`` with the gradient reaching it scaled by ``share``: its value bitwise, held for 0."""
    if share == 1:
        return x
    if share == 0:
        return held(x)
    return _substitute(x, x * share)


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
            constant = held(x).expand_as(out)
            ratio = (held(out) * inverse_denominator(constant, scaled.stabiliser) if scaled.stabiliser
                     else per_unit(held(out), constant))
            return _substitute(out, x * ratio)
        if self.linearised is None:
            z = self.func(*moved_args, **moved_kwargs)
            if scaled is None or scaled.output is None:
                return z
            return _substitute(z, z * scaled.output(held(z)))
        value = self.func(*args, **kwargs)
        z = self.linearised(*moved_args, **moved_kwargs)
        return _substitute(value, z if scaled is None or scaled.output is None else z * scaled.output(held(value)))

    def _parametric(self, args: tuple, kwargs: dict, layer_args: tuple, layer_kwargs: dict,
                    probe: Tensor | None) -> Tensor:
        """A convolution or dense layer (a BatchNorm merged into it where ``args`` are the BatchNorm's)."""
        assert self.layer is not None
        value = self.func(*args, **kwargs)
        x, weight, bias, rest = _parametric_arguments(layer_args, layer_kwargs)
        if self.func is not self.layer:  # batch_norm(f(x; W, b)) = f(x; scale W, scale b + shift)
            scale, shift = batch_norm_affine(bind(F.batch_norm, args, kwargs))
            # a transposed convolution holds its output channels in the weight's second dimension
            transposed = getattr(self.layer, "__name__", "").startswith("conv_transpose")
            weight = scaled_output_channels(weight, scale, int(transposed))
            bias = shift if bias is None else bias * scale + shift

        def evaluate(inp: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
            return self.layer(inp, w, b, *rest[0], **rest[1])  # type: ignore[misc]

        scaled = self.scaled
        if scaled is not None and scaled.modified is not None:
            return _substitute(value, scaled.modified(evaluate, x, weight, bias, held(value), probe,
                                                      self.nonnegative))
        z = evaluate(x, weight, bias)
        return _substitute(value, z if scaled is None or scaled.output is None else z * scaled.output(held(value)))


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
    return held(value) + (surrogate - held(surrogate))


def _agreeing(value: Tensor, fused: Tensor) -> Tensor:
    """``value`` (attention written out) bitwise, with the gradient of ``fused`` (its fused form) where the two
    agree to rounding, as interception checks on every call; where they do not (the data changed what the traced
    call saw), an infinite gradient, so that the relevance is not finite and the call falls back. The gradient of
    ``2 sqrt(1 + d)`` at ``d = 0`` is 1, exactly; of ``2 sqrt(0 + d)``, infinite."""
    ok = agrees(fused.detach(), value.detach()).to(fused.dtype)
    return _substitute(value, 2 * torch.sqrt(ok + (fused - held(fused))))


def _is_view(n: fx.Node) -> bool:
    """Whether the value of ``n`` (as Dynamo traced it) is a view of another tensor."""
    value = n.meta.get("example_value")
    return isinstance(value, Tensor) and value._is_view()


def _out_of_place(n: fx.Node, func: Callable, order: dict[fx.Node, int]) -> Callable:
    """``func`` of ``n`` out of place where it writes into its input (``F.hardswish(x, inplace=True)``,
    ``x.sigmoid_()``): its form reads the input as it was. Only where nothing reads the input after it (which
    would read the written values)."""
    if not writes_into(func, n.args, dict(n.kwargs)):
        return func
    source = n.args[0] if n.args else None
    # a view shares the written memory with its base: of the source, or the source itself
    if (not isinstance(source, fx.Node) or source.op == "placeholder" or _is_view(source)
            or any(order[user] > order[n] or _is_view(user) for user in source.users if user is not n)):
        raise CannotCompile(f"relprop: {getattr(func, '__name__', func)} writes into a tensor that is read after it "
                            "or through a view")
    position = inplace_position(func)
    if position is not None and (n.kwargs.get("inplace") is True or position < len(n.args)):  # the flag is set
        if position < len(n.args):
            n.args = (*n.args[:position], False, *n.args[position + 1:])
        else:
            n.kwargs = {**n.kwargs, "inplace": False}
        return func
    name = getattr(func, "__name__", "")
    if name.endswith("_") and hasattr(torch.Tensor, name[:-1]):
        return getattr(torch.Tensor, name[:-1])
    raise CannotCompile(f"relprop: {name or func} writes into a tensor, and has no form that does not")


def _viewed(graph: fx.Graph, probe: fx.Node, views: tuple[fx.Node, ...], before: fx.Node) -> fx.Node:
    """``probe`` through the same ``views`` as the model input that ``before`` reads (nodes added before it)."""
    for view in views:
        source, viewed = view.args[0], probe

        def moved(arg: fx.Node, source: Any = source, viewed: fx.Node = viewed) -> Any:
            return viewed if arg is source else arg
        with graph.inserting_before(before):
            probe = graph.node_copy(view, moved)
    return probe


def rewrite(gm: fx.GraphModule, decisions: dict[fx.Node, Decision], probes: dict[int, fx.Node]) -> fx.GraphModule:
    """``gm`` with each decided node replaced by its :class:`Form`; ``probes``: the placeholder of each model
    input's probe, by its position (ones: ``ids.shape + (1,)`` for token ids, the input's shape else)."""
    decisions = dict(decisions)
    for n, decision in list(decisions.items()):
        if decision.attention is not None:  # written out: the product's value, the gradient of its fused attention
            fused, users = fused_node(gm.graph, n, decision.attention), list(n.users)
            with gm.graph.inserting_after(fused):
                explained = gm.graph.call_function(_agreeing, (n, fused))
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
            wrapped = unwrapped(rule)
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
            n.kwargs = {**n.kwargs, "relprop_probe": _viewed(gm.graph, probes[decision.probe], decision.views, n)}
        n.op, n.target = "call_function", form
    gm.graph.lint()
    gm.recompile()
    return gm
