"""Which heads, MLPs and residual positions carry a behaviour: activation, attribution and relevance patching.

The kinds of component (heads, MLPs, the residual stream, attention and MLP
outputs per position) are objects of :mod:`relprop.workflows.components`;
the methods below work on any of them.

A clean and a corrupted prompt of equal length differ where the behaviour does
(" John gave a drink to" after "Mary and John" against after "John and Mary"),
and a metric ``m`` of the logits measures it (``logit[" Mary"] - logit[" John"]``
at the last position). The effect of a component is ``m(corrupted run with the
component's clean activation) - m(corrupted run)``: positive where the clean
activation alone moves the metric towards the clean run's.

- ``"activation"`` patching measures it: one patched forward pass per
  component, batched.
- ``"attribution"`` patching estimates all effects from the first-order term
  ``(a_clean - a_corrupted) . dm/da``, the gradient at the corrupted run, summed
  over the component's entries and positions.
- ``"relp"`` (relevance patching, Jafari et al. 2025) puts the relevance per
  unit of activation ``R / a`` of an LRP composite in place of the gradient.
  Under AttnLRP and CP-LRP it is what the engine carries between ops
  (the gradient form): a modified gradient read at any tensor of the pass.
  Where the composite carries relevance itself (``epsilon``), ``R / a``.

Both estimates cost two forward passes (one under the engine) and one backward
pass for every component at once.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Union

import torch
from torch import Tensor, nn

from relprop import composites
from relprop._core.modules import evaluation
from relprop._core.tensors import per_unit
from relprop.methods.attribution import LRP
from relprop.methods.targets import model_logits
from relprop.workflows.components import COMPONENTS, Component, resolve
from relprop.workflows.decoders import Decoder, Site, capture, find_decoder, replace

__all__ = ["COMPONENTS", "METHODS", "Patching", "patching", "recovery"]

METHODS = ("activation", "attribution", "relp")
#: the answer and foil token ids (ints or ``(B,)`` tensors), or a function of the logits to a ``(B,)`` metric
PatchTarget = Union[tuple[Any, Any], Callable[[Tensor], Tensor]]
#: the tokens a batch of patched runs holds at most (copies x batch x length)
TOKENS_PER_RUN = 1024


def _metric(target: PatchTarget, batch: int, vocabulary: int | None) -> Callable[[Tensor], Tensor]:
    """``logits -> (B,)``: a callable as given, or ``logit[answer] - logit[foil]`` at the last position."""
    if callable(target):
        return target
    if not isinstance(target, (tuple, list)) or len(target) != 2:
        raise TypeError(f"relprop: target must be (answer, foil) token ids or a function of the logits, got "
                        f"{type(target).__name__}")
    ids = []
    for name, value in zip(("answer", "foil"), target):
        tensor = torch.as_tensor(value)
        if tensor.is_floating_point() or tensor.dtype == torch.bool or tensor.dim() > 1:
            raise ValueError(f"relprop: the {name} must be a token id or a (batch,) tensor of them, got {value!r}")
        tensor = tensor.long().reshape(-1).expand(batch) if tensor.numel() == 1 else tensor.long()
        if tensor.shape != (batch,):
            raise ValueError(f"relprop: {tensor.numel()} {name} ids for a batch of {batch} prompt pairs")
        if vocabulary is not None and not bool(((tensor >= 0) & (tensor < vocabulary)).all()):
            raise ValueError(f"relprop: the {name} ids {tensor.tolist()} are outside the vocabulary of {vocabulary}")
        ids.append(tensor)
    answer, foil = ids

    def difference(logits: Tensor) -> Tensor:
        last = logits[:, -1]
        rows = torch.arange(last.shape[0], device=last.device)
        return last[rows, answer.to(last.device)] - last[rows, foil.to(last.device)]
    return difference


def _evaluating(model: nn.Module) -> AbstractContextManager[None]:
    """The model in eval mode inside the block (with a warning if it was not), as it was after it."""
    return evaluation(model, "relprop: the model is in training mode; it is patched in eval mode (dropout off) and "
                      "put back afterwards")


class Patching:
    """One batch of clean and corrupted prompts of a decoder, and what patching measures on it.

    :func:`patching` is the short form; this class keeps the decoder found and the metric, for several methods
    and components on the same prompts (the benchmark, the command line).

    Parameters
    ----------
    model, clean_ids, corrupted_ids, target, attention_mask :
        As for :func:`patching`.
    """

    def __init__(self, model: nn.Module, clean_ids: Tensor, corrupted_ids: Tensor, target: PatchTarget,
                 attention_mask: Tensor | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"relprop: model must be a torch.nn.Module, got {type(model).__name__}")
        clean, corrupted = (torch.as_tensor(ids) for ids in (clean_ids, corrupted_ids))
        for name, ids in (("clean_ids", clean), ("corrupted_ids", corrupted)):
            if ids.dim() != 2 or ids.is_floating_point() or ids.dtype == torch.bool:
                raise ValueError(f"relprop: {name} must be token ids of shape (batch, length), got "
                                 f"{tuple(ids.shape)} {ids.dtype}")
        if clean.shape != corrupted.shape:
            raise ValueError(f"relprop: clean_ids {tuple(clean.shape)} and corrupted_ids {tuple(corrupted.shape)} "
                             "must have the same shape: patching swaps activations position by position")
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(clean.shape):
            raise ValueError(f"relprop: attention_mask has shape {tuple(attention_mask.shape)}; the prompts have "
                             f"{tuple(clean.shape)}")
        self.model = model
        self.decoder: Decoder = find_decoder(model)
        self.clean, self.corrupted = clean.long(), corrupted.long()
        self.attention_mask = attention_mask
        self.batch, self.length = clean.shape
        vocabulary = getattr(getattr(model, "config", None), "vocab_size", None)
        self.metric = _metric(target, self.batch, vocabulary if isinstance(vocabulary, int) else None)
        # a pair target reads the last position only: models that can compute the logits there alone do
        keep = not callable(target) and "logits_to_keep" in _parameters(model)
        self._keywords: dict[str, Any] = {"logits_to_keep": 1} if keep else {}
        self._activations: dict[bool, dict[str, list[Tensor]]] = {}  # by run (clean?), then by components
        self._metrics: tuple[Tensor, Tensor] | None = None

    # the forward passes

    def _arguments(self, copies: int = 1) -> dict[str, Any]:
        keywords = dict(self._keywords)
        if self.attention_mask is not None:
            keywords["attention_mask"] = self.attention_mask.repeat(copies, 1)
        return keywords

    def _run(self, ids: Tensor, copies: int = 1) -> Tensor:
        """The metric of each copy of ``ids`` (one forward pass): ``(copies, B)``."""
        with torch.no_grad():
            logits = model_logits(self.model(ids.repeat(copies, 1), **self._arguments(copies)))
        return torch.stack([self.metric(chunk) for chunk in logits.split(self.batch)])

    def activations(self, components: str | Component, clean: bool) -> list[Tensor]:
        """The activation at each site of ``components`` in the clean (or corrupted) run, kept once computed.

        One forward pass keeps those of every kind of component registered (and of ``components``).
        """
        kind = resolve(components)
        kept = self._activations.setdefault(clean, {})
        if kind.name not in kept:
            # kinds are known by name: one given that is not the registered kind of its name comes first
            kinds = [*([] if COMPONENTS.get(kind.name) is kind else [kind]), *COMPONENTS.values()]
            unique, where = _unique([site for each in kinds for site in each.sites(self.decoder)])
            with torch.no_grad(), capture(unique) as found:
                model_logits(self.model(self.clean if clean else self.corrupted, **self._arguments()))
            checked = _checked(found, unique, self.batch)
            tensors = [checked[i] for i in where]
            for each in kinds:
                count = len(each.sites(self.decoder))
                kept.setdefault(each.name, tensors[:count])
                tensors = tensors[count:]
        return kept[kind.name]

    def metrics(self) -> tuple[Tensor, Tensor]:
        """``(B,)`` metrics of the clean and of the corrupted run."""
        if self._metrics is None:
            self._metrics = (self._run(self.clean)[0], self._run(self.corrupted)[0])
        return self._metrics

    def patched(self, components: str | Component, masks: dict[int, Tensor]) -> Tensor:
        """The metric of the corrupted run with chosen units clean, for ``K`` choices at once: ``(K, B)``.

        ``masks[i]`` is a ``(K, B, units)`` boolean tensor for site ``i`` of ``components``: which units (heads,
        positions; for ``"mlps"`` one unit) take their clean activation in copy ``k``.
        """
        return self.patched_together({resolve(components): masks})

    def patched_together(self, masks: dict[Component, dict[int, Tensor]]) -> Tensor:
        """:meth:`patched` for units of several kinds at once (a circuit of heads and MLPs): ``(K, B)``.

        ``masks[kind][i]`` is a ``(K, B, units)`` boolean tensor for site ``i`` of ``kind``; every mask has the same
        ``K``. A site two kinds share takes the clean entries of both.
        """
        sites: list[Site] = []
        edits: list[Callable[[Tensor], Tensor]] = []
        copies = next(iter(next(iter(masks.values())).values())).shape[0]
        for kind, chosen in masks.items():
            own, clean = kind.sites(self.decoder), self.activations(kind, True)
            for i, mask in chosen.items():
                sites.append(own[i])
                edits.append(self._edit(kind, clean[i], mask, copies))
        with replace(sites, dict(enumerate(edits))):
            return self._run(self.corrupted, copies)

    def _edit(self, kind: Component, clean: Tensor, mask: Tensor, copies: int) -> Callable[[Tensor], Tensor]:
        """The edit of one site: its clean entries where ``mask`` (``(K, B, units)``) chooses a unit."""
        def patch(tensor: Tensor) -> Tensor:
            rows = mask.reshape(copies * self.batch, -1).to(tensor.device)
            source = clean.repeat(copies, 1, 1)
            return torch.where(kind.select(rows, tensor, self.decoder), source.view_as(tensor), tensor)
        return patch

    # the methods

    def activation(self, components: str | Component) -> Tensor:
        """Exact activation patching: ``m(corrupted, component clean) - m(corrupted)`` for every component."""
        kind = resolve(components)
        sites, units = kind.sites(self.decoder), kind.units(self.decoder, self.length)
        clean, corrupted = self.activations(kind, True), self.activations(kind, False)
        # a component whose activations are the same in both runs has no effect: no run for it (the residual
        # stream before the first token that differs)
        differs = torch.stack([kind.reduce((a != b).to(a.dtype), self.decoder).reshape(self.batch, -1) != 0
                               for a, b in zip(clean, corrupted)], 1).any(0).flatten()  # (sites * units,)
        run = differs.nonzero().flatten().tolist()
        per_run = max(1, TOKENS_PER_RUN // (self.batch * self.length))
        found = torch.zeros(len(sites) * units, self.batch, dtype=self.metrics()[1].dtype)
        for start in range(0, len(run), per_run):
            chosen = run[start:start + per_run]
            masks: dict[int, Tensor] = {}
            for copy, component in enumerate(chosen):
                site, unit = divmod(component, units)
                if site not in masks:
                    masks[site] = torch.zeros(len(chosen), self.batch, units, dtype=torch.bool)
                masks[site][copy, :, unit] = True
            found[chosen] = self.patched(kind, masks).to(found.device) - self.metrics()[1]
        return kind.shape(found.T.reshape(self.batch, len(sites), units))

    def coefficients(self, components: Iterable[str | Component], composite: composites.Composite | str | None,
                     at: str = "corrupted") -> dict[str, list[Tensor]]:
        """``dm/da`` (``composite`` None) or the relevance per unit of activation ``R / a`` at every site.

        One forward pass over the clean or the corrupted prompts (``at``), under the engine for a composite, and
        one backward pass for all sites of all ``components``.
        """
        if at not in ("clean", "corrupted"):
            raise ValueError(f"relprop: coefficients are read at the clean or the corrupted run, not {at!r}")
        kinds = [resolve(name) for name in components]
        sites, where = _unique([site for kind in kinds for site in kind.sites(self.decoder)])
        ids = self.clean if at == "clean" else self.corrupted
        # the plain gradient starts where the first layer does: also for a model whose parameters need no grad
        start = {0: lambda tensor: tensor.detach().requires_grad_()} if composite is None else {}
        with torch.inference_mode(False), replace(self.decoder.residual, start), capture(sites) as found:
            if composite is None:
                with torch.enable_grad():
                    logits = model_logits(self.model(ids, **self._arguments()))
                gradient_form = True
            else:
                explained = LRP(self.model, composite).record(ids, self._arguments(), reusable=True)
                logits, gradient_form = explained.logits, explained.gradient_form
        tensors = _checked(found, sites, self.batch)
        versions = [tensor._version for tensor in tensors]
        with torch.inference_mode(False), torch.enable_grad():
            leaf = logits.detach().requires_grad_()
            (seed,) = torch.autograd.grad(self.metric(leaf).sum(), leaf)
            if not gradient_form:  # the relevance carried itself: the metric's share of each logit
                seed = seed * logits.detach()
            wanted = [tensor for tensor in tensors if tensor.requires_grad]
            grads = iter(torch.autograd.grad(logits, wanted, seed, allow_unused=True) if wanted else ())
        coefficients = []
        for tensor, site, version in zip(tensors, sites, versions):
            if tensor._version != version:
                raise ValueError(f"relprop: the tensor at {site.name} was modified in place after it was read; "
                                 "patching cannot read its gradient")
            grad = next(grads) if tensor.requires_grad else None
            grad = torch.zeros_like(tensor) if grad is None else grad
            coefficients.append(grad if gradient_form else per_unit(grad, tensor.detach()))
        coefficients, tensors = [coefficients[i] for i in where], [tensors[i] for i in where]
        found_by: dict[str, list[Tensor]] = {}
        for kind in kinds:
            count = len(kind.sites(self.decoder))
            found_by[kind.name], coefficients = coefficients[:count], coefficients[count:]
            # the activations of this run, for the estimate: no second forward pass over the same prompts
            self._activations.setdefault(at == "clean", {}).setdefault(kind.name,
                                                                       [t.detach() for t in tensors[:count]])
            tensors = tensors[count:]
        return found_by

    def estimate(self, components: Iterable[str | Component], composite: composites.Composite | str | None,
                 at: str = "corrupted") -> dict[str, Tensor]:
        """``(a_clean - a_corrupted) . c``, summed over each component's entries and positions, with ``c`` the
        gradient (``composite`` None) or the relevance per unit of activation, read at ``at``: ``"corrupted"``,
        ``"clean"``, or ``"both"`` (their mean, the trapezoidal rule: a second pass under the engine)."""
        if at not in ("clean", "corrupted", "both"):
            raise ValueError(f"relprop: coefficients are read at the clean run, the corrupted run or both, not {at!r}")
        kinds = [resolve(name) for name in components]
        if at == "both":
            runs = [self.coefficients(kinds, composite, side) for side in ("clean", "corrupted")]
            found = {kind.name: [(a + b) / 2 for a, b in zip(runs[0][kind.name], runs[1][kind.name])]
                     for kind in kinds}
        else:
            found = self.coefficients(kinds, composite, at)
        estimates = {}
        for kind in kinds:
            clean, corrupted = self.activations(kind, True), self.activations(kind, False)
            products = [(a - b) * c for a, b, c in zip(clean, corrupted, found[kind.name])]
            estimates[kind.name] = kind.shape(torch.stack([kind.reduce(p, self.decoder) for p in products], 1))
        return estimates


def _unique(sites: Sequence[Site]) -> tuple[list[Site], list[int]]:
    """The distinct sites (one hook each where kinds share a site), and where each of ``sites`` is among them."""
    index: dict[Site, int] = {}
    for site in sites:
        index.setdefault(site, len(index))
    return list(index), [index[site] for site in sites]


def _parameters(model: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _checked(found: Sequence[Tensor | None], sites: Sequence[Site], batch: int) -> list[Tensor]:
    """The tensors captured at ``sites``, each ``(B, T, width)``; an error naming a site that did not run."""
    tensors = []
    for tensor, site in zip(found, sites):
        if tensor is None:
            raise ValueError(f"relprop: {site.name} did not run in the forward pass")
        if tensor.dim() != 3 or tensor.shape[0] != batch:
            raise ValueError(f"relprop: patching expects a (batch, length, width) tensor at {site.name}, found "
                             f"{tuple(tensor.shape)}")
        tensors.append(tensor)
    return tensors


def _components(components: str | Component | Sequence[str | Component]) -> list[Component]:
    given = [components] if isinstance(components, (str, Component)) else list(components)
    if not given:
        raise ValueError(f"relprop: no components given; choose from {', '.join(COMPONENTS)}")
    return [resolve(name) for name in given]


#: where relp reads its coefficients (the benchmark measures both; see docs/guide/patching.md)
RELP_AT = "corrupted"


def patching(model: nn.Module, clean_ids: Tensor, corrupted_ids: Tensor, target: PatchTarget, *,
             components: str | Component | Sequence[str | Component] = "heads", method: str = "relp",
             composite: composites.Composite | str = "relp",
             attention_mask: Tensor | None = None) -> Tensor | dict[str, Tensor]:
    """The effect of each head, MLP or residual position on a metric: patched, or estimated by gradient or LRP.

    The effect of a component is ``m(corrupted run, that component's activation from the clean run) -
    m(corrupted run)``: positive where the clean activation alone moves the metric the way the clean run does
    (for ``logit[answer] - logit[foil]``, towards the answer).

    Parameters
    ----------
    model : nn.Module
        A decoder language model (Llama, Qwen2, Mistral, GPT-2, ...): its layers, each layer's attention output
        projection and MLP, and the number of heads are found from its modules and config.
    clean_ids, corrupted_ids : Tensor
        ``(B, T)`` token ids of the same shape.
    target : (answer, foil) or callable
        Token ids (ints or ``(B,)`` tensors): the metric is ``logit[answer] - logit[foil]`` at the last position.
        Or a function from the model's logits to a ``(B,)`` metric.
    components : {"heads", "mlps", "residual", "attn_out", "mlp_out"}, a Component, or a sequence of them
        ``"heads"``: ``(B, layers, heads)``, each head's slice of the input of the attention's output projection,
        all positions. ``"mlps"``: ``(B, layers)``, each MLP's output, all positions. ``"residual"``:
        ``(B, layers + 1, T)``, the hidden state entering each layer and leaving the last, per position.
        ``"attn_out"``: ``(B, layers, T)``, each attention block's output per position. ``"mlp_out"``:
        ``(B, layers, T)``, each MLP's output per position. Other kinds: :data:`COMPONENTS`
        (:mod:`relprop.workflows.components`). A sequence returns a dict by name, from one pass for the
        estimates.
    method : {"relp", "attribution", "activation"}
        ``"activation"``: exact, one patched forward pass per component (batched). ``"attribution"``:
        ``(a_clean - a_corrupted) . dm/da`` with the gradient at the corrupted run. ``"relp"``: the same with
        the composite's relevance per unit of activation in place of the gradient, read at the corrupted run.
    composite : Composite or str
        The rules of ``"relp"``: ``"relp"`` (RelP's default rules, measured best across component types on
        SmolLM2: docs/guide/patching.md), ``"relp-ah"``, ``"attnlrp"``, ``"cp-lrp"``, ``"epsilon"``, ...
    attention_mask : Tensor, optional
        ``(B, T)``, for both runs.

    Returns
    -------
    Tensor, or a dict of them for a sequence of components. The model is left as it was (no hook stays).

    Examples
    --------
    >>> import torch, transformers
    >>> import relprop
    >>> config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2,
    ...                                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=32)
    >>> model = transformers.LlamaForCausalLM(config).eval()
    >>> clean, corrupted = torch.tensor([[3, 7, 9, 4]]), torch.tensor([[3, 8, 9, 4]])
    >>> relprop.patching(model, clean, corrupted, (5, 6)).shape
    torch.Size([1, 2, 4])
    """
    kinds = _components(components)
    if method not in METHODS:
        raise ValueError(f"relprop: unknown method {method!r}; choose from {', '.join(METHODS)}")
    rules = composites.get(composite) if method == "relp" else None
    with _evaluating(model):
        pair = Patching(model, clean_ids, corrupted_ids, target, attention_mask)
        if method == "activation":
            found = {kind.name: pair.activation(kind) for kind in kinds}
        else:
            found = pair.estimate(kinds, rules, RELP_AT if method == "relp" else "corrupted")
    return found[kinds[0].name] if isinstance(components, (str, Component)) else found


def recovery(model: nn.Module, clean_ids: Tensor, corrupted_ids: Tensor, target: PatchTarget, scores: Tensor,
             ks: Sequence[int], attention_mask: Tensor | None = None) -> Tensor:
    """The share of the clean-minus-corrupted metric recovered by the ``k`` heads of highest score, kept clean.

    For each ``k`` of ``ks``, the corrupted run with the ``k`` heads of highest ``scores`` (per prompt pair, a
    ``(B, layers, heads)`` tensor such as :func:`patching` returns) at their clean activations, all others
    corrupted: ``(m(patched) - m(corrupted)) / (m(clean) - m(corrupted))``, ``(B, len(ks))``. One forward pass
    for all ``k``. A pair whose clean and corrupted metric are equal (to within 100 units of rounding of their
    size) has no share to recover: a ``ValueError`` names it.
    """
    with _evaluating(model):
        pair = Patching(model, clean_ids, corrupted_ids, target, attention_mask)
        layers, heads = len(pair.decoder.heads), pair.decoder.head_count
        if tuple(scores.shape) != (pair.batch, layers, heads):
            raise ValueError(f"relprop: scores of shape {tuple(scores.shape)}; the heads are "
                             f"{(pair.batch, layers, heads)}")
        if not ks or any(not 0 <= k <= layers * heads for k in ks):
            raise ValueError(f"relprop: ks {list(ks)} must lie between 0 and the {layers * heads} heads")
        order = scores.reshape(pair.batch, -1).argsort(1, descending=True)
        chosen = torch.zeros(len(ks), pair.batch, layers * heads, dtype=torch.bool)
        for copy, k in enumerate(ks):
            chosen[copy].scatter_(1, order[:, :k], True)
        chosen = chosen.view(len(ks), pair.batch, layers, heads)
        clean, corrupted = pair.metrics()
        _check_gap(clean, corrupted)
        patched = pair.patched("heads", {layer: chosen[:, :, layer] for layer in range(layers)})
    return ((patched - corrupted) / (clean - corrupted)).T


def _check_gap(clean: Tensor, corrupted: Tensor) -> None:
    """A ``ValueError`` naming the prompt pairs whose clean and corrupted metric are equal, or differ by no more
    than the rounding of a few ops on numbers of their size: the share recovered is undefined (0 / 0) or noise."""
    size = torch.maximum(clean.abs(), corrupted.abs())
    same = ((clean - corrupted).abs() <= 100 * torch.finfo(clean.dtype).eps * size).nonzero().flatten().tolist()
    if same:
        raise ValueError(f"relprop: the clean and the corrupted prompt give the same metric in prompt pair(s) {same} "
                         f"({', '.join(f'{clean[i].item():.6g} and {corrupted[i].item():.6g}' for i in same)}): the "
                         "share recovered, (m(patched) - m(corrupted)) / (m(clean) - m(corrupted)), is undefined; "
                         "choose prompts that differ in the behaviour the metric measures")
