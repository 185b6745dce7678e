"""Structured output: constraints compiled by llguidance into per-request matchers whose token masks the
batched sampler applies (see docs/ARCHITECTURE.md)."""

from mlx_infer.constraints.compiler import CompiledConstraint, compile_constraint
from mlx_infer.constraints.spec import KINDS, ConstraintKind, ConstraintSpec
from mlx_infer.constraints.state import ConstraintState, batch_mask

__all__ = [
    "KINDS",
    "CompiledConstraint",
    "ConstraintKind",
    "ConstraintSpec",
    "ConstraintState",
    "batch_mask",
    "compile_constraint",
]
