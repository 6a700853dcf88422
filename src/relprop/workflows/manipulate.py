"""Attacks on heatmaps: the targeted manipulation of Dombrowski et al. 2019, and its defence by beta-smoothing.

"Explanations can be manipulated and geometry is to blame" (NeurIPS 2019) changes an input by a small amount so
that its heatmap ``h`` approaches an arbitrary target map ``h_t`` while the network's output ``g`` barely moves:
it minimises ``||h(x_adv) - h_t||^2 + gamma ||g(x_adv) - g(x)||^2`` by gradient descent on ``x_adv``, kept in the
valid range of the inputs. That needs the derivative of the heatmap with respect to the input, and a ReLU
network's gradient-based heatmap is piecewise constant in its gating: its second derivative is zero almost
everywhere. The attack therefore differentiates through a copy of the network whose ReLUs are replaced by
``softplus(beta)`` (:func:`beta_smoothed`), and checks each step on the network itself. The same copy is the
paper's defence: explaining with the smoothed network flattens the geometry the attack exploits.

:func:`manipulate` runs the attack with any LRP composite (the relevance of ``LRP.attribute(...,
create_graph=True)``) or with Gradient x Input (:data:`GRADIENT_X_INPUT`).
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relprop.composites import Composite
from relprop.methods import LRP
from relprop.methods.targets import model_logits

__all__ = ["GRADIENT_X_INPUT", "Manipulation", "beta_smoothed", "explain", "heatmap", "manipulate"]

#: the ``composite`` that explains by Gradient x Input (the input times the gradient of the target output)
GRADIENT_X_INPUT = "gradient-x-input"

#: an explainer: ``(model, x, target, create_graph) -> relevance`` of the shape of ``x``
Explainer = Callable[[nn.Module, Tensor, Tensor, bool], Tensor]


def beta_smoothed(model: nn.Module, beta: float) -> nn.Module:
    """A copy of ``model`` whose ``nn.ReLU`` modules are ``nn.Softplus(beta)``; ``model`` itself is not touched.

    ``softplus_beta(x) = log(1 + exp(beta x)) / beta`` tends to ReLU as ``beta`` grows; its heatmaps have the
    curvature that a ReLU network's lack (Dombrowski et al. 2019, where it is both the attack's surrogate and the
    defence, "beta-smoothing"). Only ReLU modules are swapped: a forward that calls ``torch.relu`` or
    ``F.relu`` itself keeps them.

    Parameters
    ----------
    model : nn.Module
    beta : float
        Positive; large values approach ReLU.

    Returns
    -------
    nn.Module
        The copy, in the training mode of ``model``.

    Raises
    ------
    ValueError
        When ``beta`` is not positive, or ``model`` has no ``nn.ReLU`` module.
    """
    if not beta > 0:
        raise ValueError(f"relprop: beta-smoothing needs a positive beta, got {beta!r}")
    if not any(isinstance(module, nn.ReLU) for module in model.modules()):
        raise ValueError(f"relprop: {type(model).__name__} has no nn.ReLU module to replace by softplus "
                         "(beta-smoothing swaps modules; a functional relu in forward stays)")
    smoothed = copy.deepcopy(model)
    for parent in list(smoothed.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.ReLU):
                setattr(parent, name, nn.Softplus(beta=beta).train(child.training))  # a new module trains
    return smoothed


def _gradient_x_input(model: nn.Module, x: Tensor, target: Tensor, create_graph: bool) -> Tensor:
    """Gradient x Input of the target outputs; differentiable in ``x`` with ``create_graph``."""
    leaf = x if x.requires_grad else x.detach().requires_grad_()
    with torch.enable_grad():
        selected = model_logits(model(leaf)).gather(1, target[:, None]).sum()
        (gradient,) = torch.autograd.grad(selected, leaf, create_graph=create_graph)
    return gradient * leaf if create_graph else (gradient * leaf).detach()


def _lrp(composite: Composite | str) -> Explainer:
    """The explainer of an LRP composite: ``LRP(model, composite).attribute``, recorded with ``create_graph``."""
    made: dict[int, LRP] = {}  # one LRP per model (the model and its smoothed copy), kept for its plans

    def relevance(model: nn.Module, x: Tensor, target: Tensor, create_graph: bool) -> Tensor:
        if id(model) not in made:
            made[id(model)] = LRP(model, composite)
        lrp = made[id(model)]
        if not create_graph:
            return lrp.attribute(x.detach(), target=target).detach()
        return lrp.attribute(x, target=target, create_graph=True)
    return relevance


def _explainer(composite: Composite | str) -> Explainer:
    if isinstance(composite, str) and composite.lower().replace("_", "-") == GRADIENT_X_INPUT:
        return _gradient_x_input
    if not isinstance(composite, (Composite, str)):
        raise TypeError("relprop: composite must be a Composite, a preset name or 'gradient-x-input', got "
                        f"{type(composite).__name__}")
    return _lrp(composite)


def explain(model: nn.Module, composite: Composite | str, x: Tensor, target: int | Tensor | None = None,
            create_graph: bool = False) -> Tensor:
    """The relevance :func:`manipulate` works with: LRP under ``composite``, or Gradient x Input.

    Parameters
    ----------
    model : nn.Module
    composite : Composite or str
        An LRP composite or preset name, or ``"gradient-x-input"`` (:data:`GRADIENT_X_INPUT`).
    x : Tensor
        Inputs, batch first.
    target : int, Tensor or None
        The explained output per example; None: the predicted class.
    create_graph : bool
        Return relevance that autograd differentiates with respect to ``x`` (which must then require grad).

    Returns
    -------
    Tensor
        Relevance of the shape of ``x``.
    """
    return _explainer(composite)(model, x, _targets(model, x.detach(), target), create_graph)


def heatmap(relevance: Tensor) -> Tensor:
    """The map an attack compares: relevance summed over channels (dim 1), scaled to mean absolute value 1.

    Scaling makes maps of different images and methods comparable (the target may be another image's relevance,
    of any scale). A map that is zero everywhere stays zero.
    """
    summed = relevance.sum(1)
    scale = summed.abs().flatten(1).mean(1).clamp_min(torch.finfo(summed.dtype).tiny)
    return summed / scale.reshape(-1, *[1] * (summed.dim() - 1))


@dataclass
class Manipulation:
    """What :func:`manipulate` found, per example (batch first).

    Attributes
    ----------
    x, x_adv : Tensor
        The input and the manipulated input.
    target : Tensor
        The explained output index per example.
    target_map : Tensor
        The target heatmap, scaled as :func:`heatmap` scales (channels summed).
    heatmap, heatmap_adv : Tensor
        The heatmaps of ``x`` and ``x_adv`` under the explained model (:func:`heatmap`).
    logits, logits_adv : Tensor
        The model's outputs at ``x`` and ``x_adv``.
    history : dict of str to Tensor
        ``"heatmap_mse"`` and ``"output_change"`` (:attr:`output_change`) of each iterate, shape
        ``(steps + 1, N)``, row 0 for ``x``: what the choice of ``x_adv`` saw.
    """

    x: Tensor
    x_adv: Tensor
    target: Tensor
    target_map: Tensor
    heatmap: Tensor
    heatmap_adv: Tensor
    logits: Tensor
    logits_adv: Tensor
    history: dict[str, Tensor]

    def heatmap_mse(self, adversarial: bool = True) -> Tensor:
        """Mean squared difference of the heatmap of ``x_adv`` (or of ``x``) and the target map, per example."""
        found = self.heatmap_adv if adversarial else self.heatmap
        return (found - self.target_map).pow(2).flatten(1).mean(1)

    def heatmap_cosine(self, adversarial: bool = True) -> Tensor:
        """Cosine similarity of the heatmap of ``x_adv`` (or of ``x``) and the target map, per example."""
        found = self.heatmap_adv if adversarial else self.heatmap
        return F.cosine_similarity(found.flatten(1), self.target_map.flatten(1), dim=1)

    @property
    def input_change(self) -> dict[str, Tensor]:
        """``x_adv - x`` per example: its ``"l2"`` and ``"linf"`` norms and its ``"mse"``."""
        delta = (self.x_adv - self.x).flatten(1)
        return {"l2": delta.norm(dim=1), "linf": delta.abs().amax(1), "mse": delta.pow(2).mean(1)}

    @property
    def output_change(self) -> Tensor:
        """The largest change of a softmax probability from ``x`` to ``x_adv``, per example."""
        return _output_change(self.logits, self.logits_adv)

    @property
    def logit_change(self) -> Tensor:
        """The L2 norm of the change of the logits, relative to the L2 norm of the logits at ``x``, per example."""
        return (self.logits_adv - self.logits).norm(dim=1) / self.logits.norm(dim=1)


def _output_change(logits: Tensor, logits_adv: Tensor) -> Tensor:
    return (logits_adv.softmax(1) - logits.softmax(1)).abs().amax(1)


def _target_map(target_map: Tensor, x: Tensor) -> Tensor:
    """The target map per example, ``x``'s shape without channels, scaled by :func:`heatmap`."""
    spatial = x.shape[2:]
    if tuple(target_map.shape) == tuple(spatial):
        target_map = target_map.expand(x.shape[0], *spatial)
    elif tuple(target_map.shape) == (x.shape[0], *spatial):
        pass
    elif tuple(target_map.shape) == tuple(x.shape):
        target_map = target_map.sum(1)
    else:
        raise ValueError(f"relprop: target_map of shape {tuple(target_map.shape)} does not fit inputs of shape "
                         f"{tuple(x.shape)}: give {tuple(spatial)}, {(x.shape[0], *spatial)} or the inputs' shape")
    if not (target_map.flatten(1).abs().amax(1) > 0).all():
        raise ValueError("relprop: target_map is zero everywhere for some example: there is nothing to approach")
    return heatmap(target_map.to(x.dtype)[:, None])


def _targets(model: nn.Module, x: Tensor, target: int | Tensor | None) -> Tensor:
    if target is None:
        with torch.no_grad():
            return model_logits(model(x)).argmax(1)
    return torch.as_tensor(target, device=x.device).long().expand(x.shape[0]).clone()


def manipulate(model: nn.Module, composite: Composite | str, x: Tensor, target_map: Tensor,
               target: int | Tensor | None = None, *, gamma: float = 10.0, steps: int = 300, lr: float = 1e-2,
               beta: float | None = None, output_bound: float = 0.05, max_change: float | None = None,
               bounds: tuple[float, float] | None = (0.0, 1.0)) -> Manipulation:
    """Change ``x`` a little so that its heatmap approaches ``target_map`` while the output stays (Dombrowski 2019).

    Adam minimises ``mean((h(x_adv) - h_t)^2) + gamma * mean((g(x_adv) - g(x))^2)`` over ``x_adv`` (``h``:
    :func:`heatmap` of the relevance of ``target``; ``g``: the logits), clamping ``x_adv`` to ``bounds`` (and to
    ``max_change`` of ``x``) after each step. Every iterate is measured on ``model`` itself; ``x_adv`` is, per
    example, the iterate with the heatmap closest to the target among those whose
    :attr:`Manipulation.output_change` is at most ``output_bound`` (``x`` itself if none is).

    Parameters
    ----------
    model : nn.Module
        The explained model, in eval mode; it is not modified.
    composite : Composite or str
        An LRP composite or preset name (relevance from ``LRP(model, composite).attribute(...,
        create_graph=True)``), or ``"gradient-x-input"`` (:data:`GRADIENT_X_INPUT`).
    x : Tensor
        Inputs ``(N, C, *S)``.
    target_map : Tensor
        The heatmap to approach: ``S`` (one for all), ``(N, *S)`` or ``(N, C, *S)`` (channels summed); any scale
        (it is scaled by :func:`heatmap`), e.g. another input's relevance.
    target : int, Tensor or None
        The explained output per example; None: the predicted class of ``x``.
    gamma : float
        Weight of the output term.
    steps, lr : int, float
        Adam's steps and learning rate.
    beta : float or None
        Differentiate through :func:`beta_smoothed` ``(model, beta)`` (the attack of the paper on ReLU networks,
        whose heatmaps have no curvature); None: through ``model`` itself.
    output_bound : float
        The largest change of a softmax probability that ``x_adv`` may have.
    max_change : float or None
        The largest change of an input value (an L-infinity ball around ``x``); None: only ``bounds`` limit it
        (the paper's attack).
    bounds : (float, float) or None
        The valid range of the inputs; None: unbounded.

    Returns
    -------
    Manipulation

    Raises
    ------
    ValueError
        On a ``target_map`` that does not fit ``x`` or is zero, on ``steps < 0``, on a bad ``beta``.
    """
    if steps < 0:
        raise ValueError(f"relprop: steps must be at least 0, got {steps}")
    if max_change is not None and not max_change > 0:
        raise ValueError(f"relprop: max_change must be positive or None, got {max_change!r}")
    if x.dim() < 2:
        raise ValueError(f"relprop: manipulate needs inputs (N, C, ...) with a channel dimension, got {tuple(x.shape)}")
    relevance = _explainer(composite)
    wanted = _target_map(target_map, x)
    surrogate = beta_smoothed(model, beta) if beta is not None else model
    x = x.detach()
    target = _targets(model, x, target)
    with torch.no_grad():
        logits = model_logits(model(x))
    x_adv = x.clone().requires_grad_()
    optimizer = torch.optim.Adam([x_adv], lr=lr)
    iterates = _Iterates(x, output_bound)
    for step in range(steps + 1):
        measured = surrogate is model and step < steps  # the step's map on model: measured and differentiated
        found = heatmap(relevance(model, x_adv, target, measured))
        outputs = model_logits(model(x_adv))
        iterates.see(x_adv, (found.detach() - wanted).pow(2).flatten(1).mean(1),
                     _output_change(logits, outputs.detach()))
        if step == steps:
            break
        if not measured:
            found = heatmap(relevance(surrogate, x_adv, target, True))
        loss = ((found - wanted).pow(2).flatten(1).mean(1) + gamma * (outputs - logits).pow(2).mean(1)).sum()
        optimizer.zero_grad()
        (x_adv.grad,) = torch.autograd.grad(loss, x_adv)
        optimizer.step()
        with torch.no_grad():
            if max_change is not None:
                x_adv.copy_(torch.minimum(torch.maximum(x_adv, x - max_change), x + max_change))
            if bounds is not None:
                x_adv.clamp_(*bounds)
    return _result(model, relevance, x, iterates, target, wanted, logits)


class _Iterates:
    """The iterates of an attack: each one's heatmap MSE and output change, and per example the best one within
    the output bound (``x`` itself, the first iterate, is within any bound)."""

    def __init__(self, x: Tensor, output_bound: float) -> None:
        self.best = x.clone()
        self.best_mse = torch.full((x.shape[0],), float("inf"), dtype=x.dtype, device=x.device)
        self.output_bound = output_bound
        self.mse: list[Tensor] = []
        self.change: list[Tensor] = []

    def see(self, x_adv: Tensor, mse: Tensor, change: Tensor) -> None:
        self.mse.append(mse)
        self.change.append(change)
        better = (change <= self.output_bound) & (mse < self.best_mse)
        self.best[better], self.best_mse[better] = x_adv.detach()[better], mse[better]

    def history(self) -> dict[str, Tensor]:
        return {"heatmap_mse": torch.stack(self.mse), "output_change": torch.stack(self.change)}


def _result(model: nn.Module, relevance: Explainer, x: Tensor, iterates: _Iterates, target: Tensor,
            wanted: Tensor, logits: Tensor) -> Manipulation:
    x_adv = iterates.best
    with torch.no_grad():
        logits_adv = model_logits(model(x_adv))
    return Manipulation(x=x, x_adv=x_adv, target=target, target_map=wanted,
                        heatmap=heatmap(relevance(model, x, target, False)),
                        heatmap_adv=heatmap(relevance(model, x_adv, target, False)),
                        logits=logits, logits_adv=logits_adv, history=iterates.history())

