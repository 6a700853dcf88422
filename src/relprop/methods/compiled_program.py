"""What the compiled tier traces: the model on copies of its inputs, with a probe per input, and for a whole
attribution the seed, the backward pass and the products with the inputs after it (:func:`attribution`)."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, fx, nn

from relprop.engine.decide import CannotCompile
from relprop.methods.forward_pass import per_input
from relprop.methods.targets import model_logits, selection_mask

__all__ = ["Explained", "attribution", "mark_dynamic", "model_nodes", "probes_of", "program"]

#: how Dynamo's graphs name the explained model (the prefix of its modules' paths in ``nn_module_stack``)
MODEL = "L['explained'].model"


class Explained(nn.Module):
    """The traced program: the model on copies of its inputs, and the probes (read by the rewritten graph)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        #: changes where the decisions' key changed: read in the traced forward, so Dynamo guards it
        self.stamp = "0"

    def forward(self, inputs: tuple[Tensor, ...], probes: tuple[Tensor, ...], extra: tuple,
                keywords: dict[str, Any], selection: tuple[Tensor, ...] | None = None, totals: bool = False,
                create_graph: bool = False, differentiated: tuple[int, ...] = ()) -> Any:
        """The model's output and the probes; with ``selection``, the whole attribution (:func:`attribution`)."""
        if self.stamp == "":  # never: the comparison makes Dynamo guard the stamp's value
            return None
        output = self.model(*(x.clone() if x.requires_grad else x for x in inputs), *extra, **keywords)
        if selection is not None:
            return attribution(model_logits(output), inputs, probes, selection, totals, create_graph, differentiated)
        # used, so that they are inputs of the graph, for the embeddings to read (a tensor returned as it is is not)
        return output, tuple(probe * 1 for probe in probes)


def attribution(logits: Tensor, inputs: tuple[Tensor, ...], probes: tuple[Tensor, ...],
                 selection: tuple[Tensor, ...], totals: bool, create_graph: bool = False,
                 differentiated: tuple[int, ...] = ()) -> tuple:
    """The relevance of each input for the logits that ``selection`` selects (:func:`selection_mask`), as
    :meth:`~relprop.methods.ForwardPass.propagate` gives it in gradient form: the logits, the relevance, whether
    a selected logit is 0 (its relevance per unit is lost), whether the relevance is finite, and with ``totals``
    the seed's total per example (else None). With ``create_graph`` the relevance and the totals are functions
    of the parameters and of the inputs numbered in ``differentiated`` (the backward pass recorded, those inputs
    not detached; reading them here makes Dynamo guard which they are)."""
    mask = selection_mask(logits, selection)
    leaves = [x for x in inputs if x.requires_grad] + list(probes)
    # each leaf reaches what is differentiated, by 0 outside the model: as Dynamo traces the plain forward pass,
    # a model of token ids reaches its probes only through the forms that the backend writes in afterwards
    reached = logits + sum(leaf.sum().to(logits.dtype) for leaf in leaves) * 0
    grads = torch.autograd.grad(reached, leaves, (mask & (logits != 0)).to(logits.dtype), create_graph=create_graph)
    explained = iter(grads[:len(leaves) - len(probes)])
    own = {index: next(explained) * (x if create_graph and index in differentiated else x.detach())
           for index, x in enumerate(inputs) if x.requires_grad}
    collected = {index: [grad] for index, grad in enumerate(grads[len(leaves) - len(probes):])}
    relevance = [r if create_graph else r.detach() for r in per_input(inputs, own, collected, logits.dtype)]
    finite = (torch.stack([r.detach().isfinite().all() for r in relevance]).all() if relevance
              else torch.tensor(True))
    total = torch.where(mask, logits, 0).reshape(len(logits), -1).sum(1) if totals else None
    return (logits.detach(), tuple(relevance), (mask & (logits == 0)).any(), finite,
            total if total is None or create_graph else total.detach())


def program(explained: Explained, inputs: tuple[Tensor, ...], probes: tuple[Tensor, ...], extra: tuple,
             keywords: dict[str, Any], *whole: Any) -> Any:
    """What each :class:`Compiled` compiles, through a copy of this code of its own (Dynamo's cache is per code)."""
    return explained(inputs, probes, extra, keywords, *whole)


def model_nodes(gm: fx.GraphModule) -> set[fx.Node] | None:
    """In the graph of a whole attribution (:func:`attribution`), the nodes of the model's forward pass: each
    node up to the logits (what the backward pass differentiates is ``logits + ...``), and any later one issued
    inside the model (an op after its logits, which may write into them). None in the graph of a forward pass."""
    # the last: a model may differentiate something of its own in its forward pass
    grad = next(reversed(gm.graph.find_nodes(op="call_function", target=torch.autograd.grad)), None)
    if grad is None:
        return None
    differentiated = grad.args[0]
    if not (isinstance(differentiated, fx.Node) and isinstance(differentiated.args[0], fx.Node)):
        raise CannotCompile("relprop: the graph of the attribution does not name the model's logits")
    logits, found, before = differentiated.args[0], set(), True
    for n in gm.graph.nodes:
        stack = (n.meta.get("nn_module_stack") or {}).values()
        if before or any(path.startswith(MODEL) for path, _ in stack):
            found.add(n)
        before = before and n is not logits
    return found


def probes_of(leaves: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """A probe per input (ones that require grad): of an input's shape, ``ids.shape + (1,)`` in float64 for token
    ids."""
    return tuple(torch.ones(x.shape, dtype=x.dtype, device=x.device, requires_grad=True) if x.is_floating_point()
                 else torch.ones(*x.shape, 1, dtype=torch.float64, device=x.device, requires_grad=True)
                 for x in leaves)


def mark_dynamic(values: tuple[Any, ...], dim: int) -> None:
    """Dimension ``dim`` of each tensor among ``values`` that has it, dynamic (where it can be)."""
    from torch._dynamo import maybe_mark_dynamic  # imports Dynamo: only where something compiles

    for x in values:
        if isinstance(x, Tensor) and x.dim() > dim:
            maybe_mark_dynamic(x, dim)
