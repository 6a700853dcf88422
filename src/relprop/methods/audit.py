"""A per-op account of one attribution: where relevance went, and what had no rule.

Routing ops (reshapes, concatenation, indexing, max pooling) move relevance
without changing its total, so the relevance lost between the output seed
and the inputs is exactly the sum of what the ops in this table absorbed
(biases, stabilisers, non-conservative rules).
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from relprop.composites import Composite
from relprop.methods._inputs import Inputs, Target
from relprop.methods.attribution import LRP
from relprop.methods.targets import output_relevance

__all__ = ["AuditRow", "Audit", "audit"]


@dataclass(frozen=True)
class AuditRow:
    """One op of the attribution, in the order relevance reached it (output first)."""

    module: str
    op: str
    rule: str
    relevance_in: float   # relevance arriving at the op's output
    relevance_out: float  # relevance handed to the op's inputs

    @property
    def absorbed(self) -> float:
        """Relevance the op kept (bias share, stabiliser, rule); negative if it created some."""
        return self.relevance_in - self.relevance_out


@dataclass
class Audit:
    """The rows of one attribution and its totals (summed over the batch)."""

    rows: list[AuditRow]
    seed_total: float
    input_total: float

    @property
    def absorbed_total(self) -> float:
        return sum(row.absorbed for row in self.rows)

    @property
    def unaccounted(self) -> float:
        """``seed - inputs - absorbed``: relevance created or lost where no op's row shows it.

        0 up to rounding when every op that changes the total is a row; anything
        else means relevance left the tracked graph unseen (a bug to report).
        """
        return self.seed_total - self.input_total - self.absorbed_total

    @property
    def unhandled(self) -> list[AuditRow]:
        """Ops that relevance reached without a rule (their plain gradient was used)."""
        return [row for row in self.rows if row.rule == "none"]

    def __str__(self) -> str:
        # every column as wide as its longest entry: module paths and rule names are shown in full
        module = max([len("module"), *(len(row.module) for row in self.rows)])
        op = max([len("op"), *(len(row.op) for row in self.rows)])
        rule = max([len("rule"), *(len(row.rule) for row in self.rows)])
        header = f"{'module':{module}s} {'op':{op}s} {'rule':{rule}s} {'R in':>12s} {'R out':>12s} {'absorbed':>9s}"
        lines = [header, "-" * len(header)]
        for row in self.rows:
            share = row.absorbed / row.relevance_in if row.relevance_in else 0.0
            lines.append(f"{row.module:{module}s} {row.op:{op}s} {row.rule:{rule}s} "
                         f"{row.relevance_in:12.5g} {row.relevance_out:12.5g} {share:9.2%}")
        lines.append("-" * len(header))
        lines.append(f"seed {self.seed_total:.6g}  inputs {self.input_total:.6g}  absorbed by ops "
                     f"{self.absorbed_total:.6g}  unaccounted {self.unaccounted:.3g}  ops without a rule: "
                     f"{len(self.unhandled)}")
        return "\n".join(lines)


def audit(model: nn.Module, inputs: Inputs, target: Target = None, composite: Composite | str | None = None,
          additional_forward_args: Any = None) -> Audit:
    """Explain once and account for every op: module path, op, rule, relevance in and out.

    Ops without a rule are listed with rule ``"none"`` (their plain gradient
    was used) instead of warned about.
    """
    rows: list[AuditRow] = []

    def record(call: Any, relevance: Tensor, result: Sequence[Tensor | None]) -> None:
        handed = sum(r.sum().item() for r in result if r is not None)
        rows.append(AuditRow(call.module_name or "<root>", call.name, repr(call.rule), relevance.sum().item(), handed))

    lrp = LRP(model, composite)
    with torch.inference_mode(False):
        explained = lrp.record(inputs, additional_forward_args, audit=record, reusable=False)
        seed = output_relevance(explained.logits, target)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # unhandled ops are rows of the table here
            relevance = explained.relevance(seed)
    return Audit(rows, seed.sum().item(), sum(r.sum().item() for r in relevance))
