"""Routing ops (reshapes, indexing, casts, ``cat``) and metadata: the plain gradient re-routes relevance exactly."""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from relprop._core.contract import Call
from relprop._core.kinds import OpKind
from relprop._core.registry import ALWAYS_HANDLED, ROUTING_HANDLERS, lookup, register, torch_and_tensor
from relprop._core.rule import Gradient, Reads, Scaled
from relprop._core.tensors import has_activation, is_activation
from relprop.engine.session import GradientFormUnavailable
from relprop.ops.attention import note_routed
from relprop.ops.host import OpHost


def _run(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """Routing ops and constants: the plain gradient re-routes relevance exactly.

    A tag of the first argument (gate, attention weights) carries over: a
    reshaped or cast gate is still a gate.
    """
    out = session.routed(func, args, kwargs)
    note_routed(session, func, args, out)
    return out


def _indexed(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``x[index]``: routing; but a parameter table indexed by integer ids (TransformerLens's ``W_E[tokens, :]``)
    is an embedding lookup, whose vectors collect the relevance of the model's token ids as ``F.embedding``'s do."""
    if has_activation(args, kwargs):
        return _run(session, func, args, kwargs)
    index = args[1] if len(args) > 1 else None
    ids = index[0] if isinstance(index, tuple) and index else index
    if isinstance(args[0], torch.nn.Parameter) and isinstance(ids, Tensor) and not ids.is_floating_point() \
            and ids.dtype != torch.bool:
        with torch.no_grad():
            out = func(*args, **kwargs)
        return session.token_embedding(ids, out)  # the lookup of other ids than the model's stays a constant
    return session.constant_op(func, args, kwargs)


def _escaping(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``x.data``: routing, but a write through the result reaches ``x``'s memory unseen (no version bump), so
    ``x`` is taken for written: what read it or produced it keeps copies, and it is no ReLU's output any more."""
    if is_activation(args[0]):
        session.aliases.escaped(args[0])
    return _run(session, func, args, kwargs)


def _hook(session: OpHost, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``Tensor.register_hook`` on an activation: on the tensor the relevance flows through, and said so.

    In relprop's backward pass the hook receives the relevance arriving at
    the tensor, not its gradient; what it returns replaces that relevance
    (the conservation guard reports relevance it creates or drops). Relevance
    per unit of activation is not what it would receive: the pass starts again
    carrying relevance itself.
    """
    if session.gradient_form:
        raise GradientFormUnavailable(f"relprop: a hook on an activation in module '{session.module_name}'")
    warnings.warn(f"relprop: a hook registered on an activation in module '{session.module_name or '<root>'}' "
                  "during the explained forward pass receives relevance, not gradients", UserWarning, stacklevel=2)
    return func(*args, **kwargs)


class _Routes(Gradient):
    """The rule of a routing op that mixes in constants: its gradient routes relevance exactly, in either form."""

    def gradient_reads(self, call: Call) -> Reads:
        return Reads(vjp=True, native=True)

    def scaled(self, call: Call) -> Scaled:
        return Scaled()


_ROUTES = _Routes()


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


# each list below names torch and Tensor functions once; functions of one namespace only are listed apart
register(
    _run,
    torch_and_tensor(
        "reshape flatten unflatten permute transpose swapaxes swapdims t squeeze unsqueeze split chunk tensor_split "
        "narrow select index_select gather take_along_dim movedim moveaxis unbind roll flip fliplr flipud rot90 "
        "masked_select masked_fill broadcast_to tile repeat_interleave diagonal tril triu max min amax amin maximum "
        "minimum fmax fmin sort topk kthvalue median clone detach split_with_sizes ravel"),
    lookup(torch, "constant_pad_nd dropout alpha_dropout feature_alpha_dropout feature_dropout channel_shuffle "
                   "pixel_shuffle pixel_unshuffle atleast_1d atleast_2d atleast_3d _pack_padded_sequence "
                   "_pad_packed_sequence"),
    lookup(Tensor, "view view_as reshape_as expand expand_as repeat contiguous to float double half bfloat16 type "
                "type_as cpu cuda unfold as_strided"),
    lookup(F, "pad dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout pixel_shuffle "
               "pixel_unshuffle channel_shuffle unfold max_pool1d_with_indices "
               "max_pool2d_with_indices max_pool3d_with_indices"),
    [getattr(Tensor, name).__get__ for name in ("T", "mT")],
)
register(_indexed, [Tensor.__getitem__])
register(_escaping, [getattr(Tensor, "data").__get__])  # (the stubs type `data` as a Tensor)
register(_combine, torch_and_tensor("where scatter index_copy masked_scatter"),
          lookup(torch, "cat concat concatenate stack hstack vstack dstack"))
# metadata, comparisons and other outputs without a gradient: nothing to propagate
register(_run, torch_and_tensor("numel is_floating_point is_complex eq ne gt lt ge le argmax argmin argsort "
                                  "isfinite isnan isinf any all nonzero count_nonzero equal get_device"),
          lookup(Tensor, "dim ndimension size nelement element_size stride storage_offset is_contiguous __len__ __bool__ "
                      "__index__ __int__ __float__ item tolist __eq__ __ne__ __gt__ __lt__ __ge__ __le__ __format__ "
                      "__repr__ data_ptr"),
          [getattr(Tensor, name).__get__ for name in "shape dtype device ndim requires_grad is_cuda layout grad_fn".split()])
register(_hook, [Tensor.register_hook])
register(_run_in_place, lookup(Tensor, "__setitem__ masked_fill_ copy_ zero_ fill_ index_copy_ index_fill_ scatter_ "
                                     "masked_scatter_"))


ROUTING_HANDLERS.update({_run, _run_in_place, _combine, _indexed})
ALWAYS_HANDLED.add(_indexed)
