"""Other attribution methods, with :class:`relprop.LRP`'s interface and captum's ``Attribution`` protocol.

All are batched: SmoothGrad's noise samples, Integrated Gradients' path
steps and Occlusion's occluded copies run as batches through one pass per
chunk, not as Python loops of single passes. Gradients are seeded with 1 at
the target (captum's convention; ``target`` as for
:func:`relprop.methods.target_mask`). Inputs are a tensor or a
tuple of floating-point tensors, batch first; ``additional_forward_args`` is
a tuple of further positional arguments or a dict of keyword arguments, and
its tensors whose first dimension is the batch are repeated with the inputs.

Like captum's, every class works inside ``captum.attr.NoiseTunnel`` and with
``captum.metrics.infidelity`` / ``sensitivity_max``.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from relprop.methods._inputs import (
    Arguments,
    Inputs,
    Target,
    as_given,
    format_baselines,
    format_inputs,
    forward_arguments,
    repeat_arguments,
    repeat_target,
    slice_arguments,
)
from relprop.methods.protocol import Attribution, captum_entry
from relprop.methods.targets import convergence_delta, model_logits, target_mask

__all__ = ["InputGradient", "GradientXInput", "SmoothGrad", "IntegratedGradients", "Occlusion"]

_CHUNK = 256  # examples per forward pass where a method runs many copies and the caller does not say












class _GradientMethod(Attribution):
    """A model explained on its logits through gradients seeded with 1 at the target."""

    def _gradients(self, inputs: tuple[Tensor, ...], target: Target, arguments: Arguments) -> tuple[Tensor, ...]:
        """Gradient of the target output with respect to each input (one batch)."""
        with torch.enable_grad():
            leaves = tuple(x.detach().requires_grad_() for x in inputs)
            logits = model_logits(self.forward_func(*leaves, *arguments[0], **arguments[1]))
            seed = target_mask(logits.detach(), target).to(logits.dtype)
            grads = torch.autograd.grad(logits, leaves, seed, allow_unused=True)
        return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads))

    def _repeated_gradients(self, copies: tuple[Tensor, ...], target: Target, per_example: int,
                            arguments: Arguments, chunk_size: int) -> tuple[Tensor, ...]:
        """Gradients of ``copies`` (``per_example`` consecutive copies of each example), in chunks."""
        batch = copies[0].shape[0] // per_example
        targets = repeat_target(target, per_example)
        arguments = repeat_arguments(arguments, batch, per_example)
        parts = []
        for start in range(0, copies[0].shape[0], chunk_size):
            stop = start + chunk_size
            chunk_target = targets[start:stop] if isinstance(targets, list) else targets
            chunk_arguments = slice_arguments(arguments, batch * per_example, start, stop)
            parts.append(self._gradients(tuple(c[start:stop] for c in copies), chunk_target, chunk_arguments))
        return tuple(torch.cat(grads) for grads in zip(*parts))


class InputGradient(_GradientMethod):
    """The gradient of the target output with respect to the inputs (captum's ``Saliency`` with ``abs=False``).

    Parameters
    ----------
    forward_func : callable
        The model.
    """

    @captum_entry
    def attribute(self, inputs: Inputs, target: Target = None, additional_forward_args: Any = None
                  ) -> Tensor | tuple[Tensor, ...]:
        """The gradient, shaped like the inputs."""
        return as_given(inputs, self._gradients(format_inputs(inputs), target,
                                                 forward_arguments(additional_forward_args)))


class GradientXInput(_GradientMethod):
    """Gradient times input (captum's ``InputXGradient``)."""

    multiplies_by_inputs = True

    @captum_entry
    def attribute(self, inputs: Inputs, target: Target = None, additional_forward_args: Any = None
                  ) -> Tensor | tuple[Tensor, ...]:
        """Gradient times input, shaped like the inputs."""
        items = format_inputs(inputs)
        grads = self._gradients(items, target, forward_arguments(additional_forward_args))
        return as_given(inputs, tuple(g * x for g, x in zip(grads, items)))


class SmoothGrad(_GradientMethod):
    """The gradient averaged over noisy copies of the input (Smilkov et al. 2017).

    Parameters
    ----------
    forward_func : callable
    samples : int
    noise : float
        Standard deviation of the noise as a fraction of each example's value
        range (Smilkov et al.'s noise level; captum's ``NoiseTunnel`` takes an
        absolute ``stdevs`` instead).
    chunk_size : int
        Copies per forward and backward pass.
    """

    def __init__(self, forward_func: Callable[..., Any], samples: int = 32, noise: float = 0.15,
                 chunk_size: int = _CHUNK):
        super().__init__(forward_func)
        self.samples, self.noise, self.chunk_size = samples, noise, chunk_size

    @captum_entry
    def attribute(self, inputs: Inputs, target: Target = None, additional_forward_args: Any = None
                  ) -> Tensor | tuple[Tensor, ...]:
        """The mean gradient over ``samples`` noisy copies, shaped like the inputs."""
        items = format_inputs(inputs)
        copies = []
        for x in items:
            flat = x.flatten(1)
            span = (flat.amax(1) - flat.amin(1)).reshape(-1, *[1] * (x.dim() - 1))
            repeated = x.repeat_interleave(self.samples, 0)
            copies.append(repeated + torch.randn_like(repeated) * self.noise * span.repeat_interleave(self.samples, 0))
        grads = self._repeated_gradients(tuple(copies), target, self.samples,
                                         forward_arguments(additional_forward_args), self.chunk_size)
        return as_given(inputs, tuple(g.reshape(x.shape[0], self.samples, *x.shape[1:]).mean(1)
                                       for g, x in zip(grads, items)))


def _path_points(method: str, n_steps: int) -> tuple[Tensor, Tensor]:
    """Positions on the path from baseline (0) to input (1), and their weights, in float64."""
    if n_steps < 1 or method == "riemann_trapezoid" and n_steps < 2:
        raise ValueError(f"relprop: n_steps={n_steps} is too few for method {method!r}")
    steps = torch.arange(n_steps, dtype=torch.float64)
    even = torch.full((n_steps,), 1.0 / n_steps, dtype=torch.float64)
    if method == "riemann_left":
        return steps / n_steps, even
    if method == "riemann_right":
        return (steps + 1) / n_steps, even
    if method == "riemann_middle":
        return (steps + 0.5) / n_steps, even
    if method == "riemann_trapezoid":
        weights = torch.full((n_steps,), 1.0 / (n_steps - 1), dtype=torch.float64)
        weights[[0, -1]] /= 2
        return steps / (n_steps - 1), weights
    if method == "gausslegendre":
        # Golub-Welsch: the nodes are the eigenvalues of Legendre's Jacobi matrix, the weights come from
        # the first components of its eigenvectors; mapped from [-1, 1] to [0, 1]
        k = torch.arange(1, n_steps, dtype=torch.float64)
        off_diagonal = k / torch.sqrt(4 * k * k - 1)
        nodes, vectors = torch.linalg.eigh(torch.diag(off_diagonal, 1) + torch.diag(off_diagonal, -1))
        return (nodes + 1) / 2, vectors[0] ** 2
    raise ValueError(f"relprop: unknown integration method {method!r}; use one of riemann_left, riemann_right, "
                     "riemann_middle, riemann_trapezoid, gausslegendre")




class IntegratedGradients(_GradientMethod):
    """Path-integrated gradients from a baseline (Sundararajan et al. 2017), captum's arguments and defaults.

    Parameters
    ----------
    forward_func : callable
        The model.
    multiply_by_inputs : bool
        True: ``(input - baseline) * mean gradient`` (integrated gradients);
        False: the mean gradient along the path alone (captum's flag).
    """

    def __init__(self, forward_func: Callable[..., Any], multiply_by_inputs: bool = True):
        super().__init__(forward_func)
        self.multiplies_by_inputs = multiply_by_inputs
        self._defaults: dict[str, Any] = {"n_steps": 50, "method": "gausslegendre", "baselines": None,
                                          "internal_batch_size": None}

    @captum_entry
    def attribute(self, inputs: Inputs, baselines: Any = None, target: Target = None,
                  additional_forward_args: Any = None, n_steps: int | None = None, method: str | None = None,
                  internal_batch_size: int | None = None, return_convergence_delta: bool = False) -> Any:
        """Integrated gradients of the target output, shaped like the inputs.

        Parameters
        ----------
        inputs : Tensor or tuple of Tensors
        baselines : None (zeros), number, Tensor or tuple of them
            The path's start; a tensor broadcasts to its input's shape.
        target : as for :meth:`relprop.LRP.attribute`
        additional_forward_args : tuple or dict, optional
        n_steps : int
            Points on the path (default 50).
        method : str
            ``"gausslegendre"`` (default, as captum), ``"riemann_left"``,
            ``"riemann_right"``, ``"riemann_middle"`` or ``"riemann_trapezoid"``
            (the trapezoid rule, weights ``1/(n_steps-1)`` halved at the ends;
            captum 0.9 uses ``1/n_steps``, which integrates only
            ``(n_steps-1)/n_steps`` of the path).
        internal_batch_size : int, optional
            Path points per forward and backward pass (default 256).
        return_convergence_delta : bool
            Also return captum's completeness error per example:
            ``attributions total - (f(inputs) - f(baselines))`` at the target.
        """
        n_steps = self._defaults["n_steps"] if n_steps is None else n_steps
        method = self._defaults["method"] if method is None else method
        baselines = self._defaults["baselines"] if baselines is None else baselines
        internal_batch_size = internal_batch_size or self._defaults["internal_batch_size"] or _CHUNK
        items = format_inputs(inputs)
        starts = format_baselines(items, baselines)
        arguments = forward_arguments(additional_forward_args)
        alphas, weights = _path_points(method, n_steps)
        paths = []
        for x, start in zip(items, starts):
            shape = (1, n_steps, *[1] * (x.dim() - 1))
            path = start.unsqueeze(1) + alphas.to(x).reshape(shape) * (x - start).unsqueeze(1)
            paths.append(path.flatten(0, 1))
        grads = self._repeated_gradients(tuple(paths), target, n_steps, arguments, internal_batch_size)
        attributions = []
        for g, x, start in zip(grads, items, starts):
            shape = (1, n_steps, *[1] * (x.dim() - 1))
            mean_grad = (g.reshape(x.shape[0], n_steps, *x.shape[1:]) * weights.to(x).reshape(shape)).sum(1)
            attributions.append((x - start) * mean_grad if self.multiplies_by_inputs else mean_grad)
        result = as_given(inputs, tuple(attributions))
        if not return_convergence_delta:
            return result
        return result, self.compute_convergence_delta(result, starts, items, target, additional_forward_args)

    def compute_convergence_delta(self, attributions: Inputs, start_point: Any, end_point: Inputs,
                                  target: Target = None, additional_forward_args: Any = None) -> Tensor:
        """captum's completeness error: ``attributions total - (f(end_point) - f(start_point))`` per example.

        The sign is captum's for gradient methods, the opposite of
        :meth:`relprop.LRP.compute_convergence_delta` (explained minus attributed).
        """
        return _completeness_delta(self.forward_func, attributions, start_point, end_point, target,
                                   additional_forward_args)


def _completeness_delta(forward_func: Callable[..., Any], attributions: Inputs, start_point: Any, end_point: Inputs,
                        target: Target, additional_forward_args: Any) -> Tensor:
    """``attributions total - (f(end_point) - f(start_point))`` at the target, per example (captum's sign)."""
    ends = format_inputs(end_point)
    starts = format_baselines(ends, start_point)
    arguments = forward_arguments(additional_forward_args)
    with torch.no_grad():
        explained = (_target_totals(forward_func(*ends, *arguments[0], **arguments[1]), target)
                     - _target_totals(forward_func(*starts, *arguments[0], **arguments[1]), target))
    return -convergence_delta(explained, attributions)


class Occlusion(Attribution):
    """Output drop when a window of the input is set to a baseline (Zeiler & Fergus 2014), captum's arguments.

    The window slides over all dimensions after the batch; where the input
    is not a whole number of strides, the last window is cut at the edge.
    Each feature gets the mean drop of the target output over the windows
    that cover it (captum's ``Occlusion``). The occluded copies run as
    batches; tuple inputs are occluded one at a time.

    Parameters
    ----------
    forward_func : callable
        The model.
    """

    multiplies_by_inputs = True  # captum's flag for perturbation methods

    @captum_entry
    @torch.no_grad()
    def attribute(self, inputs: Inputs, sliding_window_shapes: tuple[int, ...] | tuple[tuple[int, ...], ...],
                  strides: int | tuple[int, ...] | tuple[int | tuple[int, ...], ...] | None = None,
                  baselines: Any = None, target: Target = None, additional_forward_args: Any = None,
                  perturbations_per_eval: int | None = None) -> Tensor | tuple[Tensor, ...]:
        """The mean output drop per feature, shaped like the inputs.

        Parameters
        ----------
        inputs : Tensor or tuple of Tensors
        sliding_window_shapes : tuple of ints, or one per input
            The window, over every dimension after the batch (``(C, 4, 4)``
            for a 4x4 patch through all channels of an image).
        strides : int or tuple, or one per input
            Steps of the window per dimension (default 1).
        baselines : None (zeros), number, Tensor or tuple of them
            What an occluded window is set to.
        target, additional_forward_args :
            As for :meth:`relprop.LRP.attribute`.
        perturbations_per_eval : int, optional
            Occluded copies of each example per forward pass (default: as
            many as keep a pass at 256 examples or fewer).
        """
        items = format_inputs(inputs)
        windows = _per_input(sliding_window_shapes, items, "sliding_window_shapes")
        steps = _per_input(1 if strides is None else strides, items, "strides")
        starts = format_baselines(items, baselines)
        arguments = forward_arguments(additional_forward_args)
        batch = items[0].shape[0]
        per_pass = perturbations_per_eval or max(1, _CHUNK // batch)
        reference = _target_totals(self.forward_func(*items, *arguments[0], **arguments[1]), target)
        results = []
        for index, (x, window, stride, start) in enumerate(zip(items, windows, steps, starts)):
            masks = _window_masks(x.shape[1:], _dims(window, x, "sliding_window_shapes"), _dims(stride, x, "strides"))
            drop = torch.zeros_like(x)
            for first in range(0, len(masks), per_pass):
                chunk = torch.stack(masks[first:first + per_pass]).to(x.device)  # (K, *x.shape[1:])
                count = chunk.shape[0]
                # example-major copies: the K occluded copies of each example are consecutive
                occluded = torch.where(chunk, start.unsqueeze(1), x.unsqueeze(1)).flatten(0, 1)
                copies = tuple(occluded if i == index else other.repeat_interleave(count, 0)
                               for i, other in enumerate(items))
                positional, keywords = repeat_arguments(arguments, batch, count)
                scores = _target_totals(self.forward_func(*copies, *positional, **keywords),
                                        repeat_target(target, count)).reshape(batch, count)
                drop += ((reference.unsqueeze(1) - scores).reshape(batch, count, *[1] * (x.dim() - 1))
                         * chunk.unsqueeze(0)).sum(1)
            covered = torch.stack(masks).sum(0).to(x)
            results.append(drop / covered)
        return as_given(inputs, tuple(results))


def _target_totals(output: Any, target: Target) -> Tensor:
    """The model output at ``target``, summed per example."""
    logits = model_logits(output)
    return (logits * target_mask(logits, target)).reshape(logits.shape[0], -1).sum(1)


def _per_input(value: Any, items: tuple[Tensor, ...], name: str) -> tuple[Any, ...]:
    """One window (or stride) per input: a single input takes ``value`` (or a tuple of one), several a tuple."""
    if isinstance(value, int):
        return (value,) * len(items)
    if len(items) == 1:
        return value if len(value) == 1 and isinstance(value[0], tuple) else (value,)
    if not isinstance(value, tuple) or len(value) != len(items):
        raise ValueError(f"relprop: {name} needs one entry per input ({len(items)} inputs), got {value!r}")
    return value


def _dims(value: int | tuple[int, ...], x: Tensor, name: str) -> tuple[int, ...]:
    """A window or stride over every dimension after the batch."""
    dims = (value,) * (x.dim() - 1) if isinstance(value, int) else tuple(value)
    if len(dims) != x.dim() - 1 or any(d < 1 for d in dims):
        raise ValueError(f"relprop: {name} {value!r} must give a positive size for each of the "
                         f"{x.dim() - 1} dimensions after the batch of an input of shape {tuple(x.shape)}")
    return dims


def _window_masks(shape: torch.Size, window: tuple[int, ...], stride: tuple[int, ...]) -> list[Tensor]:
    """Boolean masks of every window position; the last position per dimension is cut at the edge."""
    if any(w > size for w, size in zip(window, shape)):
        raise ValueError(f"relprop: the window {window} is larger than the input's {tuple(shape)}")
    if any(step > w and w < size for step, w, size in zip(stride, window, shape)):
        raise ValueError(f"relprop: strides {stride} larger than the window {window} leave features uncovered")
    starts = [range(0, size - w + step, step) for size, w, step in zip(shape, window, stride)]
    masks = []
    for corner in itertools.product(*starts):
        mask = torch.zeros(shape, dtype=torch.bool)
        mask[tuple(slice(c, c + w) for c, w in zip(corner, window))] = True
        masks.append(mask)
    return masks


# DeepLift runs on the engine with rules of its own (relprop.methods.deeplift_rules), which reads this module's helpers
