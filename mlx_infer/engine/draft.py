"""The draft-model proposer: a small model with the target's tokenizer proposes k greedy tokens for every
speculating sequence, one batched forward per draft token, over a KV pool of its own.

Its proposals are a deterministic function of the text (greedy), so the engine's accept-while-equal
rule is exact rejection sampling for it as for the n-gram proposer (see speculative.py).

The draft keeps, per sequence, the tokens whose K/V its pool holds (``fed``). A step feeds what the
sequence gained since (the accepted tokens and the target's own), re-feeding from the first token where
``fed`` and the sequence differ: proposals the target rejected are simply overwritten. A sequence's
draft blocks go back once its request leaves the engine (``release``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_infer import cpu_kernels
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.kv.manager import KVCacheManager
from mlx_infer.kv.pages import allocate_pools, drop_blocks


@dataclass
class _DraftSequence:
    fed: list[int] = field(default_factory=list)  # tokens whose K/V is in the draft pool, in order


class DraftProposer:
    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, kv_dtype: mx.Dtype):
        self.model = model
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.cache = allocate_pools(model, num_blocks, block_size, kv_dtype)
        self.sequences: dict[str, _DraftSequence] = {}

    def propose(self, requests: Sequence[tuple[str, Sequence[int], int]]) -> list[list[int]]:
        """Up to k greedy draft tokens for each (request id, tokens, k); one host read for all of them.
        A sequence the draft pool has no room for proposes nothing."""
        live = []  # (index, id, tokens, k, fed before this step)
        for index, (seq_id, tokens, k) in enumerate(requests):
            state = self.sequences.setdefault(seq_id, _DraftSequence())
            # Keep the longest agreeing prefix, but feed at least the last token: its logits are needed.
            keep = min(_common_prefix(state.fed, tokens), len(tokens) - 1)
            self.kv.trim(seq_id, keep)
            del state.fed[keep:]
            if self.kv.allocate(seq_id, tokens, keep, len(tokens) - keep + k - 1, register=False):
                live.append((index, seq_id, tokens, k))
        proposals: list[list[int]] = [[] for _ in requests]
        if not live:
            return proposals

        # First forward: each sequence's unfed tokens; later ones: the previous draft token of those
        # that still want more. Lazy throughout: the draft tokens never leave the device until the end.
        slices, inputs = [], []
        for _, seq_id, tokens, _ in live:
            fed = self.sequences[seq_id].fed
            slices.append(SequenceSlice(self.kv.block_tables[seq_id], len(fed), len(tokens) - len(fed)))
            inputs.extend(tokens[len(fed) :])
        drafted = [self._argmax(mx.array(np.asarray(inputs, dtype=np.int32)), slices)]
        rows = list(range(len(live)))  # rows of the last forward still drafting, into ``live``
        for j in range(1, max(k for *_, k in live)):
            keep_rows = [r for r in rows if live[r][3] > j]
            if not keep_rows:
                break
            previous = drafted[-1]
            if len(keep_rows) < len(rows):
                previous = previous[mx.array([rows.index(r) for r in keep_rows])]
            slices = [
                SequenceSlice(self.kv.block_tables[live[r][1]], len(live[r][2]) + j - 1, 1) for r in keep_rows
            ]
            drafted.append(self._argmax(previous, slices))
            rows = keep_rows
        mx.eval(drafted)
        values = [d.tolist() for d in drafted]

        rows = list(range(len(live)))
        for j, column in enumerate(values):
            rows = [r for r in rows if live[r][3] > j]
            for r, token in zip(rows, column):
                proposals[live[r][0]].append(token)
        for index, seq_id, tokens, k in live:
            # The pool now holds every token and all but the last draft token; only the sequence's own
            # are sure to stay, the agreeing drafts are found again by the prefix match next time.
            self.sequences[seq_id].fed = list(tokens) + proposals[index][: k - 1]
        return proposals

    def release(self, request_id: str) -> None:
        """Give back the draft blocks of a request that left the engine."""
        if self.sequences.pop(request_id, None) is not None:
            self.kv.free(request_id)

    def release_idle_memory(self) -> int:
        """Drop the pages of every free draft block (all of them once no request is left)."""
        return drop_blocks(self.cache, self.kv.pool.forget_free_blocks())

    def _argmax(self, inputs: mx.array, slices: list[SequenceSlice]) -> mx.array:
        meta = build_metadata(slices, self.kv.block_size)
        return cpu_kernels.argmax(self.model(inputs, self.cache, meta)).astype(mx.int32)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
