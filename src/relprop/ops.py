"""Op families: how each torch function is intercepted (docs/design.md, section 3).

:data:`HANDLERS` maps a torch function (``torch.conv2d``, ``Tensor.add``,
``F.relu``, ...) to a handler ``(host, func, args, kwargs) -> output``, where
``host`` is the engine as an :class:`OpHost`. A handler either runs the
function as it is (routing ops, whose gradient re-routes relevance exactly)
or builds an op call for the engine to run with a rule. Functions missing
from the table are reported by the engine when relevance flows through them.
The table is strict: a name this torch lacks raises at import (:func:`_lookup`).
"""
from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from .graph import (AddCall, InPlaceSumCall, OpCall, OpKind, ParametricCall, Workspace, is_activation, substitute,
                    sum_to, write_into)
from .quantized import QUANTIZED_HANDLERS
from .recurrent import RECURRENT_HANDLERS
from .rules import Gradient, Pass
from .tracking import AliasTracker, aliases

if TYPE_CHECKING:
    from .rules import Rule

__all__ = ["HANDLERS", "ALWAYS_HANDLED", "ROUTING_HANDLERS", "OpHost", "ProductCall", "SoftmaxCall", "MaxPoolCall",
           "AttentionCall", "dense_transpose", "from_aten", "has_activation", "has_parameter", "op_name"]


class OpHost(Protocol):
    """What an op handler may use of the engine (:class:`relprop.engine.Session` implements it).

    A handler ``handler(host, func, args, kwargs) -> output`` either runs ``func`` as it is or makes an op call
    (:meth:`record`, or a call class of its kind) and runs it with a rule (:meth:`run`).
    """

    #: producers, tags, readers and in-place overwrites of the activations
    aliases: AliasTracker
    #: scratch memory the parametric op calls share
    workspace: Workspace
    #: tap output -> its record (a BatchNorm merged across a tap keeps it)
    tapped: Any

    @property
    def module_name(self) -> str:
        """The dotted path of the module that issues the op."""

    def record(self, kind: OpKind, func: Callable, args: tuple, kwargs: dict,
               linearised: Callable | None = None) -> OpCall:
        """An op call of ``kind``, issued by the current module."""

    def run(self, call: OpCall, rule: Rule | None = None, source: str = ...) -> Any:
        """Run ``call`` as a relevance node with its rule (``rule``, or the composite's choice)."""

    def rule_for(self, call: OpCall) -> tuple[Rule | None, str]:
        """The composite's rule for ``call``, and where it came from."""

    def module_rule(self) -> Rule | None:
        """The rule set on the current module as ``module.rule``, if any."""

    def unknown(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """An op without a rule: its plain gradient, reported if relevance flows through it."""

    def fed_by_input(self, x: Tensor) -> bool:
        """Whether ``x`` comes from a model input through routing ops only."""

    def token_embedding(self, ids: Any, vectors: Tensor) -> Tensor:
        """Embedded vectors of an integer model input, as leaves that collect its tokens' relevance."""

    def tap(self, value: Any, record: Any) -> Any:
        """``value`` behind a tap node that hands the relevance reaching it to ``record``."""

    def __enter__(self) -> Any:
        """Back in the mode, inside a handler: the ops of a decomposition get their rules."""

    def __exit__(self, *exc: Any) -> Any: ...


Handler = Callable[[OpHost, Callable, tuple, dict], Any]


def op_name(func: Callable) -> str:
    """A readable name for a torch function: ``torch.nn.functional.linear``, ``torch.conv2d``, ``Tensor.add``."""
    try:
        return _cached_name(func)
    except TypeError:  # an unhashable callable: named each time
        return _function_name(func)


def _function_name(func: Callable) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if getattr(F, name, None) is func:
        return f"torch.nn.functional.{name}"
    if getattr(torch, name, None) is func:
        return f"torch.{name}"
    if getattr(func, "__objclass__", None) is not None or "TensorBase" in getattr(func, "__qualname__", ""):
        return f"Tensor.{name}"
    return f"{getattr(func, '__module__', None) or 'torch'}.{name}"


#: every op call is named: the same few functions, many times
_cached_name = functools.lru_cache(maxsize=4096)(_function_name)


def has_activation(args: tuple, kwargs: dict) -> bool:
    """Whether any argument (or element of a list argument) is an activation."""
    for value in (*args, *kwargs.values()):
        if is_activation(value):
            return True
        if isinstance(value, (list, tuple)) and any(is_activation(v) for v in value):
            return True
    return False


def has_parameter(args: tuple, kwargs: dict) -> bool:
    """Whether any argument (or element of a list argument) is a tensor that requires grad (a parameter)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor) and value.requires_grad:
            return True
        if isinstance(value, (list, tuple)) and any(isinstance(v, Tensor) and v.requires_grad for v in value):
            return True
    return False


@functools.cache
def _signature(func: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):
        return None


@functools.cache
def _parameters(func: Callable) -> tuple[tuple[str, ...], tuple[str, ...], frozenset[str], dict[str, Any]] | None:
    """``func``'s parameter names in order, the positional ones, the keyword ones and the defaults.

    None if ``func`` takes ``*args`` or ``**kwargs``.
    """
    parameters = _signature(func).parameters.values()  # type: ignore[union-attr]
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
        return None
    return (tuple(p.name for p in parameters),
            tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)),
            frozenset(p.name for p in parameters if p.kind != p.POSITIONAL_ONLY),
            {p.name: p.default for p in parameters if p.default is not p.empty})


def _bind(func: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``func``'s arguments by name in the order of its parameters, defaults included."""
    found = _parameters(func)
    if found is not None and len(args) <= len(found[1]):
        # the common case bound by hand: Signature.bind costs more than many a small op it serves
        names, positional, keywords, defaults = found
        given = positional[:len(args)]
        if keywords.issuperset(kwargs) and kwargs.keys().isdisjoint(given):
            values = {**defaults, **dict(zip(given, args)), **kwargs}
            if len(values) == len(names):  # every parameter has a value
                return {name: values[name] for name in names}
    bound = _signature(func).bind(*args, **kwargs)  # type: ignore[union-attr]  # raises TypeError on bad arguments
    bound.apply_defaults()
    return dict(bound.arguments)


# ---------------------------------------------------------------- routing

def _run(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """Routing ops and constants: the plain gradient re-routes relevance exactly.

    A tag of the first argument (gate, attention weights) carries over: a
    reshaped or cast gate is still a gate.
    """
    out = func(*args, **kwargs)
    session.aliases.routed(args, kwargs, out)
    return out


#: the rule of a routing op that mixes in constants: its gradient routes relevance exactly
_ROUTES = Gradient()


def _combine(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``cat``, ``stack``, ``where``: routing, but as a node with its rule where constant tensors are mixed in.

    The relevance of a learned token concatenated to the activations (a
    ViT's class token) stops at that constant, like a bias's share: as a
    node, the op shows it in the audit as absorbed. Gates combined with gates
    or constants stay gates (PhiMoE's router weight scattered into zeros).
    """
    tensors = [value for value in (*args, *kwargs.values()) for value in
               (value if isinstance(value, (list, tuple)) else (value,)) if isinstance(value, Tensor)]
    tags = {session.aliases.tag(t) for t in tensors if is_activation(t)}
    if all(is_activation(t) or t.dtype == torch.bool for t in tensors):
        out = _run(session, func, args, kwargs)
    else:
        out = session.run(session.record(OpKind.SUM, func, args, kwargs), _ROUTES,
                          "routing with constants")
    if len(tags) == 1 and (tag := tags.pop()) is not None:
        session.aliases.set_tag(out, tag)
    return out


def _run_in_place(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """In-place routing (``x[i] = v``, ``masked_fill_``): first keep what rules saved of the target."""
    session.aliases.protect(args[0])
    out = func(*args, **kwargs)
    if isinstance(args[0], Tensor):
        session.aliases.overwritten(args[0])
    return out


def _scatter_reduce(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``scatter_reduce``: a sum for ``"sum"`` and ``"mean"``, winner-take-all (routing) for ``"amax"``/``"amin"``."""
    reduce = _bind_builtin(("input", "dim", "index", "src", "reduce"), args, kwargs).get("reduce")
    if reduce in ("sum", "mean"):
        return _sum(session, func, args, kwargs)
    if reduce in ("amax", "amin"):
        return _run(session, func, args, kwargs)
    return session.unknown(func, args, kwargs)


def _index_put(routing: Handler) -> Handler:
    """``index_put``: routing, unless it adds the values to the entries (``accumulate=True``): then a sum."""
    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        if not _bind_builtin(("input", "indices", "values", "accumulate"), args, kwargs).get("accumulate", False):
            return routing(session, func, args, kwargs)
        if routing is _run:
            return _sum(session, func, args, kwargs)
        return _in_place(_T.index_put, _sum)(session, func, args, kwargs)
    return handle


# ---------------------------------------------------------------- in place

def _in_place_pass(session: OpHost, func: Callable, args: tuple, kwargs: dict, handler: Handler) -> Tensor | None:
    """Run an elementwise in-place op as it is, when its rule passes relevance through; else None.

    The rule then reads nothing but the input's shape, so the op may overwrite
    its input as in the plain model: no new tensor, no copy back. This is the
    in-place ReLU of most CNNs. The output gets the tag ``handler`` would give it.
    """
    call = session.record(OpKind.ELEMENTWISE, func, args, kwargs)
    rule, source = session.rule_for(call)
    if len(call.inputs) != 1 or type(rule) is not Pass:
        return None
    zeroed = session.aliases.in_place_relu(call)
    out = session.run(call, rule, source)
    if zeroed is not None:
        session.aliases.zeroed_by(out, zeroed)
    session.aliases.set_tag(out, getattr(handler, "tag", None))
    return out


def _in_place(out_of_place: Callable, handler: Handler, keeps_input: bool = True) -> Handler:
    """Handle ``x.op_(...)`` as ``x.copy_(op(x, ...))``, or as it is (see :func:`_in_place_pass`).

    If the op's rule may keep its input for the backward pass
    (``keeps_input``), it works on a copy of the target, so that nothing it
    saved changes; ``copy_`` keeps the in-place meaning for callers that
    ignore the result. Other arguments that share the target's memory
    (``x.add_(x)``) would change with it: the rule reads copies of them.
    """
    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        target = args[0]
        if keeps_input:  # one copy serves this op's rule and the target's producer
            source = target.clone()
            session.aliases.protect(target, copy=source)
            if (tag := session.aliases.tag(target)) is not None:  # `weights /= weights.sum()` keeps a gate a gate
                session.aliases.set_tag(source, tag)
            args = tuple(source if a is target else a.clone() if aliases(a, target) else a for a in args)
            kwargs = {key: a.clone() if aliases(a, target) else a for key, a in kwargs.items()}
        else:
            session.aliases.before_in_place(func, target)
            if (out := _in_place_pass(session, func, args, kwargs, handler)) is not None:
                return out
        result = handler(session, out_of_place, args, kwargs)
        if not keeps_input:  # the op just recorded reads `target`: it keeps a copy
            session.aliases.before_write(target)
        return session.aliases.overwritten(write_into(target, result), result)
    return handle


def _in_place_sum(out_of_place: Callable, sign: int) -> Handler:
    """``x += y``, ``x.add_(y, alpha=a)``, ``x.sub_(y)``: run in place as in the plain model.

    One copy of ``x`` serves the sum's rule and ``x``'s producer, as in
    :func:`_in_place`, but nothing is computed out of place and copied back:
    one new tensor and two passes over memory fewer on every residual
    connection. Other cases (``y`` sharing memory with ``x``, ``x`` a view, a
    scalar ``y``, mixed dtypes) go the general way.
    """
    general = _in_place(out_of_place, _sum)

    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        bound = _bind_builtin(("input", "other"), args, kwargs)
        target, other = bound.get("input"), bound.get("other")
        if not (is_activation(target) and target._base is None and isinstance(other, Tensor)
                and other.dtype == target.dtype and set(bound) <= {"input", "other", "alpha"}
                and not aliases(other, target)):
            return general(session, func, args, kwargs)
        before = target.detach().clone()
        session.aliases.protect(target, copy=before)
        call = InPlaceSumCall(func, args, kwargs, op_name(func), session.module_name, before,
                              sign * bound.get("alpha", 1), session.aliases.producer(target))
        out = session.run(call)
        session.aliases.set_tag(out, None)
        return out
    return handle


def _with_inplace_flag(handler: Handler) -> Handler:
    """Functional ops with an ``inplace=`` argument (``F.relu(x, inplace=True)``)."""
    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        bound = _bind(func, args, kwargs)
        if not bound.get("inplace", False):
            return handler(session, func, args, kwargs)
        bound["inplace"] = False
        target = next(iter(bound.values()))
        if not is_activation(target):
            return func(*args, **kwargs)
        session.aliases.before_in_place(func, target)  # elementwise rules keep nothing of their input: no copy
        if (out := _in_place_pass(session, func, args, kwargs, handler)) is not None:
            return out
        result = handler(session, func, (), bound)
        session.aliases.before_write(target)  # the op just recorded reads `target`: it keeps a copy
        return session.aliases.overwritten(write_into(target, result), result)
    return handle


# ---------------------------------------------------------------- parametric

_CONV = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_TRANSPOSE = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
_LINEAR = ("input", "weight", "bias")


def _conv_vjp(x: Tensor, weight: Tensor, options: dict, transposed: bool) -> Callable[[Tensor], Tensor] | None:
    """The VJP of a convolution with respect to its input, as one transposed convolution (no autograd)."""
    dims = weight.dim() - 2

    def expand(value: Any) -> list[int]:
        return [value] * dims if isinstance(value, int) else list(value)

    padding = options.get("padding", 0)
    if isinstance(padding, str):  # "same" / "valid": leave it to autograd
        return None
    stride, padding, dilation = expand(options.get("stride", 1)), expand(padding), expand(options.get("dilation", 1))
    output_padding = expand(options.get("output_padding", 0)) if transposed else [0] * dims
    groups = options.get("groups", 1)

    def transpose(grad: Tensor, weight: Tensor = weight, like: Tensor | None = None) -> Tensor:
        # the kernel reads only the shape of the input `like`
        return torch.ops.aten.convolution_backward(grad, x if like is None else like, weight, None, stride, padding,
                                                   dilation, transposed, output_padding, groups,
                                                   [True, False, False])[0]
    return transpose


#: a dense layer's transposed product ``grad @ W`` counts the nonzero entries of ``grad`` from this many
#: multiply-adds on (one pass over ``grad``: well under 1% of such a product) ...
SPARSE_PRODUCT_SIZE = 1 << 24
#: ... and skips its zeros where at most this share of its entries is nonzero
SPARSE_SHARE = 1 / 64


def dense_transpose(grad: Tensor, weight: Tensor) -> Tensor:
    """The VJP of a dense layer with respect to its input, ``grad @ weight`` (``weight``: out x in features).

    Relevance is often zero in most of its entries: explaining one logit of a
    language-model head puts it in one entry of ``(tokens, vocabulary)``, and
    a classifier that reads one token of a sequence (BERT's ``[CLS]``) hands
    relevance to that token's row alone. There the product skips the zeros:
    where at most half the rows of ``grad`` hold relevance, those rows are
    multiplied alone; else the rows of ``weight`` that the nonzero entries
    select are scaled and summed. Both equal the dense product up to the
    order of its sums (one row of ``weight``, scaled, is bitwise the dense
    product's row). On a CPU only: the count is needed on the host, and on a
    GPU reading it waits for every kernel queued before.
    """
    if grad.device.type != "cpu" or grad.numel() * weight.shape[1] < SPARSE_PRODUCT_SIZE:
        return grad @ weight
    flat = grad.reshape(-1, grad.shape[-1])
    if int(torch.count_nonzero(flat)) > SPARSE_SHARE * flat.numel():  # NaN and inf count as nonzero
        return grad @ weight
    rows, columns = flat.nonzero(as_tuple=True)
    held = rows.unique_consecutive()  # the entries come row by row
    out = flat.new_zeros(len(flat), weight.shape[1])
    if 2 * len(held) <= len(flat):
        out.index_copy_(0, held, flat[held] @ weight)
    else:
        out.index_add_(0, rows, flat[rows, columns].unsqueeze(1) * weight[columns])
    return out.view(*grad.shape[:-1], weight.shape[1])


def _parametric(kind: OpKind, names: tuple[str, ...]) -> Handler:
    """Convolutions and dense layers: ``f(x; weight, bias)``, rule from the composite."""
    transposed = names is _CONV_TRANSPOSE

    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        bound = _bind_builtin(names, args, kwargs)
        x, original_weight, original_bias = bound.get("input"), bound.get("weight"), bound.get("bias")
        if not is_activation(x):
            return func(*args, **kwargs)
        # rules see constants; weights computed from the input count as constants too
        weight = original_weight.detach()  # type: ignore[union-attr]
        bias = original_bias.detach() if original_bias is not None else None
        options = {key: value for key, value in bound.items() if key not in _LINEAR}
        transpose: Callable[..., Tensor] | None
        channel_dim: int | None

        def evaluate(inp: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
            return func(inp, w, b, **options)

        if kind == OpKind.DENSE:
            transpose, channel_dim = (lambda grad, w=weight, like=None: dense_transpose(grad, w)), 0  # shape from w
        else:
            transpose = _conv_vjp(x.detach(), weight, options, transposed)
            # a merged BatchNorm scales the weight's output-channel dimension: 1 for transposed
            # convolutions, which holds output channels only for groups == 1
            channel_dim = (1 if options.get("groups", 1) == 1 else None) if transposed else 0
        # the forward value comes from the model's own parameters: some kernels choose by requires_grad
        call = ParametricCall(kind, func, (x, _constant(original_weight), _constant(original_bias)), options,
                              op_name(func), session.module_name, weight, bias, evaluate, channel_dim, transpose,
                              session.workspace, is_first=session.fed_by_input(x),
                              input_nonnegative=session.aliases.relu_output(x))
        return session.run(call)
    return handle


def _addmm(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``addmm(bias, x, W)`` with a constant ``W`` (in x out), as Hugging Face's ``Conv1D`` writes a dense layer."""
    bound = _bind_builtin(("input", "mat1", "mat2"), args, kwargs)
    bias, x, weight = bound.get("input"), bound.get("mat1"), bound.get("mat2")
    if is_activation(weight) or is_activation(bias) or set(bound) - {"input", "mat1", "mat2"}:
        return _ADD_PRODUCTS["addmm"](session, func, args, kwargs)
    if not is_activation(x):
        return func(*args, **kwargs)
    return _dense_by_matrix(session, func, (bias, x, weight), x, weight, bias)  # type: ignore[arg-type]


def _matrix_product(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``x @ C`` with a constant floating-point matrix ``C`` (in x out) is a dense layer written by hand
    (``x @ self.weight.T``): the composite's rule for dense layers. Every other matrix product is a product."""
    if (len(args) == 2 and not kwargs and is_activation(args[0]) and args[0].dim() >= 2
            and isinstance(args[1], Tensor) and not is_activation(args[1]) and args[1].dim() == 2
            and args[1].is_floating_point()):
        return _dense_by_matrix(session, func, args, args[0], args[1], None)
    return _MATRIX(session, func, args, kwargs)


def _dense_by_matrix(session: OpHost, func: Callable, args: tuple, x: Tensor, weight: Tensor,
                     bias: Tensor | None) -> Any:
    """A dense layer ``x @ weight (+ bias)`` with its weight as in x out (``func(*args)`` computes it)."""
    def evaluate(inp: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return inp @ w if b is None else torch.addmm(b, inp, w)

    constants = (weight.detach(), bias.detach() if bias is not None else None)
    call = ParametricCall(OpKind.DENSE, func, tuple(_constant(a) if a is not x else a for a in args), {},
                          op_name(func), session.module_name, *constants, evaluate, 1,
                          lambda grad, w=constants[0], like=None: dense_transpose(grad, w.T), session.workspace,
                          is_first=session.fed_by_input(x), input_nonnegative=session.aliases.relu_output(x))
    return session.run(call)


def _constant(value: Any) -> Any:
    """``value`` as a constant of an op: activations detached, parameters and others as they are."""
    return value.detach() if is_activation(value) else value


def _bind_builtin(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, Any]:
    """Arguments of a builtin (which has no signature to bind with) by name."""
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


# ---------------------------------------------------------------- fused ops, decomposed

def _decomposed(names: tuple[str, ...], decompose: Callable[..., Tensor]) -> Handler:
    """An op whose output is its fused kernel's, and whose relevance flows through ``decompose``.

    ``decompose`` computes the same function with ops that carry rules
    (``addcmul(a, b, c, value=v)`` as ``a + v * (b * c)``), each getting its
    rule as if the model had written it out. ``names`` name the op's
    positional arguments.
    """
    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        with torch.no_grad():
            out = func(*args, **kwargs)
        with session:  # back in the mode: each op of the decomposition gets its rule
            source = decompose(**_bind_builtin(names, args, kwargs))
        return substitute(out, source)
    return handle


def _scaled(value: Tensor, factor: Any) -> Tensor:
    return value if isinstance(factor, (int, float)) and factor == 1 else value * factor


def _beta_plus(input: Tensor, product: Tensor, beta: Any = 1, alpha: Any = 1) -> Tensor:
    """``beta * input + alpha * product``; with ``beta == 0`` the input is ignored, as the fused ops do."""
    product = _scaled(product, alpha)
    return product if isinstance(beta, (int, float)) and beta == 0 else _scaled(input, beta) + product


_ADD_PRODUCTS: dict[str, Handler] = {
    "addcmul": _decomposed(("input", "tensor1", "tensor2"),
                           lambda input, tensor1, tensor2, value=1: input + _scaled(tensor1 * tensor2, value)),
    "addcdiv": _decomposed(("input", "tensor1", "tensor2"),
                           lambda input, tensor1, tensor2, value=1: input + _scaled(tensor1 / tensor2, value)),
    "lerp": _decomposed(("input", "end", "weight"), lambda input, end, weight: input + weight * (end - input)),
    "addmm": _decomposed(("input", "mat1", "mat2"),
                         lambda input, mat1, mat2, **scales: _beta_plus(input, mat1 @ mat2, **scales)),
    "baddbmm": _decomposed(("input", "batch1", "batch2"),
                           lambda input, batch1, batch2, **scales: _beta_plus(input, batch1 @ batch2, **scales)),
    "addbmm": _decomposed(("input", "batch1", "batch2"),
                          lambda input, batch1, batch2, **scales: _beta_plus(input, (batch1 @ batch2).sum(0),
                                                                             **scales)),
    "addmv": _decomposed(("input", "mat", "vec"),
                         lambda input, mat, vec, **scales: _beta_plus(input, mat @ vec, **scales)),
}


def _norm(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """A vector norm: positively homogeneous of degree 1, so ``x * grad ||x||`` sums to ``||x||``.

    The epsilon rule on it (kind ``"sum"``) therefore conserves: ``R_i = R |x_i|^p / ||x||_p^p``. Its
    output is a statistic: in a product (ConvNeXt-V2's ``x * (gx / gx.mean())``) it takes no relevance.
    """
    call = session.record(OpKind.SUM, func, args, kwargs)
    if len(call.inputs) != 1:
        return session.unknown(func, args, kwargs)
    out = session.run(call)
    session.aliases.set_tag(out, "statistic")
    return out


def _grid_sample(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """Sampling the input at grid positions: a weighted sum of its pixels, shared like an interpolation.

    The grid says where to look: like a gate, it takes no relevance, also where a network computes it
    (spatial transformers).
    """
    bound = _bind(func, args, kwargs)
    if not is_activation(bound["input"]):
        return session.unknown(func, args, kwargs)
    bound["grid"] = _constant(bound["grid"])
    return _sum(session, func, (), bound)


# ---------------------------------------------------------------- batch norm

def _batch_norm(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """BatchNorm: merged into the conv/dense op that produced its input, else an affine map."""
    bound = _bind(F.batch_norm, args, kwargs)
    x = bound["input"]
    if not is_activation(x):
        return func(*args, **kwargs)
    producer = session.aliases.producer(x)
    mean, var = bound["running_mean"], bound["running_var"]
    if (not isinstance(producer, ParametricCall) or producer._channel_dim is None
            or bound["training"] or mean is None or session.module_rule() is not None):
        return session.run(session.record(OpKind.BATCHNORM, func, args, kwargs))
    weight = bound["weight"] if bound["weight"] is not None else torch.ones_like(var)
    bias = bound["bias"] if bound["bias"] is not None else torch.zeros_like(mean)
    scale = weight / torch.sqrt(var + bound["eps"])
    shift = bias - mean * scale

    def batch_norm(z: Tensor) -> Tensor:
        return func(z, mean, var, bound["weight"], bound["bias"], False, bound["momentum"], bound["eps"])

    # both modules in the name, so that every merge shows in messages and in the audit
    merged = producer.merge_batch_norm(batch_norm, scale, shift, x, f"{producer.module_name}+{session.module_name}")
    out = session.run(merged, rule=producer.rule)
    record = session.tapped.get(x)
    # a tap between the layer and its BatchNorm moves behind the merged pair: there the relevance arrives
    return out if record is None else session.tap(out, record)


# ---------------------------------------------------------------- linear, parameter-free

def _linear(kind: OpKind, linearised: Callable | None = None) -> Handler:
    """Sums, means, average pooling, interpolation, normalisation: linear in their activations."""
    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        return session.run(session.record(kind, func, args, kwargs, linearised))
    return handle


def _sum(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """Sums, means, average pooling, interpolation: linear, shared by contributions (kind ``"sum"``).

    With one activation, the output keeps its tag: a gate shifted, resampled
    or summed is still a gate (``1 - sigmoid(g)`` in ConViT's gated attention,
    GhostNetV3's ``x * interpolate(sigmoid(r))``).
    """
    return _run_sum(session, session.record(OpKind.SUM, func, args, kwargs))


def _run_sum(session: OpHost, call: OpCall) -> Any:
    """Run a sum's ``call``; with one activation, the output keeps its tag (see :func:`_sum`)."""
    tag = session.aliases.tag(call.activations[0]) if len(call.inputs) == 1 else None
    out = session.run(call)
    if tag is not None:
        session.aliases.set_tag(out, tag)
    return out


def _plain_binary(args: tuple) -> bool:
    """Whether ``args`` are two tensors of one floating dtype and device, or such a tensor and a real number.

    For those, autograd's VJP of a sum or product is the closed form, bitwise: it casts no gradient to
    another dtype or device.
    """
    if len(args) != 2 or not all(isinstance(a, Tensor) or type(a) in (int, float) for a in args):
        return False
    tensors = [a for a in args if isinstance(a, Tensor)]
    return (bool(tensors) and tensors[0].is_floating_point()
            and all(t.dtype == tensors[0].dtype and t.device == tensors[0].device for t in tensors))


def _add(sign: int) -> Handler:
    """``x + alpha * y`` (``sign`` 1) and ``x - alpha * y`` (-1): a sum with a closed-form VJP (:class:`AddCall`).

    Other forms (keyword tensors, ``out=``, mixed dtypes, a complex or tensor ``alpha``) go as any sum.
    """
    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        alpha = kwargs.get("alpha", 1)
        if not (_plain_binary(args) and kwargs.keys() <= {"alpha"} and type(alpha) in (int, float)):
            return _sum(session, func, args, kwargs)
        return _run_sum(session, AddCall(func, args, kwargs, op_name(func), session.module_name, sign * alpha))
    return handle


def _variance(centred: Tensor, dims: tuple[int, ...]) -> Tensor:
    """The (biased) variance of ``centred``, an input less its mean over ``dims``: its mean square.

    ``Tensor.var`` gives the same to rounding, but on a CPU it takes many times as long (on a transformer's
    layer norm input, longer than the layer norm itself).
    """
    return centred.square().mean(dims, keepdim=True)


def _layer_norm(input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None,
                bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Layer norm with the standard deviation held constant; the mean subtraction stays linear."""
    dims = tuple(range(-len(normalized_shape), 0))
    centred = input - input.mean(dims, keepdim=True)
    std = torch.sqrt(_variance(centred.detach(), dims) + eps)
    out = centred / std
    if weight is not None:
        out = out * weight
    return out + bias if bias is not None else out


def _group_norm(input: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None,
                eps: float = 1e-5) -> Tensor:
    """Group norm with the standard deviation held constant."""
    grouped = input.reshape(input.shape[0], num_groups, -1)
    centred = grouped - grouped.mean(-1, keepdim=True)
    std = torch.sqrt(_variance(centred.detach(), (-1,)) + eps)
    out = (centred / std).reshape(input.shape)
    shape = (1, -1) + (1,) * (input.dim() - 2)
    if weight is not None:
        out = out * weight.reshape(shape)
    return out + bias.reshape(shape) if bias is not None else out


def _rms_norm(input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None,
              eps: float | None = None) -> Tensor:
    """RMS norm with the root mean square held constant."""
    dims = tuple(range(-len(normalized_shape), 0))
    eps = torch.finfo(input.dtype).eps if eps is None else eps
    out = input * torch.rsqrt(input.detach().pow(2).mean(dims, keepdim=True) + eps)
    return out * weight if weight is not None else out


# ---------------------------------------------------------------- elementwise

def _elementwise(tag: str | None = None) -> Handler:
    """Elementwise nonlinearities: identity rule by default.

    ``tag`` marks what the output is, for products it later takes part in:
    ``"sigmoid"`` (a gate), ``"activation"`` (gated MLPs: a gate for CP-LRP)
    or ``"statistic"`` (``rsqrt`` of a variance: a constant scaling).
    """
    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        call = session.record(OpKind.ELEMENTWISE, func, args, kwargs)
        if len(call.inputs) != 1:
            return session.unknown(func, args, kwargs)
        out = session.run(call)
        if tag is not None:
            session.aliases.set_tag(out, tag)
        return out
    handle.tag = tag  # type: ignore[attr-defined]
    return handle


# ---------------------------------------------------------------- products

def _product(matrix: bool, divide: bool = False) -> Handler:
    """Products of activations, divisions and matrix products.

    One activation factor: a scaling (``x * c``, ``c / x``), relevance passes,
    except that a matrix product with a constant is a linear map (epsilon
    rule). Two factors: the composite decides (uniform split, or the signal
    takes all where one factor is a gate; a divisor counts as a gate).
    """
    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        call = ProductCall(func, args, kwargs, session.module_name, matrix, divide, session.aliases.tag)
        if len(call.inputs) > 2 and not matrix:  # (an einsum of k factors is split k ways)
            return session.unknown(func, args, kwargs)
        out = session.run(call)
        if call.scaled is not None:
            session.aliases.set_tag(out, call.scaled)
        return out
    return handle


class ProductCall(OpCall):
    """A product of activations, a division or a matrix product, with what each activation factor is.

    Parameters
    ----------
    matrix : bool
        A matrix product: with one activation factor it is a linear map (kind ``sum``).
    divide : bool
        A division: the divisor (the second argument) is a constant scaling of the numerator.
    tag_of : callable
        The tag of an activation (what produced it: ``"sigmoid"``, ``"softmax"``, ...), None if it has none.
    """

    def __init__(self, func: Callable, args: tuple, kwargs: dict, module_name: str, matrix: bool, divide: bool,
                 tag_of: Callable[[Tensor], str | None]) -> None:
        super().__init__(OpKind.PRODUCT, func, args, kwargs, op_name(func), module_name)
        self.matrix = matrix
        #: the tag of an activation scaled by constants: the product's output keeps it (a scaled gate is a gate)
        self.scaled: str | None = None
        if len(self.inputs) == 1 and matrix:
            self.kind = OpKind.SUM
        elif divide:
            self.factors = tuple("divisor" if a is args[1] else None for a in self.activations)
            if self.factors[0] is None:  # a tagged numerator keeps its tag: a renormalised gate is a gate
                self.scaled = tag_of(self.activations[0])
        else:
            self.factors = tuple(tag_of(a) for a in self.activations)
            if len(self.inputs) == 1 and not _gates_a_constant(self.factors[0], args):
                self.scaled, self.factors = self.factors[0], (None,)  # relevance passes
        #: an elementwise product of two activations, or of one and a number (:func:`_plain_binary`): its VJP is
        #: closed-form. Not with a constant tensor: the engine does not follow constants, and one modified in place
        #: before the backward pass would go unnoticed (autograd's saved tensor raises then)
        self._elementwise = (func in _MULTIPLY and not kwargs and self._spec is None and _plain_binary(args)
                             and len(self._slots) == sum(isinstance(a, Tensor) for a in args))

    def _needs_graph(self) -> bool:
        return not self._elementwise and super()._needs_graph()

    def vjp(self, grad: Tensor) -> tuple[Tensor | None, ...]:
        """For ``a * b``: ``grad * b`` for ``a`` and ``grad * a`` for ``b``, each summed to its input's shape.

        As autograd computes it (bitwise), without a graph kept from the forward pass.
        """
        if not self._elementwise:
            return super().vjp(grad)
        # the other factor of each: an input (or a copy of it) or a number
        return tuple(sum_to(grad * self._leaves[1 - slot], x.shape) for slot, x in zip(self._slots, self.inputs))


#: elementwise products whose VJP :class:`ProductCall` computes in closed form
_MULTIPLY = frozenset({torch.mul, Tensor.mul, torch.multiply, Tensor.multiply})


#: gates whose product with a constant tensor gives the relevance to that constant (GRU's ``r * b_hn`` at the
#: first step, an LSTM's ``f * c0``): the constant is the signal, and absorbs it
_ABSORBING_GATES = frozenset({"sigmoid", "statistic", "divisor", "exp"})


def _gates_a_constant(tag: str | None, args: tuple) -> bool:
    """Whether a product of one activation tagged ``tag`` with the constants in ``args`` gates a constant signal.

    A number or a one-element tensor only scales the activation (Gemma-2's ``tanh(z / 30) * 30``), and an
    activation output (CP-LRP's gate of gated MLPs) or a softmax times a constant is a scaling too.
    """
    if tag not in _ABSORBING_GATES:
        return False
    return any(isinstance(a, Tensor) and not is_activation(a) and a.numel() > 1 for a in args)


# ---------------------------------------------------------------- softmax and attention

def _softmax(names: tuple[str, ...] | None) -> Handler:
    """Softmax inside the model; its output is tagged, so that CP-LRP can hold attention weights constant."""
    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        bound = _bind(func, args, kwargs) if names is None else _bind_builtin(names, args, kwargs)
        if bound.get("dim") is None:
            return session.unknown(func, args, kwargs)
        call = SoftmaxCall(func, args, kwargs, session.module_name, bound["dim"])
        if len(call.inputs) != 1:
            return session.unknown(func, args, kwargs)
        out = session.run(call)
        session.aliases.set_tag(out, "softmax")
        return out
    return handle


class SoftmaxCall(OpCall):
    """A softmax along ``dim``."""

    def __init__(self, func: Callable, args: tuple, kwargs: dict, module_name: str, dim: int) -> None:
        super().__init__(OpKind.SOFTMAX, func, args, kwargs, op_name(func), module_name)
        self.dim = dim


_SDPA = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class AttentionCall(OpCall):
    """``F.scaled_dot_product_attention``, decomposed for its rule in the backward pass.

    The forward output is the fused kernel's. In the backward pass the
    attention is recomputed as ``softmax(q k^T * scale + mask) @ v`` (with
    ``is_causal`` and grouped-query heads) and relevance is split over its
    two matrix products and its softmax.
    """

    def __init__(self, func: Callable, args: tuple, kwargs: dict, module_name: str) -> None:
        super().__init__(OpKind.ATTENTION, func, args, kwargs, op_name(func), module_name)
        bound = _bind_builtin(_SDPA, args, kwargs)
        self._parts = {key: _constant(bound.get(key)) for key in _SDPA}
        # a float mask computed from activations (SAM's decomposed relative positions) is a score term too
        self._roles = [key for key in ("query", "key", "value", "attn_mask") if is_activation(bound.get(key))]

    def _needs_graph(self) -> bool:
        return False

    @property
    def parts(self) -> dict[str, Any]:
        """Its arguments by name (``query``, ``key``, ``value``, ``attn_mask``, ``is_causal``, ``scale``, ...)."""
        return self._parts

    @property
    def roles(self) -> tuple[str, ...]:
        """The names of the arguments that are activations, in the order of :attr:`inputs`."""
        return tuple(self._roles)


def _attention(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    return session.run(AttentionCall(func, args, kwargs, session.module_name))


def _multi_head_attention(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``nn.MultiheadAttention``: the native output, relevance through its decomposition into rule-bearing ops."""
    bound = _bind(func, args, kwargs)
    if (bound["bias_k"] is not None or bound["add_zero_attn"]
            or bound["static_k"] is not None or bound["static_v"] is not None):
        return session.unknown(func, args, kwargs)
    output, weights = func(*args, **kwargs)
    with session:  # back in the mode: each op of the decomposition gets its rule
        decomposed = _decomposed_attention(**bound)
    return substitute(output, decomposed), weights


def _decomposed_attention(query: Tensor, key: Tensor, value: Tensor, embed_dim_to_check: int, num_heads: int,
                          in_proj_weight: Tensor | None, in_proj_bias: Tensor | None, out_proj_weight: Tensor,
                          out_proj_bias: Tensor | None, key_padding_mask: Tensor | None = None,
                          attn_mask: Tensor | None = None, use_separate_proj_weight: bool = False,
                          q_proj_weight: Tensor | None = None, k_proj_weight: Tensor | None = None,
                          v_proj_weight: Tensor | None = None, is_causal: bool = False, **_: Any) -> Tensor:
    """``F.multi_head_attention_forward`` (sequence first, no dropout) as linear maps around fused attention."""
    weights = ((q_proj_weight, k_proj_weight, v_proj_weight) if use_separate_proj_weight
               else in_proj_weight.chunk(3))  # type: ignore[union-attr]
    biases = in_proj_bias.chunk(3) if in_proj_bias is not None else (None, None, None)
    length, batch, width = query.shape
    head = width // num_heads

    def heads(t: Tensor) -> Tensor:  # (S, N, E) -> (N, H, S, d)
        return t.reshape(t.shape[0], batch, num_heads, head).permute(1, 2, 0, 3)

    q, k, v = (heads(F.linear(t, w, b)) for t, w, b in zip((query, key, value), weights, biases))
    mask = None
    if attn_mask is not None:  # MultiheadAttention: True = not attended; a float mask is added
        mask = attn_mask.reshape(-1, num_heads, *attn_mask.shape[-2:]) if attn_mask.dim() == 3 else attn_mask
        mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(mask, -math.inf) if mask.dtype == torch.bool \
            else mask
    if key_padding_mask is not None:
        padding = key_padding_mask.reshape(batch, 1, 1, -1)
        padding = torch.zeros(padding.shape, dtype=q.dtype).masked_fill(padding, -math.inf) \
            if padding.dtype == torch.bool else padding
        mask = padding if mask is None else mask + padding
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None)
    return F.linear(out.permute(2, 0, 1, 3).reshape(length, batch, width), out_proj_weight, out_proj_bias)


# ---------------------------------------------------------------- embeddings

def _embedding(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """A lookup of the model's integer input: its vectors collect the relevance of those tokens."""
    bound = _bind(func, args, kwargs)
    if is_activation(bound["weight"]):
        return session.unknown(func, args, kwargs)
    with torch.no_grad():  # a lookup in a parameter table: constant, unless it embeds the model's input
        out = func(*args, **kwargs)
    return session.token_embedding(bound["input"], out)


# ---------------------------------------------------------------- max pooling

def _max_pool(signature: Callable, average: Callable[[dict], Callable[[Tensor], Tensor] | None]) -> Handler:
    """Max pooling: winner-take-all (the gradient) unless a rule asks otherwise.

    ``signature`` is the plain function behind ``F.max_pool2d``'s dispatch, to bind arguments by name.
    """
    def handle(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
        bound = _bind(signature, args, kwargs)
        if bound.get("return_indices"):
            return func(*args, **kwargs)
        return session.run(MaxPoolCall(func, args, kwargs, session.module_name, average(bound)))
    return handle


class MaxPoolCall(OpCall):
    """Max pooling, with the average pooling over the same windows (for proportional rules; None if dilated)."""

    def __init__(self, func: Callable, args: tuple, kwargs: dict, module_name: str,
                 average: Callable[[Tensor], Tensor] | None) -> None:
        super().__init__(OpKind.MAXPOOL, func, args, kwargs, op_name(func), module_name)
        self.average = average


def _window_average(pool: Callable) -> Callable[[dict], Callable[[Tensor], Tensor] | None]:
    def make(bound: dict) -> Callable[[Tensor], Tensor] | None:
        if bound.get("dilation", 1) not in (1, (1,), (1, 1), (1, 1, 1)):
            return None  # average pooling has no dilation: rules that need the average do not apply
        stride = bound.get("stride") or bound["kernel_size"]
        return functools.partial(pool, kernel_size=bound["kernel_size"], stride=stride, padding=bound["padding"],
                                 ceil_mode=bound["ceil_mode"], count_include_pad=True)
    return make


def _adaptive_average(pool: Callable) -> Callable[[dict], Callable[[Tensor], Tensor]]:
    def make(bound: dict) -> Callable[[Tensor], Tensor]:
        return functools.partial(pool, output_size=bound["output_size"])
    return make


# ---------------------------------------------------------------- the table

_T, _nn = torch.Tensor, torch._C._nn
#: how messages name the namespaces that ops are registered from
_NAMESPACES = {id(torch): "torch", id(_T): "Tensor", id(F): "torch.nn.functional", id(_nn): "torch._C._nn",
               id(torch.linalg): "torch.linalg"}
#: names that exist only in some of the torch versions relprop supports: registered where they exist. Any other
#: name this torch lacks is a mistake in the table and raises at import
_OPTIONAL = frozenset({
    "torch._grouped_mm",  # added in torch 2.8 (mixture-of-experts kernels)
})


def _lookup(namespace: Any, names: str) -> list[Callable]:
    """The functions ``names`` (space-separated) of ``namespace``.

    Raises
    ------
    AttributeError
        For a name this torch does not have, unless :data:`_OPTIONAL` lists it: a typo registers nothing otherwise.
    """
    found = []
    for name in names.split():
        func = getattr(namespace, name, None)
        if func is not None:
            found.append(func)
        elif f"{_NAMESPACES[id(namespace)]}.{name}" not in _OPTIONAL:
            raise AttributeError(f"relprop: the op table registers {_NAMESPACES[id(namespace)]}.{name}, which torch "
                                 f"{torch.__version__} does not have (list it in ops._OPTIONAL if only some torch "
                                 "versions have it)")
    return found


def _torch_and_tensor(names: str) -> list[Callable]:
    """``torch.name`` and ``Tensor.name`` for each of ``names``: the two namespaces of most tensor ops."""
    return _lookup(torch, names) + _lookup(_T, names)


HANDLERS: dict[Callable, Handler] = {}


def _register(handler: Handler, *funcs_lists: list[Callable]) -> None:
    for funcs in funcs_lists:
        for func in funcs:
            HANDLERS[func] = handler


# each list below names torch and Tensor functions once; functions of one namespace only are listed apart
_register(
    _run,
    _torch_and_tensor(
        "reshape flatten unflatten permute transpose swapaxes swapdims t squeeze unsqueeze split chunk tensor_split "
        "narrow select index_select gather take_along_dim movedim moveaxis unbind roll flip fliplr flipud rot90 "
        "masked_select masked_fill broadcast_to tile repeat_interleave diagonal tril triu max min amax amin maximum "
        "minimum fmax fmin sort topk kthvalue median clone detach split_with_sizes ravel"),
    _lookup(torch, "constant_pad_nd dropout alpha_dropout feature_alpha_dropout feature_dropout channel_shuffle "
                   "pixel_shuffle pixel_unshuffle atleast_1d atleast_2d atleast_3d _pack_padded_sequence "
                   "_pad_packed_sequence"),
    _lookup(_T, "view view_as reshape_as expand expand_as repeat contiguous to float double half bfloat16 type "
                "type_as cpu cuda __getitem__ unfold as_strided"),
    _lookup(F, "pad dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout pixel_shuffle "
               "pixel_unshuffle channel_shuffle unfold max_pool1d_with_indices "
               "max_pool2d_with_indices max_pool3d_with_indices"),
    [_T.T.__get__, _T.mT.__get__, _T.data.__get__],  # type: ignore[attr-defined]
)
_register(_combine, _torch_and_tensor("where scatter index_copy masked_scatter"),
          _lookup(torch, "cat concat concatenate stack hstack vstack dstack"))
# metadata, comparisons and other outputs without a gradient: nothing to propagate
_register(_run, _torch_and_tensor("numel is_floating_point is_complex eq ne gt lt ge le argmax argmin argsort "
                                  "isfinite isnan isinf any all nonzero count_nonzero equal get_device"),
          _lookup(_T, "dim ndimension size nelement element_size stride storage_offset is_contiguous __len__ __bool__ "
                      "__index__ __int__ __float__ item tolist __eq__ __ne__ __gt__ __lt__ __ge__ __le__ __format__ "
                      "__repr__ data_ptr"),
          [getattr(_T, name).__get__ for name in "shape dtype device ndim requires_grad is_cuda layout grad_fn".split()])
_register(_run_in_place, _lookup(_T, "__setitem__ masked_fill_ copy_ zero_ fill_ index_copy_ index_fill_ scatter_ "
                                     "masked_scatter_"))

_register(_parametric(OpKind.CONV, _CONV), _lookup(torch, "conv1d conv2d conv3d"))
_register(_parametric(OpKind.CONV, _CONV_TRANSPOSE), _lookup(torch, "conv_transpose1d conv_transpose2d conv_transpose3d"))
_register(_parametric(OpKind.DENSE, _LINEAR), [F.linear])
_register(_addmm, [torch.addmm, _T.addmm])
_register(_batch_norm, [F.batch_norm])

# F.fold adds overlapping patches: a sum (its gradient would copy each pixel's relevance to every patch)
_register(_sum, _torch_and_tensor("sum mean nansum cumsum"), _lookup(torch, "rsub"),
          _lookup(_T, "__radd__ __rsub__"), [F.fold])
_register(_sum, _lookup(torch, "avg_pool1d"), _lookup(_nn, "avg_pool2d avg_pool3d"),
          _lookup(F, "adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d interpolate upsample "
                     "upsample_bilinear upsample_nearest"))
# sums into entries chosen by an index (a mixture of experts adding each expert's output to its tokens' rows)
_register(_sum, _torch_and_tensor("index_add scatter_add"))
_register(_in_place(_T.index_add, _sum), _lookup(_T, "index_add_"))
_register(_in_place(_T.scatter_add, _sum), _lookup(_T, "scatter_add_"))
_register(_index_put(_run), _torch_and_tensor("index_put"))
_register(_scatter_reduce, _torch_and_tensor("scatter_reduce"))
_register(_index_put(_run_in_place), _lookup(_T, "index_put_"))
_register(_add(1), _torch_and_tensor("add"))
_register(_add(-1), _torch_and_tensor("sub"))
_register(_in_place_sum(_T.add, 1), _lookup(_T, "add_ __iadd__"))
_register(_in_place_sum(_T.sub, -1), _lookup(_T, "sub_ __isub__"))

_register(_linear(OpKind.NORM, _layer_norm), [F.layer_norm])
_register(_linear(OpKind.NORM, _group_norm), [F.group_norm])
_register(_linear(OpKind.NORM, _rms_norm), _lookup(F, "rms_norm"))

_elementwise_pass = _elementwise()
_activation = _elementwise("activation")
_register(_elementwise_pass, _torch_and_tensor("expm1 log log1p log2 sqrt abs neg negative square reciprocal pow "
                                                "clamp clip sin cos erf"),
          _lookup(_T, "__neg__ __pow__ __abs__"), _lookup(F, "normalize"))
_register(_activation, _torch_and_tensor("relu tanh"),
          _lookup(F, "gelu softplus logsigmoid softsign tanhshrink prelu tanh"))
_register(_with_inplace_flag(_activation),
          _lookup(F, "relu relu6 hardtanh leaky_relu elu selu celu silu mish hardswish rrelu threshold"))
_register(_elementwise("statistic"), _torch_and_tensor("rsqrt"))
# an exponential multiplying a signal weighs it (RWKV's stabilised exp-weighted average, a state space model's
# decay exp(A dt)): relevance carried through exp into a log-domain argument has no reference point
_register(_elementwise("exp"), _torch_and_tensor("exp exp2"))
_register(_in_place(_T.exp, _elementwise("exp"), keeps_input=False), _torch_and_tensor("exp_"))
_register(_elementwise("sigmoid"), _torch_and_tensor("sigmoid"), [F.sigmoid])
_register(_with_inplace_flag(_elementwise("sigmoid")), [F.hardsigmoid])
for _name in "relu sqrt rsqrt abs neg reciprocal pow clamp clip tanh".split():
    # Tensor.pow_ has no torch.pow_
    _register(_in_place(getattr(_T, _name), _elementwise_pass, keeps_input=False),
              _lookup(_T, f"{_name}_") if _name == "pow" else _torch_and_tensor(f"{_name}_"))
_register(_in_place(_T.sigmoid, _elementwise("sigmoid"), keeps_input=False), _torch_and_tensor("sigmoid_"))
for _function in (F.relu, F.elu, F.leaky_relu, F.hardtanh):
    _register(_in_place(_function, _activation, keeps_input=False), _lookup(F, f"{_function.__name__}_"))

_register(_product(matrix=False), _torch_and_tensor("mul multiply"), _lookup(_T, "__rmul__"))
_register(_product(matrix=False, divide=True), _torch_and_tensor("div divide true_divide"),
          _lookup(_T, "__rdiv__ __rtruediv__ __truediv__"))
_MATRIX = _product(matrix=True)
_register(_matrix_product, _torch_and_tensor("matmul mm"), _lookup(_T, "__matmul__"))
_register(_MATRIX, _torch_and_tensor("bmm"), _lookup(torch, "einsum"), _lookup(_T, "__rmatmul__"))
_register(_in_place(_T.mul, _product(matrix=False)), _lookup(_T, "mul_ __imul__"))
_register(_in_place(_T.div, _product(matrix=False, divide=True)), _lookup(_T, "div_ __itruediv__"))

for _name, _handler in _ADD_PRODUCTS.items():
    if _name != "addmm":  # a dense layer, unless both factors are activations (`_addmm`)
        _register(_handler, _torch_and_tensor(_name))
    _register(_in_place(getattr(_T, _name), _handler), _lookup(_T, f"{_name}_"))
_register(_norm, _torch_and_tensor("norm"), _lookup(torch.linalg, "norm vector_norm"))
_register(_grid_sample, [F.grid_sample])
_register(_product(matrix=True), _lookup(torch, "_grouped_mm"))
_register(_softmax(None), [F.softmax])
_register(_softmax(("input", "dim", "dtype")), _torch_and_tensor("softmax"))
_register(_attention, [F.scaled_dot_product_attention])
_register(_multi_head_attention, [F.multi_head_attention_forward])
_register(_embedding, [F.embedding])
for _func, _handler in RECURRENT_HANDLERS.items():
    HANDLERS[_func] = _handler
HANDLERS.update(QUANTIZED_HANDLERS)
#: handlers that run even without an activation among the arguments (a lookup of integer token ids)
ALWAYS_HANDLED = frozenset({_embedding})
#: handlers whose ops take no rule from a composite: routing and metadata as they are, in-place writes, and
#: ``cat`` and kin with their fixed rule
ROUTING_HANDLERS = frozenset({_run, _run_in_place, _combine})

for _dims in (1, 2, 3):
    _register(_max_pool(getattr(F, f"_max_pool{_dims}d"), _window_average(getattr(F, f"avg_pool{_dims}d"))),
              [getattr(F, f"max_pool{_dims}d")])
    _register(_max_pool(getattr(F, f"_adaptive_max_pool{_dims}d"),
                        _adaptive_average(getattr(F, f"adaptive_avg_pool{_dims}d"))),
              [getattr(F, f"adaptive_max_pool{_dims}d")])


# ---------------------------------------------------------------- aten ops (torch.export programs)

def _schema_arguments(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    names = [argument.name for argument in op._schema.arguments]
    return {**{argument.name: argument.default_value for argument in op._schema.arguments
               if argument.has_default_value()}, **dict(zip(names, args)), **kwargs}


def _batch_norm_arguments(a: dict) -> tuple:
    return (a["input"], a["running_mean"], a["running_var"], a["weight"], a["bias"], a["training"], a["momentum"],
            a["eps"])


def _embedding_arguments(a: dict) -> tuple:
    return a["indices"], a["weight"], (a["padding_idx"] if a["padding_idx"] >= 0 else None)


#: aten ops whose torch function takes the arguments in another order or fewer of them
_REORDERED: dict[str, tuple[Callable, Callable[[dict], tuple]]] = {
    "batch_norm": (F.batch_norm, _batch_norm_arguments),
    "layer_norm": (F.layer_norm, lambda a: (a["input"], a["normalized_shape"], a["weight"], a["bias"], a["eps"])),
    "group_norm": (F.group_norm, lambda a: (a["input"], a["num_groups"], a["weight"], a["bias"], a["eps"])),
    "embedding": (F.embedding, _embedding_arguments),
}


#: aten ops that copy or gather entries without a torch function of the same name: routing too
_ATEN_ROUTING = frozenset("index _to_copy slice_copy select_copy expand_copy view_copy index_select".split())


def from_aten(op: Any, args: tuple, kwargs: dict) -> tuple[Handler, Callable, tuple, dict] | None:
    """The handler for an aten op overload, with the function and arguments to give it; None if none.

    Programs from ``torch.export`` call aten ops (``torch.ops.aten.conv2d.default``)
    instead of torch functions. An op with a rule resolves to the torch function of
    the same name, which calls that very op, so the forward is unchanged (a few take
    their arguments in another order). Views and copies of entries are routing ops
    and run as they are.
    """
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    resolved = _resolve_aten(op)
    if resolved is None:
        return None
    handler, func, reorder = resolved
    if reorder is not None:
        return handler, func, reorder(_schema_arguments(op, args, kwargs)), {}
    return handler, func, args, kwargs


@functools.cache  # a program calls the same few ops many times
def _resolve_aten(op: torch._ops.OpOverload) -> tuple[Handler, Callable, Callable | None] | None:
    """``op``'s handler, the function to give it and how to reorder its arguments (see :func:`from_aten`)."""
    name = op._opname
    if name in _REORDERED:
        func, reorder = _REORDERED[name]
        return HANDLERS[func], func, reorder
    returns = op._schema.returns
    if name in _ATEN_ROUTING or (returns and returns[0].alias_info is not None and not op._schema.is_mutable):
        return _run, op, None
    for namespace in (torch, F, _nn, _T):
        func = getattr(namespace, name, None)  # type: ignore[assignment]
        if func is not None and func in HANDLERS:
            handler = HANDLERS[func]
            return handler, (op if handler is _run else func), None
    return None
