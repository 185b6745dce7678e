"""The MoE routers' top-k choice among equal scores: the lowest-indexed experts, as torch.topk on CUDA
(see mlx_infer/models/routing.py), at the expert counts and k of the routers we serve."""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from test_architectures import TINY, TOL, block_table, forward, new_cache

from mlx_infer.interface.batch import SequenceSlice
from mlx_infer.loading import load
from mlx_infer.models.routing import top_k_experts

# (experts, k): tiny test models, Qwen3-MoE/Qwen3.5 (128, 8), DeepSeek V3 / GLM (256, 8),
# Qwen3-Next (512, 10), gpt-oss (32, 4), Gemma 4 (128, 8), and DeepSeek's group choice (8 groups, 4).
SHAPES = [(4, 1), (4, 2), (8, 3), (8, 4), (32, 4), (64, 6), (128, 8), (256, 8), (512, 10)]


def lowest_index_top_k(scores: np.ndarray, k: int) -> list[set[int]]:
    """The rule written out: a stable descending sort keeps equal scores in index order."""
    return [set(np.argsort(-row, kind="stable")[:k].tolist()) for row in scores]


def tied_scores(n: int, seed: int) -> np.ndarray:
    """Rows where the k-th place is tied: all equal; one winner then all equal; a few levels; softmax
    probabilities of a few levels; and a row with -inf entries (DeepSeek's masked groups)."""
    rng = np.random.default_rng(seed)
    rows = [np.zeros(n), np.r_[1.0, np.zeros(n - 1)], rng.integers(0, 3, n).astype(np.float64)]
    levels = rng.integers(0, 2, n).astype(np.float64)
    rows.append(np.exp(levels) / np.exp(levels).sum())
    masked = rng.integers(0, 2, n).astype(np.float64)
    masked[rng.permutation(n)[: n // 2]] = -np.inf
    rows.append(masked)
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("n,k", SHAPES)
def test_ties_go_to_the_lowest_index(n, k):
    scores = tied_scores(n, seed=n * 31 + k)
    got = np.array(top_k_experts(mx.array(scores), k))
    assert got.shape == (len(scores), k)
    assert [set(row.tolist()) for row in got] == lowest_index_top_k(scores, k)


def test_batched_leading_axes_route_each_row():
    # [3, 5, 8], as DeepSeek's [tokens, groups, experts]
    scores = np.stack([tied_scores(8, seed=s) for s in range(3)])
    got = np.array(top_k_experts(mx.array(scores), 3))
    want = [lowest_index_top_k(block, 3) for block in scores]
    assert [[set(row.tolist()) for row in block] for block in got] == want


# One checkpoint per router implementation (tests/oracle/make_tied_router_references.py wrote their
# tied_router.npz: transformers with every router weight zeroed, torch.topk keeping the lowest indices).
TIED = ("qwen3_moe", "glm4_moe", "deepseek_v2", "gpt_oss", "gemma4")
ROUTER = re.compile(
    r"\.(mlp\.gate\.(weight|e_score_correction_bias)|mlp\.router\.(weight|bias)|router\.proj\.weight)$"
)


@pytest.mark.parametrize("name", TIED)
def test_all_experts_tied_route_as_transformers_on_cuda(name):
    ref = np.load(TINY / name / "tied_router.npz")
    # The tie decides the output: CPU torch.topk's choice gives other logits.
    assert float(np.abs(ref["logits"] - ref["cpu_logits"]).max()) > 0.5
    model = load(str(TINY / name)).model
    zeroed = [(k, mx.zeros_like(v)) for k, v in tree_flatten(model.parameters()) if ROUTER.search(k)]
    assert zeroed
    model.update(tree_unflatten(zeroed))
    n = len(ref["tokens"])
    got = forward(model, new_cache(model), [SequenceSlice(block_table(0, n), 0, n, True)], ref["tokens"])
    assert float(np.abs(got - ref["logits"]).max()) <= TOL
