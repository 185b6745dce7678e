"""The top-k choice every MoE router makes, with one rule for equal scores.

Where scores tie at the k-th place the lowest-indexed experts win, as ``torch.topk`` chooses on CUDA
(its ``gatherTopK`` fills the places left after the strictly larger scores with equal ones in index
order) and as vLLM's routing kernels do. ``torch.topk`` on CPU has no such rule: it runs libstdc++'s
``nth_element`` / ``partial_sort`` on the values alone, so which tied experts it keeps depends on the
algorithm's pivots (four equal scores, k = 2: experts 2 and 3).

MLX's ``argpartition`` already breaks ties by index on both backends (the CPU comparator orders equal
values by index; Metal's is a stable merge sort), so the rule costs nothing extra. tests/test_routing.py
pins it, on its own and through a tiny model per router whose experts all tie, against transformers
with CUDA's rule (CPU ``torch.topk``'s choice gives other logits there).
"""

from __future__ import annotations

import mlx.core as mx


def top_k_experts(scores: mx.array, k: int) -> mx.array:
    """Indices [..., k] of the ``k`` largest ``scores`` along the last axis (in no particular order);
    among equal scores at the k-th place, the lowest indices."""
    return mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
