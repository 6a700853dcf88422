"""Dynamic-quantized layers (``torch.ao.nn.quantized.dynamic``): Linear, LSTM, GRU and their cells.

``torch.ao.quantization.quantize_dynamic`` (which easyocr applies to its
recognizer on a CPU) stores weights as int8 (or float16) and runs them with
``torch.ops.quantized.linear_dynamic`` and ``torch.quantized_lstm``: kernels
without a gradient, so plain autograd gives no relevance through them.

Each handler returns the quantized kernel's output bitwise, and lets relevance
flow through the same layer computed in floating point with the *dequantized*
weights (``int8 * scale``, the values the kernel multiplies by), written with
ops that carry rules: a dense layer gets the composite's dense rule, a
recurrent layer the LSTM / GRU rules of :mod:`relprop.ops.recurrent`. The kernel
also rounds its input to 8 bits per call; the rules' ratios come from the
unrounded input, so the relevance explains the layer the int8 weights define.

Statically quantized models (activations as quantized tensors) are refused
with an error: their quantized activations cannot carry relevance."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from relprop._core.registry import HANDLERS
from relprop.engine.nodes import substitute
from relprop.ops.recurrent import explain_cell, explain_recurrent, recurrent_arguments

__all__ = ["QUANTIZED_HANDLERS", "dequantized_weights"]

_Q = torch.ops.quantized


def _unpack(packed: Any) -> tuple[Tensor, Tensor | None]:
    """The float weight and bias of a packed linear (int8 dequantized, or float16 as float)."""
    try:
        weight, bias = _Q.linear_unpack(packed)
        weight = weight.dequantize()
    except RuntimeError:  # a float16 pack
        weight, bias = _Q.linear_unpack_fp16(packed)
    return weight.detach().float(), (bias.detach() if bias is not None else None)


def dequantized_weights(cell_params: Any) -> list[Tensor]:
    """The float weights of one layer-direction of a dynamic-quantized RNN.

    Parameters
    ----------
    cell_params : torch.ScriptObject
        One packed layer-direction, ``module._all_weight_values[i].param``
        (what ``torch.quantized_lstm`` receives).

    Returns
    -------
    list of Tensor
        ``[w_ih, w_hh, b_ih, b_hh]`` (without the biases if the layer has
        none): int8 weights dequantized, float16 ones as float32.
    """
    state = cell_params.__getstate__()[0]
    if state[0] not in ("quantized_dynamic", "quantized_fp16"):
        raise NotImplementedError(f"relprop: RNN weights packed as {state[0]!r} are not supported (only dynamic "
                                  "quantization: quantized_dynamic, quantized_fp16)")
    (w_ih, b_ih), (w_hh, b_hh) = (_unpack(packed) for packed in state[4])
    return [w_ih, w_hh, *(b for b in (b_ih, b_hh) if b is not None)]


def _dense(activation: Callable[[Tensor], Tensor] | None = None) -> Callable:
    """``linear_dynamic(x, packed)`` (and ``linear_relu_dynamic``): the kernel's output, relevance through F.linear."""
    def handle(session: Any, func: Callable, args: tuple, kwargs: dict) -> Any:
        x, packed = args[0], args[1]
        with torch.no_grad():  # the kernel has no autograd formula: relevance takes the float path below
            native = func(*args, **kwargs)
        weight, bias = _unpack(packed)
        with session:
            decomposed = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
            if activation is not None:
                decomposed = activation(decomposed)
        return substitute(native.to(x.dtype), decomposed)
    return handle


def _recurrent(kind: str) -> Callable:
    """``torch.quantized_lstm`` / ``quantized_gru``: the kernel's outputs, relevance through the unrolled layer."""
    def handle(session: Any, func: Callable, args: tuple, kwargs: dict) -> Any:
        arguments = recurrent_arguments(args)
        params = [w.to(arguments["data"].dtype) for cell in arguments["params"] for w in dequantized_weights(cell)]
        with torch.no_grad():
            native = func(*args, **kwargs)
        return explain_recurrent(session, kind, native, **{**arguments, "params": params})
    return handle


def _cell(kind: str) -> Callable:
    """``quantized_lstm_cell_dynamic(x, hx, packed_ih, packed_hh, b_ih, b_hh)`` and the GRU / RNN cells."""
    def handle(session: Any, func: Callable, args: tuple, kwargs: dict) -> Any:
        x, hx, packed_ih, packed_hh, b_ih, b_hh = args[:6]
        with torch.no_grad():
            native = func(*args, **kwargs)
        weights = [_unpack(packed_ih)[0], _unpack(packed_hh)[0], b_ih, b_hh]
        return explain_cell(session, kind, native, x, hx, [w if w is None else w.detach().to(x.dtype)
                                                            for w in weights])
    return handle


def _refuse_static(session: Any, func: Callable, args: tuple, kwargs: dict) -> Any:
    """Quantizing an activation: a statically quantized model, whose int8 activations carry no relevance."""
    raise NotImplementedError(
        f"relprop: module '{session.module_name or '<root>'}' quantizes an activation ({func.__name__}): statically "
        "quantized models are not supported; explain the float model, or one quantized dynamically "
        "(torch.ao.quantization.quantize_dynamic; easyocr: quantize=True on a CPU)")


def _with_overloads(pairs: list[tuple[Any, Callable]]) -> dict[Any, Callable]:
    """Each op packet and its overloads (``op.default``), whichever form reaches the engine."""
    table = {}
    for op, handler in pairs:
        table[op] = handler
        if isinstance(op, torch._ops.OpOverloadPacket):
            for name in op.overloads():
                table[getattr(op, name)] = handler
    return table


QUANTIZED_HANDLERS: dict[Any, Callable] = _with_overloads([
    (_Q.linear_dynamic, _dense()), (_Q.linear_dynamic_fp16, _dense()),
    (_Q.linear_relu_dynamic, _dense(torch.relu)), (_Q.linear_relu_dynamic_fp16, _dense(torch.relu)),
    (torch.quantized_lstm, _recurrent("lstm")), (torch.quantized_gru, _recurrent("gru")),
    (_Q.quantized_lstm_cell_dynamic, _cell("lstm")), (_Q.quantized_gru_cell_dynamic, _cell("gru")),
    (_Q.quantized_rnn_tanh_cell_dynamic, _cell("rnn_tanh")), (_Q.quantized_rnn_relu_cell_dynamic, _cell("rnn_relu")),
    (torch.quantize_per_tensor, _refuse_static), (torch.quantize_per_channel, _refuse_static),
    (torch.quantize_per_tensor_dynamic, _refuse_static),
])


HANDLERS.update(QUANTIZED_HANDLERS)
