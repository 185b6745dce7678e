"""Teacher-forced decoding as generation runs it: one token a step through the engine's runner.

Quality measured over one big prefill would test the prefill kernels (BLAS tiles), not the int8 matvecs
and paged attention that generation spends its steps in. Here a sequence is fed the text's tokens one
a step, through a :class:`ModelRunner`'s paged KV cache and the model as the runner prepared it (fused
projections, native block ops), and each step yields the log-probabilities of the next token.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_infer.engine.runner import ModelRunner, activation_dtype, kv_pool_dtype
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.kv.manager import KVCacheManager

BLOCK_SIZE = 16
SEQ = "teacher-forced"


class DecodePath:
    """One sequence of up to ``max_tokens`` tokens, decoded a token a step; its own KV pool, of
    ``--kv-cache-dtype`` ``kv_cache_dtype`` (``auto``: what the engine stores by default)."""

    def __init__(self, model: nn.Module, max_tokens: int, kv_cache_dtype: str = "auto"):
        self.kv = KVCacheManager(-(-max_tokens // BLOCK_SIZE), BLOCK_SIZE, enable_prefix_caching=False)
        self.runner = ModelRunner(model, self.kv, kv_pool_dtype(kv_cache_dtype, activation_dtype(model)))
        self.tokens: list[int] = []

    def step(self, token: int) -> mx.array:
        """Append ``token`` and return the next token's log-probs, float32 ``[vocab]`` (lazy)."""
        computed = len(self.tokens)
        self.tokens.append(token)
        if not self.kv.allocate(SEQ, self.tokens, computed, 1, register=False):
            raise ValueError(f"DecodePath sized for {computed} tokens: cannot append another")
        meta = build_metadata([SequenceSlice(self.kv.block_tables[SEQ], computed, 1)], BLOCK_SIZE)
        logits = self.runner.model(mx.array([token]), self.runner.cache, meta)[0].astype(mx.float32)
        return logits - mx.logsumexp(logits)

    def reset(self) -> None:
        """Forget the sequence (its blocks return to the pool) to decode another from position 0."""
        self.kv.free(SEQ)
        self.tokens = []
