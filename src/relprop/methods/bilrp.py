"""BiLRP: which pairs of input features make two inputs similar (Eberle et al., IEEE TPAMI 2022).

An embedding model ``phi`` scores a pair by ``y = <phi(x), phi(x')>``. BiLRP
explains ``y`` by relevance for pairs of features, one of each input::

    R_{ii'} = sum_m R_i(phi_m)(x) * R_{i'}(phi_m)(x')

where ``R_i(phi_m)(x)`` is the LRP relevance of feature ``i`` of ``x`` for the
embedding dimension ``phi_m(x)`` (seeded with its value). Under conservative
rules each side's relevance sums to ``phi_m``, so the pair relevance sums to
``y``. The first-order explanation (one side at a time, the other held fixed)
is its marginal: ``sum_{i'} R_{ii'}`` when the other side conserves.

Each ``R(phi_m)`` is the relevance of a seed of its own. Each side is
recorded once (:meth:`relprop.LRP.record`, reusable) and the seeds are carried
back through that one forward pass, in one of two ways:

- **The transposed map**, where the rules carry relevance per unit of
  activation (AttnLRP, CP-LRP) and a side has fewer input positions (tokens,
  or pooled regions) than the embedding has dimensions. Relevance is then
  linear in the seed: seeded with ``s * phi(x)`` for a selector ``s`` that
  requires grad, the derivative of one position's relevance with respect to
  ``s`` holds that position's relevance for every dimension at once. One
  backward pass that records itself (``create_graph``), then one backward
  pass through it per ``c`` positions (copy ``k`` of the recorded batch
  serves the ``k``-th position of a group): the work of about ``2 n``
  example backward passes for ``n`` positions instead of ``D``. The sum
  over the dimensions, weighted by ``s``, is checked at every example and
  position against the relevance of the selector itself: a rule whose
  backward pass leaves the graph would miss a share of it, and the side is
  then explained the other way (after the time the transposed map took).
  ``pool`` must be linear for this (a sum over patches): it is checked on
  two random maps, and a pool that is not linear (a maximum) is applied to
  each dimension's relevance the other way. Attention runs in its math
  form in this recorded pass, holding each head's scores, so its copies
  are at most ``relprop.methods.transposed.SCORES / n ** 2``.
- **One backward pass per ``c`` dimensions** otherwise: the recorded batch
  holds ``c`` copies of the inputs, copy ``k`` seeded with the ``k``-th
  dimension of a chunk. More copies mean fewer backward passes but a longer
  forward pass, whose copies are all alike.

``max_batch`` bounds the recorded batch in both.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from relprop import composites
from relprop._core.modules import evaluation
from relprop.methods._inputs import forward_arguments, tile_arguments
from relprop.methods.attribution import LRP
from relprop.methods.forward_pass import ForwardPass
from relprop.methods.protocol import cyclic_gc_paused
from relprop.methods.targets import model_logits
from relprop.methods.transposed import SCORES, Pool, additive, pooled, transposed_relevance

__all__ = ["BiLRP"]


class _CallableEmbedding(nn.Module):
    """An embedding callable as a module whose submodules are the modules it runs (for module context)."""

    def __init__(self, function: Callable[..., Any], modules: dict[str, nn.Module]):
        super().__init__()
        self.training = False  # the wrapper's own flag only: the user's modules keep theirs
        self.function = function
        for name, module in modules.items():
            self.add_module(name, module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)


@contextmanager
def _outermost_modules() -> Iterator[list[nn.Module]]:
    """Record the modules called while the block runs that are not called from inside another module."""
    found: list[nn.Module] = []
    depth = [0]

    def enter(module: nn.Module, args: Any) -> None:
        if depth[0] == 0 and not any(module is seen for seen in found):
            found.append(module)
        depth[0] += 1

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        depth[0] -= 1

    handles = [nn.modules.module.register_module_forward_pre_hook(enter),
               nn.modules.module.register_module_forward_hook(leave, always_call=True)]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def _referenced_modules(function: Any) -> list[tuple[str, nn.Module]]:
    """Modules ``function`` refers to by name: closure variables, globals, defaults, a bound method's owner."""
    found: list[tuple[str, Any]] = []
    code = getattr(function, "__code__", None)
    if code is not None:
        for name, cell in zip(code.co_freevars, getattr(function, "__closure__", None) or ()):
            try:
                found.append((name, cell.cell_contents))
            except ValueError:  # an empty cell
                pass
        scope = getattr(function, "__globals__", {})
        found += [(name, scope[name]) for name in code.co_names if name in scope]
        found += [(f"default{index}", value) for index, value in enumerate(getattr(function, "__defaults__", None)
                                                                             or ())]
    if getattr(function, "__self__", None) is not None:
        found.append(("self", function.__self__))
    if getattr(function, "func", None) is not None:  # functools.partial
        found += [(f"arg{index}", value) for index, value in enumerate(getattr(function, "args", ()))]
        found += list(getattr(function, "keywords", {}).items()) + _referenced_modules(function.func)
    return [(name, value) for name, value in found if isinstance(value, nn.Module)]


def _named_holder(module: nn.Module, referenced: list[tuple[str, nn.Module]], fallback: str) -> tuple[str, nn.Module]:
    """The module under the name the callable uses for it, else a named module holding it, else ``fallback``."""
    for name, held in referenced:
        if held is module:
            return name, held
    for name, held in referenced:
        if any(part is module for part in held.modules()):
            return name, held
    return fallback, module


class BiLRP:
    """Second-order relevance of a similarity ``<phi(x), phi(x')>`` for pairs of input features.

    Parameters
    ----------
    embed : nn.Module or callable
        Maps an input batch to embeddings of shape ``(B, D)`` (a model with
        mean pooling, a CLS token, a projection head...). A plain callable is
        run once without rules to find the modules it calls; they become
        submodules of a wrapper under the names the callable uses for them
        (a closure variable ``model`` gives module paths ``model.encoder...``,
        also when the callable runs only ``model.encoder``; that is what a
        composite's ``name_map`` sees), so that rules get their module
        context. A bound method's module is named ``self``; a module the
        callable reaches some other way is named ``module0``, ``module1``...
    composite : Composite, str or None
        The rules, as for :class:`relprop.LRP`.
    max_batch : int
        Memory limit: the largest batch one recorded forward pass runs (the
        two sides' recorded passes are held together). For a batch of ``B``
        examples a side is recorded with ``c = min(n, max(1, max_batch // B))``
        copies of the inputs (fewer where the groups then split more evenly),
        ``n`` its positions (by the transposed map) or the embedding's
        dimensions (otherwise), and each backward pass serves ``c`` of them.
        Larger is not faster beyond a few dozen rows on a model of real size:
        the copies' forward pass then costs more than the backward passes it
        saves.
    strict : bool
        Raise instead of warn when relevance reaches an op without a rule.

    Notes
    -----
    Cost of :meth:`attribute` for ``D`` embedding dimensions and a batch of
    ``B``: one plain forward pass per side (for the embeddings) and one
    recorded forward pass per side of ``c * B`` rows. By the transposed map
    (AttnLRP and CP-LRP, a side of ``n < D`` positions: tokens, or what
    ``pool`` leaves): one backward pass that records itself and ``ceil(n / c)``
    passes through it, the work of about ``2 * n * B`` example backward passes
    for the side. Otherwise ``ceil(D / c)`` backward passes of ``c * B`` rows, about
    ``D * B`` example backward passes for the side, as many as one
    attribution per dimension (each dimension's relevance is a map of its
    own; the recording saves their forward passes).
    :meth:`first_order` costs two plain forward passes and
    two attributions of ``B`` rows.

    Examples
    --------
    A token encoder (``(B, T)`` ids to ``(B, T, D)`` hidden states),
    mean-pooled:

    >>> import torch
    >>> from torch import nn
    >>> import relprop
    >>> encoder = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 8, bias=False), nn.ReLU(),
    ...                         nn.Linear(8, 4, bias=False)).eval()
    >>> bilrp = relprop.BiLRP(lambda ids: encoder(ids).mean(1), "attnlrp")
    >>> ids, ids2 = torch.randint(20, (2, 5)), torch.randint(20, (2, 7))
    >>> pairs = bilrp.attribute(ids, ids2)
    >>> pairs.shape                                      # (B, T1, T2)
    torch.Size([2, 5, 7])
    >>> similarity = (encoder(ids).mean(1) * encoder(ids2).mean(1)).sum(1)
    >>> torch.allclose(pairs.sum((1, 2)), similarity, atol=1e-5)
    True
    >>> left, right = bilrp.first_order(ids, ids2)
    >>> left.shape, right.shape                          # (B, T1), (B, T2)
    (torch.Size([2, 5]), torch.Size([2, 7]))
    """

    def __init__(self, embed: nn.Module | Callable[..., Any], composite: composites.Composite | str | None = None,
                 max_batch: int = 64, strict: bool = False):
        if not callable(embed):
            raise TypeError(f"relprop: embed must be a torch.nn.Module or a callable, got {type(embed).__name__}")
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"relprop: max_batch must be a positive integer, got {max_batch!r}")
        self.embed = embed
        self.composite = composites.get(composite)
        self.max_batch = max_batch
        self.strict = strict
        self._module: nn.Module | None = embed if isinstance(embed, nn.Module) else None

    # ------------------------------------------------------------------ embeddings

    def embedding(self, x: Tensor, additional_forward_args: Any = None) -> Tensor:
        """``phi(x)`` of shape ``(B, D)``, computed without rules and without gradients, in eval mode.

        A callable ``embed`` runs once more on its first call, to find its modules.
        """
        args, kwargs = forward_arguments(additional_forward_args)  # under no_grad: detached or not, the same
        with torch.no_grad():
            if self._module is None:
                with _outermost_modules() as found:
                    self.embed(x, *args, **kwargs)
                self._module = self._wrap(found)
            with evaluation(self._module):  # as the attributions see it (dropout off), which warn about it
                return self._checked(model_logits(self._module(x, *args, **kwargs)), x)

    def similarity(self, x: Tensor, x2: Tensor, additional_forward_args: Any = None,
                   additional_forward_args2: Any = None) -> Tensor:
        """``y = <phi(x_b), phi(x2_b)>`` for each example ``b``: shape ``(B,)``."""
        _check_pair(x, x2)
        return (self.embedding(x, additional_forward_args) * self.embedding(x2, additional_forward_args2)).sum(1)

    def _wrap(self, found: list[nn.Module]) -> nn.Module:
        if not found:
            raise TypeError("relprop: the embed callable ran no torch.nn.Module; relevance needs the model's modules "
                            "(pass the model, or a callable that calls it)")
        referenced = _referenced_modules(self.embed)
        modules: dict[str, nn.Module] = {}
        for index, module in enumerate(found):
            name, holder = _named_holder(module, referenced, f"module{index}")
            if not any(held is holder for held in modules.values()):
                modules[name if name.isidentifier() and name not in modules else f"module{index}"] = holder
        return _CallableEmbedding(self.embed, modules)

    @staticmethod
    def _checked(embedding: Tensor, x: Tensor) -> Tensor:
        if embedding.dim() != 2 or embedding.shape[0] != x.shape[0]:
            raise ValueError(f"relprop: embed must return embeddings of shape (batch, dimensions); for an input batch "
                             f"of {x.shape[0]} it returned shape {tuple(embedding.shape)}")
        if embedding.shape[1] == 0:
            raise ValueError("relprop: embed returned embeddings with 0 dimensions; there is no similarity to explain")
        if not embedding.is_floating_point():
            raise TypeError(f"relprop: embed returned a {embedding.dtype} tensor; embeddings must be floating point")
        return embedding

    # ------------------------------------------------------------------ relevance

    def attribute(self, x: Tensor, x2: Tensor, additional_forward_args: Any = None,
                  additional_forward_args2: Any = None, pool: Pool | None = None) -> Tensor:
        """Relevance of every pair of features ``(i, i')`` of ``x[b]`` and ``x2[b]`` for their similarity.

        Parameters
        ----------
        x, x2 : Tensor
            Two input batches of the same size ``B``, shapes ``(B, *S1)`` and
            ``(B, *S2)``: floating-point features, or integer token ids (of
            a model that embeds them; their relevance is one per token).
        additional_forward_args, additional_forward_args2 : tuple or dict, optional
            Further arguments of ``embed`` for ``x`` and for ``x2``
            (``{"attention_mask": mask}``). Tensors among them must be batch
            first: they are repeated with the inputs.
        pool : callable, optional
            Reduces each side's relevance, ``(N, *S) -> (N, *P)``, before the
            pairs are formed (sum over patches of an image: use a sum, not a
            mean, to keep the total).

        Returns
        -------
        Tensor of shape ``(B, *S1, *S2)``, ``(B, T1, T2)`` for token inputs, or
        ``(B, *P1, *P2)`` with ``pool``. It sums to ``similarity(x, x2)`` when
        the rules conserve relevance.
        """
        _check_pair(x, x2)
        for extra in (additional_forward_args, additional_forward_args2):
            _repeat_extra(extra, 1, x.shape[0])  # checks that they are batch first before anything runs
        left, right = self.embedding(x, additional_forward_args), self.embedding(x2, additional_forward_args2)
        if left.shape[1] != right.shape[1]:
            raise ValueError(f"relprop: the embeddings of x and x2 differ in size: {left.shape[1]} and "
                             f"{right.shape[1]} dimensions")
        batch, dims = left.shape
        copies = self._copies(batch, dims)
        # as in LRP.attribute: the passes need autograd under inference_mode too, and leave no reference cycles
        with torch.inference_mode(False), cyclic_gc_paused():
            lrp = self._lrp()
            sides = [self._side(lrp, x, additional_forward_args, left, pool),
                     self._side(lrp, x2, additional_forward_args2, right, pool)]
            step = copies if any(isinstance(side, ForwardPass) for side in sides) else dims
            total: Tensor | None = None
            for start in range(0, dims, step):
                chunk = range(start, min(start + step, dims))
                r1, r2 = (side[start:chunk.stop] if isinstance(side, Tensor) else
                          _per_dimension(side, embedding, chunk, pool)
                          for side, embedding in zip(sides, (left, right)))
                # sum over the dimensions of this chunk of the outer products, example by example
                pairs = torch.einsum("kbi,kbj->bij", r1.flatten(2), r2.flatten(2))
                total = pairs if total is None else total + pairs
        assert total is not None  # _checked refuses embeddings without dimensions
        return total.reshape(batch, *r1.shape[2:], *r2.shape[2:])

    def _side(self, lrp: LRP, x: Tensor, extra: Any, embedding: Tensor, pool: Pool | None) -> Tensor | ForwardPass:
        """One side's relevance for every dimension, ``(D, B, *P)``, by the transposed map where it serves; else
        its pass recorded with copies for one backward pass per chunk of dimensions (see the module's notes)."""
        batch, dims = embedding.shape
        positions = pooled(torch.zeros(x.shape, dtype=embedding.dtype, device=embedding.device), pool)[0].numel()
        if lrp.composite.gradient_form and positions < dims and additive(pool, x.shape, embedding):
            # attention's fused kernels have backward passes that cannot be differentiated; its math form's can. It
            # holds each head's scores, about positions ** 2 of them per copy: copies past SCORES of them are not
            # worth their memory
            copies = self._copies(batch, positions, min(self.max_batch, batch * max(1, SCORES // positions ** 2)))
            with sdpa_kernel(SDPBackend.MATH):
                explained = _record(lrp, x, extra, copies)
            if explained.gradient_form:
                found = transposed_relevance(explained, embedding, pool)
                if found is not None:
                    return found
        return _record(lrp, x, extra, self._copies(batch, dims))

    def _copies(self, batch: int, count: int, rows: int | None = None) -> int:
        """Copies of the inputs per recorded pass, for ``count`` seeds or positions: at most ``rows`` rows
        (``max_batch``), the groups as even as that allows."""
        largest = min(count, max(1, (rows or self.max_batch) // batch))
        passes = -(-count // largest)
        return -(-count // passes)

    def first_order(self, x: Tensor, x2: Tensor, additional_forward_args: Any = None,
                    additional_forward_args2: Any = None) -> tuple[Tensor, Tensor]:
        """First-order relevance of each side for the similarity, the other side held fixed.

        ``x``'s relevance is LRP of ``phi(x)`` seeded with ``phi(x) * phi(x2)``
        (each dimension's share of ``y``); likewise for ``x2``. Each sums to
        ``y`` under conservative rules, and equals the pair relevance summed
        over the other side when that side conserves.

        Returns
        -------
        tuple of Tensor, shapes ``(B, *S1)`` and ``(B, *S2)`` (``(B, T)`` for tokens).
        """
        _check_pair(x, x2)
        left, right = self.embedding(x, additional_forward_args), self.embedding(x2, additional_forward_args2)
        lrp = self._lrp()
        share = left * right
        return (lrp.attribute(x, target=share, additional_forward_args=additional_forward_args),
                lrp.attribute(x2, target=share, additional_forward_args=additional_forward_args2))

    def _lrp(self) -> LRP:
        assert self._module is not None  # set by embedding()
        return LRP(self._module, self.composite, strict=self.strict)

    def __repr__(self) -> str:
        return f"BiLRP({type(self.embed).__name__}, {self.composite!r}, max_batch={self.max_batch})"


def _check_pair(x: Tensor, x2: Tensor) -> None:
    if not isinstance(x, Tensor) or not isinstance(x2, Tensor):
        raise TypeError(f"relprop: BiLRP explains a pair of tensors, got {type(x).__name__} and {type(x2).__name__}")
    if x.dim() == 0 or x2.dim() == 0 or x.shape[0] != x2.shape[0]:
        raise ValueError(f"relprop: x and x2 must be batches of the same size (example b against example b), got "
                         f"shapes {tuple(x.shape)} and {tuple(x2.shape)}")


def _record(lrp: LRP, x: Tensor, extra: Any, copies: int) -> ForwardPass:
    """One reusable forward pass of ``copies`` copies of the batch, for ``copies`` dimensions per backward pass."""
    return lrp.record(_repeat(x, copies), _repeat_extra(extra, copies, x.shape[0]), reusable=True)


def _per_dimension(explained: ForwardPass, embedding: Tensor, chunk: range, pool: Pool | None) -> Tensor:
    """``R(phi_m)(x)`` for each ``m`` in ``chunk`` from a pass of copies of ``x``: ``(len(chunk), B, *S)``, pooled.

    Copy ``k`` is seeded with dimension ``chunk[k]``; copies past the chunk get no relevance and are dropped.
    """
    batch, used = embedding.shape[0], len(chunk)
    rows = torch.arange(used * batch, device=embedding.device)
    chosen = torch.as_tensor(list(chunk), device=embedding.device).repeat_interleave(batch)
    seed = torch.zeros_like(explained.logits)
    seed[rows, chosen] = embedding.repeat(used, 1)[rows, chosen]
    (relevance,) = explained.relevance(seed)
    relevance = pooled(relevance, pool)
    return relevance.reshape(relevance.shape[0] // batch, batch, *relevance.shape[1:])[:used]


def _repeat(x: Tensor, copies: int) -> Tensor:
    """``copies`` copies of the batch one after the other: row ``k * B + b`` is example ``b``."""
    return x.repeat(copies, *([1] * (x.dim() - 1)))


def _repeat_extra(value: Any, copies: int, batch: int) -> Any:
    """``additional_forward_args`` with every tensor repeated like the inputs (they must be batch first)."""
    positional, keywords = forward_arguments(value)
    named = [*((f"argument {index}", item) for index, item in enumerate(positional)),
             *((f"argument {key!r}", item) for key, item in keywords.items())]
    for where, item in named:
        if isinstance(item, Tensor) and (item.dim() == 0 or item.shape[0] != batch):
            raise ValueError(f"relprop: BiLRP repeats the tensors of additional_forward_args with the inputs, so they "
                             f"must be batch first; {where} has shape {tuple(item.shape)} for a batch of {batch}")
    if value is None:
        return None
    positional, keywords = tile_arguments((positional, keywords), batch, copies)
    return keywords if isinstance(value, Mapping) else positional