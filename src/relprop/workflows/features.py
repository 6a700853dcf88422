"""Sparse-autoencoder features spliced into a model: latents and the reconstruction error as components.

Any object with ``encode`` and ``decode`` (an SAELens ``SAE``, a user's module)
is spliced into the output ``y`` of the module at a path, as sparse-feature
circuits do (Marks et al. 2024)::

    f = encode(y)                 the latents, (B, T, d_sae)
    e = y - decode(f)             the reconstruction error, its own term
    y' = decode(f) + e            what the model passes on: y, up to rounding

The latents the decoder reads and the error are each the output of an identity
module of the splice (:class:`Splice`), so patching captures and replaces them
like any site: activation patching of a latent puts its clean value into the
corrupted run and keeps the corrupted error term; the estimates read the
gradient (or the relevance per unit of activation) at the latents. The gradient
of ``y'`` by ``y`` is the identity, so the splice changes no gradient elsewhere in
the model; LRP's relevance below the splice now also crosses the SAE's encoder.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from relprop import composites
from relprop.methods.attribution import LRP
from relprop.methods.targets import target_mask
from relprop.workflows.components import Component, Positions
from relprop.workflows.decoders import Decoder, Site, capture

__all__ = ["ERROR", "Latents", "Splice", "error_term", "latent_relevance", "spliced"]

#: the suffix of a path's reconstruction-error term among the results (``"model.layers.3.mlp:error"``)
ERROR = ":error"


class Splice(nn.Module):
    """``y -> decode(encode(y)) + (y - decode(encode(y)))``, with the latents and the error as module outputs.

    Parameters
    ----------
    sae : object
        Has ``encode(y) -> latents`` and ``decode(latents) -> y``.
    path : str
        Where it is spliced, for names and messages.
    """

    def __init__(self, sae: Any, path: str) -> None:
        super().__init__()
        for method in ("encode", "decode"):
            if not callable(getattr(sae, method, None)):
                raise TypeError(f"relprop: the feature dictionary at {path!r} ({type(sae).__name__}) has no "
                                f"{method} method; splicing needs encode and decode")
        self.sae, self.path = sae, path
        self.latents = nn.Identity()  # the latents the decoder reads: the site of the latents
        self.error = nn.Identity()  # the reconstruction error: its own site

    def forward(self, y: Tensor) -> Tensor:
        """The spliced output: ``y`` up to rounding, through the SAE."""
        f = self.sae.encode(y)
        error = self.error(y - self.sae.decode(f))
        # a copy for the decoder: the latents' gradient is then the decoder's alone, not cancelled by the error's
        return self.sae.decode(self.latents(f.clone())) + error


@contextmanager
def spliced(model: nn.Module, features: Mapping[str, Any]) -> Iterator[dict[str, Splice]]:
    """Splice ``features[path]`` into the output of ``model``'s module at each path inside the block.

    The output (or a tuple output's first entry) is replaced by :class:`Splice`'s; the hooks go on exit, also when
    an exception flies. Yields the splices by path.
    """
    if not isinstance(features, Mapping) or not features:
        raise ValueError("relprop: features must be a non-empty dict {module path: object with encode and decode}")
    splices, handles = {}, []
    try:
        for path, sae in features.items():
            try:
                module = model.get_submodule(path)
            except AttributeError as error:
                raise ValueError(f"relprop: the model has no module {path!r} to splice features into") from error
            splice = splices[path] = Splice(sae, path)

            def hook(module: nn.Module, args: tuple, output: Any, splice: Splice = splice) -> Any:
                if isinstance(output, Tensor):
                    return splice(output)
                return (splice(output[0]), *output[1:])
            handles.append(module.register_forward_hook(hook))
        yield splices
    finally:
        for handle in handles:
            handle.remove()


class Latents(Component):
    """The latents of a spliced SAE, each at each position: ``(B, T, d_sae)``.

    Parameters
    ----------
    splice : Splice
        Its :attr:`Splice.latents` is the one site; the results are named by its path.
    """

    def __init__(self, splice: Splice) -> None:
        self.splice = splice
        self._width = 0
        super().__init__(splice.path, lambda decoder: (Site(splice.latents, True, f"{splice.path}:latents"),),
                         "(B, T, d_sae): each latent of the SAE spliced at this path, at each position")

    def units(self, decoder: Decoder, length: int) -> int:
        """``T * d_sae``, ``d_sae`` read from the SAE's decoder (``W_dec``) or by decoding nothing."""
        self._width = _latent_width(self.splice.sae)
        return length * self._width

    def reduce(self, product: Tensor, decoder: Decoder) -> Tensor:
        """Each entry its own unit: ``(B, T * d_sae)``."""
        self._width = product.shape[-1]
        return product.reshape(product.shape[0], -1)

    def select(self, mask: Tensor, tensor: Tensor, decoder: Decoder) -> Tensor:
        """The entry of each chosen unit."""
        return mask.view(tensor.shape)

    def shape(self, effects: Tensor) -> Tensor:
        """``(B, T, d_sae)``: the one site dropped."""
        return effects.view(effects.shape[0], -1, self._width)


def _latent_width(sae: Any) -> int:
    weight = getattr(sae, "W_dec", None)
    if isinstance(weight, Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    config = getattr(sae, "cfg", None)
    width = getattr(config, "d_sae", None)
    if isinstance(width, int):
        return width
    raise ValueError(f"relprop: cannot tell the number of latents of {type(sae).__name__}: give it a (d_sae, d_in) "
                     "W_dec or a cfg.d_sae")


def error_term(splice: Splice) -> Component:
    """The reconstruction error of a splice, one unit per position: ``(B, T)``, named ``path + ":error"``."""
    return _Error(splice.path + ERROR, lambda decoder: (Site(splice.error, True, f"{splice.path}:error"),),
                  "(B, T): the reconstruction error of the SAE spliced at this path, at each position")


class _Error(Positions):
    def shape(self, effects: Tensor) -> Tensor:
        """``(B, T)``: the one site dropped."""
        return effects.squeeze(1)


def latent_relevance(model: nn.Module, input_ids: Tensor, target: Any, features: Mapping[str, Any],
                     composite: composites.Composite | str = "attnlrp",
                     additional_forward_args: Any = None) -> dict[str, Tensor]:
    """The LRP relevance of every latent of SAEs spliced into ``model``, and of each reconstruction error.

    Parameters
    ----------
    model : nn.Module
    input_ids : Tensor
        The model's input.
    target :
        What to explain, as for :meth:`relprop.LRP.attribute` (``(-1, token)``: a token's logit at the last
        position).
    features : dict
        ``{module path: object with encode and decode}``, spliced as :func:`spliced` does.
    composite : Composite or str
    additional_forward_args :
        As for :meth:`relprop.LRP.record`.

    Returns
    -------
    dict
        ``{path: (B, T, d_sae)}`` for the latents and ``{path + ":error": (B, T)}`` for the error summed over its
        width.
    """
    with spliced(model, features) as splices:
        sites = [Site(module, True, path) for splice in splices.values() for path, module in
                 ((splice.path, splice.latents), (splice.path + ERROR, splice.error))]
        with torch.inference_mode(False), capture(sites) as found:
            explained = LRP(model, composite).record(input_ids, additional_forward_args, reusable=True)
    tensors = [tensor for tensor in found if tensor is not None]
    if len(tensors) != len(sites):
        raise ValueError("relprop: a module given in features did not run in the forward pass")
    with torch.inference_mode(False), torch.enable_grad():
        logits = explained.logits.detach()
        # the seed: the target logit's relevance, or in the gradient form one per unit of logit
        seed = target_mask(logits, target).to(logits.dtype)
        seed = seed if explained.gradient_form else seed * logits
        wanted = [tensor for tensor in tensors if tensor.requires_grad]
        grads = iter(torch.autograd.grad(explained.logits, wanted, seed, allow_unused=True))
    found_by = {}
    for site, tensor in zip(sites, tensors):
        grad = next(grads) if tensor.requires_grad else None
        grad = torch.zeros_like(tensor) if grad is None else grad
        relevance = grad * tensor.detach() if explained.gradient_form else grad
        found_by[site.name] = relevance.sum(-1) if site.name.endswith(ERROR) else relevance
    return found_by


@contextmanager
def with_features(model: nn.Module, features: Mapping[str, Any] | None,
                  components: Any) -> Iterator[Any]:
    """``components`` with ``"features"`` replaced by the latents and the error term of each SAE of ``features``,
    spliced into ``model`` inside the block; as given without ``"features"``."""
    given = [components] if isinstance(components, (str, Component)) else list(components)
    if "features" not in given:
        if features is not None:
            raise ValueError("relprop: features= given, but components does not name \"features\"")
        yield components
        return
    if features is None:
        raise ValueError("relprop: components=\"features\" needs features={module path: SAE}")
    with spliced(model, features) as splices:
        kinds = [kind for splice in splices.values() for kind in (Latents(splice), error_term(splice))]
        yield [each for item in given for each in (kinds if item == "features" else [item])]
