"""Other attribution methods, with the same interface as :class:`relprop.LRP`, for comparison.

All are gradient-based and batched: SmoothGrad's noise samples, Integrated
Gradients' path steps and Occlusion's occluded copies run as batches through
one forward and backward pass per chunk, not as Python loops of single passes.
The gradient is seeded with 1 at the target (captum's convention).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .attribution import _as_tuple, model_logits, target_mask

__all__ = ["Gradient", "GradientXInput", "SmoothGrad", "IntegratedGradients", "Occlusion"]


class _Method:
    """A model explained on its logits, target by captum's semantics, for one input tensor."""

    def __init__(self, model: nn.Module, chunk_size: int = 256):
        self.model = model
        self.chunk_size = chunk_size

    def _unit_seed(self, logits: Tensor, target: Any) -> Tensor:
        return target_mask(logits.detach(), target).to(logits.dtype)

    def gradient(self, x: Tensor, target: Any, extra: tuple = ()) -> Tensor:
        """Gradient of the target output with respect to ``x`` (a batch)."""
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            logits = model_logits(self.model(leaf, *extra))
            (grad,) = torch.autograd.grad(logits, leaf, self._unit_seed(logits, target))
        return grad

    def _repeated_gradient(self, copies: Tensor, target: Any, per_example: int, extra: tuple) -> Tensor:
        """Gradients of ``copies`` (``per_example`` consecutive copies of each example), in chunks."""
        targets = _interleave_target(target, per_example)
        grads = []
        for start in range(0, copies.shape[0], self.chunk_size):
            stop = start + self.chunk_size
            chunk_target = targets[start:stop] if isinstance(targets, list) else targets
            grads.append(self.gradient(copies[start:stop], chunk_target, extra))
        return torch.cat(grads)


def _interleave_target(target: Any, times: int) -> Any:
    """Per-example targets for ``times`` consecutive copies of each example; other targets as they are."""
    if isinstance(target, Tensor) and target.dim() == 1 or isinstance(target, list):
        return [t for t in (target.tolist() if isinstance(target, Tensor) else target) for _ in range(times)]
    return target


class Gradient(_Method):
    """The plain gradient (saliency without absolute value)."""

    def attribute(self, inputs: Tensor, target: Any = None, additional_forward_args: Any = None) -> Tensor:
        return self.gradient(inputs, target, _as_tuple(additional_forward_args))


class GradientXInput(_Method):
    """Gradient times input."""

    def attribute(self, inputs: Tensor, target: Any = None, additional_forward_args: Any = None) -> Tensor:
        return self.gradient(inputs, target, _as_tuple(additional_forward_args)) * inputs


class SmoothGrad(_Method):
    """The gradient averaged over noisy copies of the input (Smilkov et al. 2017).

    Parameters
    ----------
    samples : int
    noise : float
        Standard deviation of the noise as a fraction of each example's value range.
    """

    def __init__(self, model: nn.Module, samples: int = 32, noise: float = 0.15, chunk_size: int = 256):
        super().__init__(model, chunk_size)
        self.samples, self.noise = samples, noise

    def attribute(self, inputs: Tensor, target: Any = None, additional_forward_args: Any = None) -> Tensor:
        span = (inputs.flatten(1).amax(1) - inputs.flatten(1).amin(1)).reshape(-1, *[1] * (inputs.dim() - 1))
        copies = inputs.repeat_interleave(self.samples, 0)
        copies = copies + torch.randn_like(copies) * self.noise * span.repeat_interleave(self.samples, 0)
        grads = self._repeated_gradient(copies, target, self.samples, _as_tuple(additional_forward_args))
        return grads.reshape(inputs.shape[0], self.samples, *inputs.shape[1:]).mean(1)


class IntegratedGradients(_Method):
    """Path-integrated gradients from a baseline (Sundararajan et al. 2017), Riemann midpoint rule.

    Parameters
    ----------
    steps : int
    baseline : float or Tensor
    """

    def __init__(self, model: nn.Module, steps: int = 32, baseline: float | Tensor = 0.0, chunk_size: int = 256):
        super().__init__(model, chunk_size)
        self.steps, self.baseline = steps, baseline

    def attribute(self, inputs: Tensor, target: Any = None, additional_forward_args: Any = None) -> Tensor:
        baseline = torch.as_tensor(self.baseline, dtype=inputs.dtype, device=inputs.device).expand_as(inputs)
        alphas = (torch.arange(self.steps, dtype=inputs.dtype, device=inputs.device) + 0.5) / self.steps
        alphas = alphas.reshape(1, -1, *[1] * (inputs.dim() - 1))
        path = baseline.unsqueeze(1) + alphas * (inputs - baseline).unsqueeze(1)
        grads = self._repeated_gradient(path.flatten(0, 1), target, self.steps, _as_tuple(additional_forward_args))
        mean_grad = grads.reshape(inputs.shape[0], self.steps, *inputs.shape[1:]).mean(1)
        return (inputs - baseline) * mean_grad


class Occlusion(_Method):
    """Output drop when a square window (all channels) is set to ``baseline`` (Zeiler & Fergus 2014).

    Each pixel gets the mean drop over the windows that cover it.
    """

    def __init__(self, model: nn.Module, window: int = 4, stride: int = 2, baseline: float = 0.0,
                 chunk_size: int = 256):
        super().__init__(model, chunk_size)
        self.window, self.stride, self.baseline = window, stride, baseline

    @torch.no_grad()
    def attribute(self, inputs: Tensor, target: Any = None, additional_forward_args: Any = None) -> Tensor:
        extra = _as_tuple(additional_forward_args)
        height, width = inputs.shape[-2:]
        corners = [(top, left) for top in range(0, max(height - self.window, 0) + 1, self.stride)
                   for left in range(0, max(width - self.window, 0) + 1, self.stride)]
        logits = model_logits(self.model(inputs, *extra))
        seed = self._unit_seed(logits, target)
        reference = (logits * seed).flatten(1).sum(1)
        drop = torch.zeros(inputs.shape[0], height, width, dtype=inputs.dtype, device=inputs.device)
        count = torch.zeros(height, width, dtype=inputs.dtype, device=inputs.device)
        per_chunk = max(1, self.chunk_size // inputs.shape[0])
        for start in range(0, len(corners), per_chunk):
            chunk = corners[start:start + per_chunk]
            copies = inputs.unsqueeze(0).repeat(len(chunk), *[1] * inputs.dim())
            for i, (top, left) in enumerate(chunk):
                copies[i, ..., top:top + self.window, left:left + self.window] = self.baseline
            out = model_logits(self.model(copies.flatten(0, 1), *extra))
            scores = (out * seed.repeat(len(chunk), *[1] * (seed.dim() - 1))).flatten(1).sum(1)
            scores = scores.reshape(len(chunk), inputs.shape[0])
            for i, (top, left) in enumerate(chunk):
                drop[:, top:top + self.window, left:left + self.window] += (reference - scores[i]).reshape(-1, 1, 1)
                count[top:top + self.window, left:left + self.window] += 1
        return (drop / count.clamp(min=1)).unsqueeze(1).expand_as(inputs) / inputs.shape[1]
