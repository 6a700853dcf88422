"""Recurrent layers: ``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` and their cells, unrolled with the same weights.

PyTorch runs recurrent layers as fused kernels (``torch.lstm``, ...). The
forward output stays the fused kernel's, bitwise; relevance flows through an
unrolled computation of the very same function, written with ops that carry
rules, so the usual rules give the LSTM rules of Arras et al. (2017, 2019):

- the gate pre-activations ``W_ih x + b_ih + W_hh h + b_hh`` are sums of
  linear maps: epsilon rule, the biases absorbing their share;
- sigmoid gates take no relevance in the products ``f * c``, ``i * g``,
  ``o * tanh(c)``: the signal takes all (:class:`~relprop.rules.SignalTakesAll`);
- ``tanh`` passes relevance unchanged (the hidden state's relevance goes to
  the cell state);
- ``c = f * c_prev + i * g`` is shared between the previous cell and the
  candidate by their contributions;
- a projection (``proj_size``), ``h = W_hr (o * tanh(c))``, is one more
  linear map in each step: epsilon rule.

GRU: ``r`` and ``z`` are gates; ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``
gives the reset-gated term's relevance to ``W_hn h + b_hn``; ``h' = (1 - z) * n
+ z * h`` shares relevance between the candidate and the previous state by
their contributions (``1 - z`` is computed as ``sigmoid(-a)``, a gate too).
For bidirectional layers the two directions' outputs are concatenated, so each
direction keeps the relevance of its own half. Initial states passed as model
inputs get relevance too."""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relprop._core.registry import HANDLERS, Handler
from relprop.engine.nodes import substitute

__all__ = ["RECURRENT_HANDLERS", "recurrent_arguments", "explain_recurrent", "explain_cell", "unrolled_layers"]

#: the state of a layer-direction: ``(h, c)`` for an LSTM, ``h`` otherwise
State = Any


def _lstm_cell(x: Tensor, state: tuple[Tensor, Tensor], w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None = None,
               b_hh: Tensor | None = None, w_hr: Tensor | None = None) -> tuple[Tensor, Tensor]:
    h, c = state
    gates = F.linear(x, w_ih, b_ih) + F.linear(h, w_hh, b_hh)
    i, f, g, o = gates.chunk(4, -1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h = torch.sigmoid(o) * torch.tanh(c)
    return (h if w_hr is None else F.linear(h, w_hr)), c


def _gru_cell(x: Tensor, h: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None = None,
              b_hh: Tensor | None = None) -> Tensor:
    i_r, i_z, i_n = F.linear(x, w_ih, b_ih).chunk(3, -1)
    h_r, h_z, h_n = F.linear(h, w_hh, b_hh).chunk(3, -1)
    reset = torch.sigmoid(i_r + h_r)
    candidate = torch.tanh(i_n + reset * h_n)
    update = i_z + h_z
    return torch.sigmoid(-update) * candidate + torch.sigmoid(update) * h


def _rnn_cell(activation: Callable[[Tensor], Tensor]) -> Callable[..., Tensor]:
    def cell(x: Tensor, h: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None = None,
             b_hh: Tensor | None = None) -> Tensor:
        return activation(F.linear(x, w_ih, b_ih) + F.linear(h, w_hh, b_hh))
    return cell


_CELLS: dict[str, Callable[..., Any]] = {"lstm": _lstm_cell, "gru": _gru_cell, "rnn_tanh": _rnn_cell(torch.tanh),
                                         "rnn_relu": _rnn_cell(torch.relu)}


def _select(state: State, index: int | None, rows: int | None = None) -> State:
    """The state of one layer-direction (and some batch rows), for LSTM (h, c) pairs and single states."""
    if isinstance(state, tuple):
        return tuple(_select(s, index, rows) for s in state)
    part = state[index] if index is not None else state
    return part if rows is None else part[:rows]


def _merge(new: State, old: State, rows: int) -> State:
    """Rows ``:rows`` from ``new``, the rest from ``old`` (sequences that are not running at this step)."""
    if isinstance(new, tuple):
        return tuple(_merge(n, o, rows) for n, o in zip(new, old))
    return new if rows == old.shape[0] else torch.cat([new, old[rows:]])


def _hidden(state: State) -> Tensor:
    return state[0] if isinstance(state, tuple) else state


def _direction(cell: Callable[..., Any], steps: list[Tensor], state: State, weights: Sequence[Tensor | None],
               reverse: bool) -> tuple[list[Tensor], State]:
    """One direction of one layer over the time steps (each ``(batch_t, features)``, batch_t non-increasing)."""
    outputs: list[Tensor | None] = [None] * len(steps)
    order = range(len(steps) - 1, -1, -1) if reverse else range(len(steps))
    for t in order:
        rows = steps[t].shape[0]
        new = cell(steps[t], _select(state, None, rows), *weights)
        state = _merge(new, state, rows)
        outputs[t] = _hidden(new)
    return [o for o in outputs if o is not None], state


def _unrolled(kind: str, steps: list[Tensor], hx: State, params: Sequence[Tensor], has_biases: bool, num_layers: int,
              bidirectional: bool) -> tuple[list[Tensor], State]:
    """The recurrent layer over ``steps`` (a list of per-time-step inputs); outputs per step and final states."""
    cell = _CELLS[kind]
    directions = 2 if bidirectional else 1
    per = len(params) // (num_layers * directions)
    projected = per != (4 if has_biases else 2)  # an LSTM with proj_size: w_hr after the weights and biases
    finals = []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            weights: Sequence[Tensor | None] = params[index * per:(index + 1) * per]
            if projected:  # (w_ih, w_hh, b_ih, b_hh, w_hr), the biases None where the layer has none
                weights = (*weights[:-1], *[None] * (5 - per), weights[-1])
            out, state = _direction(cell, steps, _select(hx, index), weights, reverse=direction == 1)
            outputs.append(out)
            finals.append(state)
        steps = [torch.cat(parts, -1) for parts in zip(*outputs)] if directions == 2 else outputs[0]
    if isinstance(finals[0], tuple):
        return steps, tuple(torch.stack(parts) for parts in zip(*finals))
    return steps, torch.stack(finals)


def recurrent_arguments(args: tuple) -> dict[str, Any]:
    """The arguments of ``torch.lstm`` / ``gru`` / ... (and their quantized forms), padded or packed, by name."""
    packed = isinstance(args[1], Tensor) and not args[1].is_floating_point()
    if packed:
        data, batch_sizes, hx, params, has_biases, num_layers, _, _, bidirectional = args[:9]
        batch_first = False
    else:
        data, hx, params, has_biases, num_layers, _, _, bidirectional, batch_first = args[:9]
        batch_sizes = None
    return dict(data=data, batch_sizes=batch_sizes, hx=hx, params=params, has_biases=has_biases,
                num_layers=num_layers, bidirectional=bidirectional, batch_first=batch_first)


def explain_recurrent(session: Any, kind: str, native: tuple, params: Sequence[Tensor], data: Tensor,
                      batch_sizes: Tensor | None, hx: Any, has_biases: bool, num_layers: int, bidirectional: bool,
                      batch_first: bool, **_: Any) -> tuple:
    """``native``, the recurrent kernel's outputs, with relevance flowing through the layer unrolled with ``params``.

    Parameters
    ----------
    session : relprop.engine.Session
        The session whose mode the unrolled ops run in, so that each gets its rule.
    kind : str
        ``"lstm"``, ``"gru"``, ``"rnn_tanh"`` or ``"rnn_relu"``.
    native : tuple of Tensor
        The kernel's output and final states, returned bitwise.
    params : sequence of Tensor
        Float weights (and biases) per layer and direction, in ``torch.lstm``'s order.
    data, batch_sizes, hx, has_biases, num_layers, bidirectional, batch_first
        As :func:`recurrent_arguments` names them (``batch_sizes`` None unless packed).
    """
    with session:  # back in the mode: every op of the unrolled layer gets its rule
        if batch_sizes is not None:
            steps = list(data.split(batch_sizes.tolist()))
        else:
            sequence = data.transpose(0, 1) if batch_first else data
            steps = list(sequence.unbind(0))
        outputs, finals = _unrolled(kind, steps, hx, params, has_biases, num_layers, bidirectional)
        output = torch.cat(outputs) if batch_sizes is not None else torch.stack(outputs, 1 if batch_first else 0)
    decomposed = (output, *finals) if isinstance(finals, tuple) else (output, finals)
    return type(native)(substitute(n, d) for n, d in zip(native, decomposed))


def explain_cell(session: Any, kind: str, native: Any, x: Tensor, hx: Any, weights: Sequence[Tensor | None]) -> Any:
    """``native``, a recurrent cell's output(s), with relevance flowing through the cell computed with ``weights``.

    ``weights`` are ``(w_ih, w_hh, b_ih, b_hh)`` (biases may be None or absent).
    """
    with session:
        decomposed = _CELLS[kind](x, tuple(hx) if kind == "lstm" else hx, *weights)
    if kind == "lstm":
        return type(native)(substitute(n, d) for n, d in zip(native, decomposed))
    return substitute(native, decomposed)


def _recurrent(kind: str) -> Handler:
    """``torch.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu``, padded or packed: unrolled for relevance."""
    def handle(session: Any, func: Callable, args: tuple, kwargs: dict) -> Any:
        arguments = recurrent_arguments(args)
        native = func(*args, **kwargs)
        return explain_recurrent(session, kind, native, **arguments)
    return handle


def _cell(kind: str) -> Handler:
    """``torch.lstm_cell`` / ``gru_cell`` / ``rnn_tanh_cell`` / ``rnn_relu_cell``."""
    def handle(session: Any, func: Callable, args: tuple, kwargs: dict) -> Any:
        x, hx, *weights = args
        return explain_cell(session, kind, func(*args, **kwargs), x, hx, weights)
    return handle


#: ``nn.RNNBase.mode`` -> the cell it runs
_KINDS = {"LSTM": "lstm", "GRU": "gru", "RNN_TANH": "rnn_tanh", "RNN_RELU": "rnn_relu"}


def _unrolled_forward(module: nn.RNNBase) -> Callable[..., Any]:
    """``module``'s forward on a padded batch, unrolled into the ops interception explains the layer by; any other
    input (a packed sequence, an unbatched one) through the layer's own forward."""
    kind = _KINDS[module.mode]

    def forward(input: Any, hx: Any = None) -> Any:
        if not isinstance(input, Tensor) or input.dim() != 3:
            return type(module).forward(module, input, hx)
        directions = 2 if module.bidirectional else 1
        batch = input.shape[0 if module.batch_first else 1]
        if hx is None:
            size = module.proj_size if getattr(module, "proj_size", 0) > 0 else module.hidden_size
            h = input.new_zeros(module.num_layers * directions, batch, size)
            cell = input.new_zeros(module.num_layers * directions, batch, module.hidden_size)
            hx = (h, cell) if kind == "lstm" else h
        steps = list((input.transpose(0, 1) if module.batch_first else input).unbind(0))
        weights = cast(Sequence[Tensor], module._flat_weights)  # a layer without biases lists none
        outputs, finals = _unrolled(kind, steps, tuple(hx) if kind == "lstm" else hx, weights,
                                    module.bias, module.num_layers, module.bidirectional)
        return torch.stack(outputs, 1 if module.batch_first else 0), finals
    return forward


#: each recurrent layer's unrolled forward, one object per layer (a traced program guards it by identity)
_FORWARDS: weakref.WeakKeyDictionary[nn.Module, Callable[..., Any]] = weakref.WeakKeyDictionary()


@contextmanager
def unrolled_layers(model: nn.Module) -> Iterator[list[nn.RNNBase]]:
    """Inside the block each recurrent layer of ``model`` (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) runs unrolled, so
    that a traced program holds its ops one by one, each with its rule, as interception explains them (its value
    the unrolled computation's, equal to the fused kernel's to rounding); its forward as it was after the block,
    also when an exception flies. A layer whose forward was replaced already is left as it is. The block gets
    the layers it unrolls."""
    layers = [module for module in model.modules()
              if isinstance(module, nn.RNNBase) and module.mode in _KINDS and "forward" not in vars(module)]
    try:
        for module in layers:
            if module not in _FORWARDS:
                _FORWARDS[module] = _unrolled_forward(module)
            module.forward = _FORWARDS[module]
        yield layers
    finally:
        for module in layers:
            vars(module).pop("forward", None)


RECURRENT_HANDLERS = {
    getattr(torch, name): handler
    for name, handler in [
        ("lstm", _recurrent("lstm")), ("gru", _recurrent("gru")), ("rnn_tanh", _recurrent("rnn_tanh")),
        ("rnn_relu", _recurrent("rnn_relu")), ("lstm_cell", _cell("lstm")), ("gru_cell", _cell("gru")),
        ("rnn_tanh_cell", _cell("rnn_tanh")), ("rnn_relu_cell", _cell("rnn_relu")),
    ]
    if hasattr(torch, name)
}


HANDLERS.update(RECURRENT_HANDLERS)
