"""The bottom layer: what every other part of relprop agrees on.

Op kinds and tags (:mod:`.kinds`), the contract a rule may read on an op call
(:mod:`.contract`), the :class:`~relprop._core.rule.Rule` base with the two
rules the engine itself needs, the op registry that op families fill
(:mod:`.registry`), errors and warnings, tensor and signature utilities. It
imports no other relprop module.
"""
from __future__ import annotations





