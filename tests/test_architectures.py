"""Every architecture against Hugging Face transformers, on tiny random checkpoints.

``tests/oracle/make_tiny_models.py`` (run with transformers and torch, outside this venv) wrote each
folder under ``tests/oracle/tiny/``: the checkpoint as ``save_pretrained`` lays it out and
transformers' float32 logits at every position of two prompts. Here each folder loads through the
same loader users run, and the paged, chunked, batched forward the engine runs must give those logits.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_infer.interface import kv as kv_cache
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.interface.kv import LayerKV
from mlx_infer.loading import load

TINY = Path(__file__).parent / "oracle" / "tiny"
BLOCK = 4
NUM_BLOCKS = 128
NUM_SLOTS = 4  # recurrent-state slots (hybrid models): one per sequence of the batch test
# float32 on both sides; summation orders differ, so a few ulps of the logits' scale (about 1). Where
# transformers' own float32 error (against float64, recorded as float32_noise) is larger, as over long
# linear-attention recurrences, a few times that.
TOL = 2e-4


def new_cache(model, num_blocks: int = NUM_BLOCKS, block: int = BLOCK, dtype=mx.float32) -> list[LayerKV]:
    return kv_cache.new_cache(model, num_blocks, block, dtype, num_state_slots=NUM_SLOTS)


def forward(model, cache, slices: list[SequenceSlice], tokens) -> np.ndarray:
    out = model(mx.array(np.asarray(tokens), dtype=mx.int32), cache, build_metadata(slices, BLOCK))
    return np.array(out.astype(mx.float32))


def block_table(seed: int, num_tokens: int, first: int = 0, count: int = NUM_BLOCKS) -> list[int]:
    """Permuted, non-contiguous physical blocks out of ``first .. first + count``, as the block
    manager hands them out."""
    blocks = first + np.random.default_rng(seed).permutation(count)
    return blocks[: -(-num_tokens // BLOCK)].tolist()


@pytest.fixture(scope="module", params=sorted(p.name for p in TINY.iterdir() if p.is_dir()))
def arch(request):
    folder = TINY / request.param
    ref = np.load(folder / "reference.npz")
    prompts = [(ref[f"tokens_{i}"], ref[f"logits_{i}"]) for i in range(2)]
    tol = max(TOL, 5 * float(ref["float32_noise"])) if "float32_noise" in ref else TOL
    return request.param, load(str(folder)).model, prompts, tol


def test_chunked_prefill_then_decode_equals_transformers(arch):
    name, model, prompts, tol = arch
    for seed, (tokens, want) in enumerate(prompts):
        table = block_table(seed, len(tokens))
        cache, done, rows = new_cache(model), 0, []
        # Prefill chunks of uneven sizes crossing block edges, then the last tokens one decode step each.
        chunks = [13, 1, 30, 7] if len(tokens) > 60 else [5, 6]
        chunks += [len(tokens) - sum(chunks) - 8] + [1] * 8
        for n in chunks:
            rows.append(forward(model, cache, [SequenceSlice(table, done, n, True)], tokens[done : done + n]))
            done += n
        got = np.concatenate(rows)
        err = float(np.abs(got - want).max())
        assert err <= tol, f"{name}: max |logit - transformers'| = {err:.2e} over {len(tokens)} positions"


def test_batch_of_four_mixing_lengths_equals_each_alone(arch):
    _, model, prompts, _ = arch
    long_tokens, short_tokens = prompts[1][0], prompts[0][0]
    # (tokens, already computed): a fresh long prefill, a decode step, a continued chunk, a short prefill.
    cases = [(long_tokens[:70], 0), (long_tokens[:41], 40), (short_tokens, 9), (short_tokens[:6], 0)]
    # The four share one cache in the batch, so each draws its blocks from a range of its own.
    tables = [block_table(10 + i, len(t), first=32 * i, count=32) for i, (t, _) in enumerate(cases)]

    alone = []
    for (toks, c), table in zip(cases, tables):
        cache = new_cache(model)
        if c:
            forward(model, cache, [SequenceSlice(table, 0, c)], toks[:c])
        alone.append(forward(model, cache, [SequenceSlice(table, c, len(toks) - c)], toks[c:])[-1])

    cache = new_cache(model)
    for i, ((toks, c), table) in enumerate(zip(cases, tables)):
        if c:
            forward(model, cache, [SequenceSlice(table, 0, c, state_slot=i)], toks[:c])
    slices = [
        SequenceSlice(table, c, len(toks) - c, state_slot=i)
        for i, ((toks, c), table) in enumerate(zip(cases, tables))
    ]
    batched = forward(model, cache, slices, np.concatenate([toks[c:] for toks, c in cases]))
    np.testing.assert_allclose(batched, np.stack(alone), atol=1e-5, rtol=0)
