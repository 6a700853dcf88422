"""Op families: how each torch function is intercepted (DESIGN.md section 3).

:data:`HANDLERS` maps a torch function (``torch.conv2d``, ``Tensor.add``,
``F.relu``, ...) to a handler ``(session, func, args, kwargs) -> output``.
A handler either runs the function as it is (routing ops, whose gradient
re-routes relevance exactly) or builds an op call for the engine to run with
a rule. Functions missing from the table are reported by the engine when
relevance flows through them.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .graph import OpCall, ParametricCall

__all__ = ["HANDLERS", "has_activation", "op_name"]

Handler = Callable[[Any, Callable, tuple, dict], Any]


def op_name(func: Callable) -> str:
    """A readable name for a torch function: ``torch.nn.functional.linear``, ``torch.conv2d``, ``Tensor.add``."""
    name = getattr(func, "__name__", None) or repr(func)
    if getattr(F, name, None) is func:
        return f"torch.nn.functional.{name}"
    if getattr(torch, name, None) is func:
        return f"torch.{name}"
    if getattr(func, "__objclass__", None) is not None or "TensorBase" in getattr(func, "__qualname__", ""):
        return f"Tensor.{name}"
    return f"{getattr(func, '__module__', None) or 'torch'}.{name}"


def _is_activation(value: Any) -> bool:
    return isinstance(value, Tensor) and value.requires_grad


def has_activation(args: tuple, kwargs: dict) -> bool:
    """Whether any argument (or element of a list argument) is an activation: a tensor that requires grad."""
    for value in (*args, *kwargs.values()):
        if _is_activation(value):
            return True
        if isinstance(value, (list, tuple)) and any(_is_activation(v) for v in value):
            return True
    return False


@functools.cache
def _signature(func: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):
        return None


def _bind(func: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = _signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


# ---------------------------------------------------------------- routing

def _run(session, func, args, kwargs):
    """Routing ops and constants: the plain gradient re-routes relevance exactly."""
    return func(*args, **kwargs)


def _run_in_place(session, func, args, kwargs):
    """In-place routing (``x[i] = v``, ``masked_fill_``): first keep what rules saved of the target."""
    session.protect(args[0])
    return func(*args, **kwargs)


# ---------------------------------------------------------------- in place

def _in_place(out_of_place: Callable, handler: Handler, keeps_input: bool = True) -> Handler:
    """Handle ``x.op_(...)`` as ``x.copy_(op(x, ...))``.

    If the op's rule may keep its input for the backward pass
    (``keeps_input``), it works on a copy of the target, so that nothing it
    saved changes; ``copy_`` keeps the in-place meaning for callers that
    ignore the result.
    """
    def handle(session, func, args, kwargs):
        target = args[0]
        if not has_activation(args, kwargs):
            return func(*args, **kwargs)
        session.protect(target)
        source = target.clone() if keeps_input else target
        return target.copy_(handler(session, out_of_place, (source, *args[1:]), kwargs))
    return handle


def _with_inplace_flag(handler: Handler) -> Handler:
    """Functional ops with an ``inplace=`` argument (``F.relu(x, inplace=True)``)."""
    def handle(session, func, args, kwargs):
        bound = _bind(func, args, kwargs)
        if not bound.get("inplace", False):
            return handler(session, func, args, kwargs)
        bound["inplace"] = False
        target = next(iter(bound.values()))
        if not _is_activation(target):
            return func(*args, **kwargs)
        session.protect(target)  # elementwise rules keep nothing of their input: no copy needed
        return target.copy_(handler(session, func, (), bound))
    return handle


# ---------------------------------------------------------------- parametric

_CONV = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_TRANSPOSE = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
_LINEAR = ("input", "weight", "bias")


def _conv_vjp(x: Tensor, weight: Tensor, options: dict, transposed: bool) -> Callable[[Tensor], Tensor] | None:
    """The VJP of a convolution with respect to its input, as one transposed convolution (no autograd)."""
    dims = weight.dim() - 2

    def expand(value):
        return [value] * dims if isinstance(value, int) else list(value)

    padding = options.get("padding", 0)
    if isinstance(padding, str):  # "same" / "valid": leave it to autograd
        return None
    stride, padding, dilation = expand(options.get("stride", 1)), expand(padding), expand(options.get("dilation", 1))
    output_padding = expand(options.get("output_padding", 0)) if transposed else [0] * dims
    groups = options.get("groups", 1)

    def transpose(grad: Tensor) -> Tensor:
        return torch.ops.aten.convolution_backward(grad, x, weight, None, stride, padding, dilation, transposed,
                                                   output_padding, groups, [True, False, False])[0]
    return transpose


def _parametric(kind: str, names: tuple[str, ...]) -> Handler:
    """Convolutions and dense layers: ``f(x; weight, bias)``, rule from the composite."""
    transposed = names is _CONV_TRANSPOSE

    def handle(session, func, args, kwargs):
        bound = _bind_builtin(names, args, kwargs)
        x, weight, bias = bound.get("input"), bound.get("weight"), bound.get("bias")
        if not _is_activation(x):
            return func(*args, **kwargs)
        # weights computed from the input are held constant: relevance flows to the data input only
        weight = weight.detach()
        bias = bias.detach() if bias is not None else None
        options = {key: value for key, value in bound.items() if key not in _LINEAR}

        def evaluate(inp, w, b):
            return func(inp, w, b, **options)

        if kind == "dense":
            transpose, channel_dim = (lambda grad: grad @ weight), 0
        else:
            transpose = _conv_vjp(x.detach(), weight, options, transposed)
            # a merged BatchNorm scales the weight's output-channel dimension: 1 for transposed
            # convolutions, which holds output channels only for groups == 1
            channel_dim = (1 if options.get("groups", 1) == 1 else None) if transposed else 0
        call = ParametricCall(kind, func, (x, weight, bias), options, op_name(func), session.module_name,
                              weight, bias, evaluate, channel_dim, transpose)
        call.is_first = session.fed_by_input(x)
        return session.run(call)
    return handle


def _bind_builtin(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, Any]:
    """Arguments of a builtin (which has no signature to bind with) by name."""
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


# ---------------------------------------------------------------- batch norm

def _batch_norm(session, func, args, kwargs):
    """BatchNorm: merged into the conv/dense op that produced its input, else an affine map."""
    bound = _bind(F.batch_norm, args, kwargs)
    x = bound["input"]
    if not _is_activation(x):
        return func(*args, **kwargs)
    producer = session.producers.get(x)
    mean, var = bound["running_mean"], bound["running_var"]
    mergeable = (
        isinstance(producer, ParametricCall) and producer._channel_dim is not None
        and not bound["training"] and mean is not None and session.module_rule() is None
        and producer.output.shape == x.shape
    )
    if not mergeable:
        return session.run(OpCall("batchnorm", func, args, kwargs, op_name(func), session.module_name))
    weight = bound["weight"] if bound["weight"] is not None else torch.ones_like(var)
    bias = bound["bias"] if bound["bias"] is not None else torch.zeros_like(mean)
    scale = weight / torch.sqrt(var + bound["eps"])
    shift = bias - mean * scale

    def batch_norm(z: Tensor) -> Tensor:
        return func(z, mean, var, bound["weight"], bound["bias"], False, bound["momentum"], bound["eps"])

    merged = producer.merge_batch_norm(batch_norm, scale, shift)
    merged.module_name = session.module_name
    out = session.run(merged, rule=producer.rule)
    record = session.tapped.get(x)
    # a tap between the layer and its BatchNorm moves behind the merged pair: there the relevance arrives
    return out if record is None else session.tap(out, record)


# ---------------------------------------------------------------- linear, parameter-free

def _linear(kind: str, linearised: Callable | None = None) -> Handler:
    """Sums, means, average pooling, interpolation, normalisation: linear in their activations."""
    def handle(session, func, args, kwargs):
        if not has_activation(args, kwargs):
            return func(*args, **kwargs)
        return session.run(OpCall(kind, func, args, kwargs, op_name(func), session.module_name, linearised))
    return handle


def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """Layer norm with the standard deviation held constant; the mean subtraction stays linear."""
    dims = tuple(range(-len(normalized_shape), 0))
    centred = input - input.mean(dims, keepdim=True)
    std = torch.sqrt(input.detach().var(dims, unbiased=False, keepdim=True) + eps)
    out = centred / std
    if weight is not None:
        out = out * weight
    return out + bias if bias is not None else out


def _group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    """Group norm with the standard deviation held constant."""
    grouped = input.reshape(input.shape[0], num_groups, -1)
    centred = grouped - grouped.mean(-1, keepdim=True)
    std = torch.sqrt(grouped.detach().var(-1, unbiased=False, keepdim=True) + eps)
    out = (centred / std).reshape(input.shape)
    shape = (1, -1) + (1,) * (input.dim() - 2)
    if weight is not None:
        out = out * weight.reshape(shape)
    return out + bias.reshape(shape) if bias is not None else out


def _rms_norm(input, normalized_shape, weight=None, eps=None):
    """RMS norm with the root mean square held constant."""
    dims = tuple(range(-len(normalized_shape), 0))
    eps = torch.finfo(input.dtype).eps if eps is None else eps
    out = input * torch.rsqrt(input.detach().pow(2).mean(dims, keepdim=True) + eps)
    return out * weight if weight is not None else out


# ---------------------------------------------------------------- elementwise

def _elementwise(gate: bool = False) -> Handler:
    """Elementwise nonlinearities: identity rule by default; sigmoid outputs are marked as gates."""
    def handle(session, func, args, kwargs):
        if not has_activation(args, kwargs):
            return func(*args, **kwargs)
        call = OpCall("elementwise", func, args, kwargs, op_name(func), session.module_name)
        if len(call.inputs) != 1:
            return session.unknown(func, args, kwargs)
        out = session.run(call)
        if gate:
            session.gates[out] = True
        return out
    return handle


# ---------------------------------------------------------------- products

def _product(matrix: bool, divide: bool = False) -> Handler:
    """Products of activations, divisions and matrix products.

    One activation factor: a scaling (``x * c``, ``c / x``), relevance passes,
    except that a matrix product with a constant is a linear map (epsilon
    rule). Two factors: the composite decides (uniform split, or the signal
    takes all where one factor is a gate; a divisor counts as a gate).
    """
    def handle(session, func, args, kwargs):
        if not has_activation(args, kwargs):
            return func(*args, **kwargs)
        kind = "product"
        call = OpCall(kind, func, args, kwargs, op_name(func), session.module_name)
        if len(call.inputs) == 1 and matrix:
            call.kind = "sum"
        elif len(call.inputs) == 2:
            first, second = call.activations
            call.gates = (False, True) if divide else (first in session.gates, second in session.gates)
        elif len(call.inputs) > 2:
            return session.unknown(func, args, kwargs)
        return session.run(call)
    return handle


# ---------------------------------------------------------------- max pooling

def _max_pool(signature: Callable, average: Callable[[dict], Callable[[Tensor], Tensor]]) -> Handler:
    """Max pooling: winner-take-all (the gradient) unless a rule asks otherwise.

    ``signature`` is the plain function behind ``F.max_pool2d``'s dispatch, to bind arguments by name.
    """
    def handle(session, func, args, kwargs):
        bound = _bind(signature, args, kwargs)
        if not has_activation(args, kwargs) or bound.get("return_indices"):
            return func(*args, **kwargs)
        call = OpCall("maxpool", func, args, kwargs, op_name(func), session.module_name)
        call.average = average(bound)
        return session.run(call)
    return handle


def _window_average(pool: Callable) -> Callable[[dict], Callable[[Tensor], Tensor]]:
    def make(bound):
        if bound.get("dilation", 1) not in (1, (1,), (1, 1), (1, 1, 1)):
            raise NotImplementedError("relprop: proportional max pooling supports dilation 1 only")
        stride = bound.get("stride") or bound["kernel_size"]
        return functools.partial(pool, kernel_size=bound["kernel_size"], stride=stride, padding=bound["padding"],
                                 ceil_mode=bound["ceil_mode"], count_include_pad=True)
    return make


def _adaptive_average(pool: Callable) -> Callable[[dict], Callable[[Tensor], Tensor]]:
    def make(bound):
        return functools.partial(pool, output_size=bound["output_size"])
    return make


# ---------------------------------------------------------------- the table

def _lookup(namespace: Any, names: str) -> list[Callable]:
    return [getattr(namespace, name) for name in names.split() if hasattr(namespace, name)]


HANDLERS: dict[Callable, Handler] = {}


def _register(handler: Handler, *funcs_lists: list[Callable]) -> None:
    for funcs in funcs_lists:
        for func in funcs:
            HANDLERS[func] = handler


_T, _nn = torch.Tensor, torch._C._nn
_ROUTING = (
    "reshape flatten unflatten permute transpose swapaxes swapdims t squeeze unsqueeze cat concat concatenate "
    "stack hstack vstack dstack split chunk tensor_split narrow select index_select gather take_along_dim movedim "
    "moveaxis unbind roll flip fliplr flipud rot90 where masked_select masked_fill broadcast_to tile repeat_interleave "
    "diagonal tril triu max min amax amin maximum minimum fmax fmin sort topk kthvalue median clone detach "
    "constant_pad_nd dropout alpha_dropout feature_alpha_dropout feature_dropout channel_shuffle pixel_shuffle "
    "pixel_unshuffle split_with_sizes ravel atleast_1d atleast_2d atleast_3d"
)
_register(
    _run,
    _lookup(torch, _ROUTING),
    _lookup(_T, _ROUTING + " view view_as reshape_as expand expand_as repeat contiguous to float double half "
                "bfloat16 type type_as cpu cuda __getitem__ unfold as_strided"),
    _lookup(F, "pad dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout pixel_shuffle "
               "pixel_unshuffle channel_shuffle unfold fold embedding max_pool1d_with_indices "
               "max_pool2d_with_indices max_pool3d_with_indices"),
    [_T.T.__get__, _T.mT.__get__, _T.data.__get__],
)
# metadata, comparisons and other outputs without a gradient: nothing to propagate
_NO_RELEVANCE = ("dim ndimension size numel nelement element_size stride storage_offset is_contiguous "
                 "is_floating_point is_complex __len__ __bool__ __index__ __int__ __float__ item tolist eq ne gt lt "
                 "ge le __eq__ __ne__ __gt__ __lt__ __ge__ __le__ argmax argmin argsort isfinite isnan isinf any all "
                 "nonzero count_nonzero __format__ __repr__ data_ptr get_device equal")
_register(_run, _lookup(torch, _NO_RELEVANCE), _lookup(_T, _NO_RELEVANCE),
          [getattr(_T, name).__get__ for name in "shape dtype device ndim requires_grad is_cuda layout grad_fn".split()
           if hasattr(getattr(_T, name, None), "__get__")])
_register(_run_in_place, _lookup(_T, "__setitem__ masked_fill_ copy_ zero_ fill_ index_put_ index_copy_ "
                                     "index_fill_ scatter_ masked_scatter_"))

_register(_parametric("conv", _CONV), _lookup(torch, "conv1d conv2d conv3d"))
_register(_parametric("conv", _CONV_TRANSPOSE), _lookup(torch, "conv_transpose1d conv_transpose2d conv_transpose3d"))
_register(_parametric("dense", _LINEAR), [F.linear])
_register(_batch_norm, [F.batch_norm])

_SUMS = "add sub rsub sum mean nansum cumsum __radd__ __rsub__"
_sum = _linear("sum")
_register(_sum, _lookup(torch, _SUMS), _lookup(_T, _SUMS), _lookup(torch, "avg_pool1d"),
          _lookup(_nn, "avg_pool2d avg_pool3d"),
          _lookup(F, "adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d interpolate upsample "
                     "upsample_bilinear upsample_nearest"))
_register(_in_place(_T.add, _sum), _lookup(_T, "add_ __iadd__"))
_register(_in_place(_T.sub, _sum), _lookup(_T, "sub_ __isub__"))

_register(_linear("norm", _layer_norm), [F.layer_norm])
_register(_linear("norm", _group_norm), [F.group_norm])
if hasattr(F, "rms_norm"):
    _register(_linear("norm", _rms_norm), [F.rms_norm])

_ELEMENTWISE = ("relu exp exp2 expm1 log log1p log2 sqrt rsqrt abs neg negative square reciprocal pow clamp clip "
                "sin cos erf tanh __neg__ __pow__ __abs__")
_elementwise_pass = _elementwise()
_register(_elementwise_pass, _lookup(torch, _ELEMENTWISE), _lookup(_T, _ELEMENTWISE),
          _lookup(F, "gelu softplus logsigmoid softsign tanhshrink prelu normalize tanh"))
_register(_with_inplace_flag(_elementwise_pass),
          _lookup(F, "relu relu6 hardtanh leaky_relu elu selu celu silu mish hardswish rrelu threshold"))
_register(_elementwise(gate=True), _lookup(torch, "sigmoid"), _lookup(_T, "sigmoid"), [F.sigmoid])
_register(_with_inplace_flag(_elementwise(gate=True)), [F.hardsigmoid])
for _name in "relu exp sqrt rsqrt abs neg reciprocal pow clamp clip tanh".split():
    _register(_in_place(getattr(_T, _name), _elementwise_pass, keeps_input=False),
              _lookup(_T, f"{_name}_"), _lookup(torch, f"{_name}_"))
_register(_in_place(_T.sigmoid, _elementwise(gate=True), keeps_input=False),
          _lookup(_T, "sigmoid_"), _lookup(torch, "sigmoid_"))
for _function in (F.relu, F.elu, F.leaky_relu, F.hardtanh):
    _register(_in_place(_function, _elementwise_pass, keeps_input=False), _lookup(F, f"{_function.__name__}_"))

_MUL, _DIV, _MATMUL = "mul multiply __rmul__", "div divide true_divide __rdiv__ __rtruediv__ __truediv__", \
    "matmul mm bmm einsum __matmul__ __rmatmul__"
_register(_product(matrix=False), _lookup(torch, _MUL), _lookup(_T, _MUL))
_register(_product(matrix=False, divide=True), _lookup(torch, _DIV), _lookup(_T, _DIV))
_register(_product(matrix=True), _lookup(torch, _MATMUL), _lookup(_T, _MATMUL))
_register(_in_place(_T.mul, _product(matrix=False)), _lookup(_T, "mul_ __imul__"))
_register(_in_place(_T.div, _product(matrix=False, divide=True)), _lookup(_T, "div_ __itruediv__"))

for _dims in (1, 2, 3):
    _register(_max_pool(getattr(F, f"_max_pool{_dims}d"), _window_average(getattr(F, f"avg_pool{_dims}d"))),
              [getattr(F, f"max_pool{_dims}d")])
    _register(_max_pool(getattr(F, f"_adaptive_max_pool{_dims}d"),
                        _adaptive_average(getattr(F, f"adaptive_avg_pool{_dims}d"))),
              [getattr(F, f"adaptive_max_pool{_dims}d")])

