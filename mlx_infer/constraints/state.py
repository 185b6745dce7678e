"""Per-request matchers and the batch's token masks built from them.

The engine keeps one ``ConstraintState`` per constrained request, advances it on every token it emits,
and before a step samples asks ``batch_mask`` for one mask row per sampled sequence: free rows allow
every token, so constrained and free requests share the step.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from mlx_infer.constraints.compiler import CompiledConstraint
from mlx_infer.errors import ConstraintFailed


class ConstraintState:
    """Where one request stands in its constraint's grammar."""

    def __init__(self, compiled: CompiledConstraint):
        self.vocab = compiled.vocab
        self._matcher = compiled.new_matcher()

    def advance(self, token: int) -> bool:
        """Consume an emitted token; True when the grammar is complete (only end-of-sequence may follow).

        Raises ConstraintFailed if the grammar rejects the token or hit one of llguidance's limits."""
        if not self._matcher.consume_token(token):
            raise ConstraintFailed(f"the output constraint failed: {self.error or f'token {token} rejected'}")
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        """Why the matcher failed (its first line: llguidance appends its whole state), or ""."""
        if not self._matcher.is_error():
            return ""
        lines = self._matcher.get_error().strip().splitlines()
        return lines[0][:500] if lines else "unknown error"

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        fill_next_token_bitmask(self._matcher, bitmask, row)


def batch_mask(states: list[ConstraintState | None], width: int) -> tuple[mx.array | None, list[int]]:
    """A ``[len(states), width]`` boolean mask of the tokens each row may sample (rows without a state
    allow all), or None when no row is constrained; and the rows whose matcher failed while masking."""
    constrained = [i for i, s in enumerate(states) if s is not None]
    if not constrained:
        return None, []
    vocab = states[constrained[0]].vocab
    bits = allocate_token_bitmask(len(states), vocab.size)  # all ones: every token allowed
    failed = []
    for i in constrained:
        states[i].fill(bits, i)
        if states[i].error:
            failed.append(i)
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
    if width > allowed.shape[1]:
        # Logits wider than the tokenizer (padded embeddings): the extra ids are never text.
        allowed = np.pad(allowed, ((0, 0), (0, width - allowed.shape[1])))
    allowed = allowed[:, :width].astype(bool)
    free = np.ones(len(states), dtype=bool)
    free[constrained] = False
    allowed[free] = True
    return mx.array(allowed), failed
