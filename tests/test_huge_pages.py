"""mlx_infer.loading.huge_pages: quantized weights copied onto transparent huge pages at load (Linux).

Oracles: the same checkpoint loaded without the move (its parameters and logits, bit for bit), the
kernel's own accounting of huge pages (/proc/self/smaps) and MLX's of the memory held.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_infer import cpu_kernels
from mlx_infer.loading import huge_pages, load, policy

pytestmark = pytest.mark.skipif(not cpu_kernels.applies(), reason="the native CPU kernels are not built here")


needs_thp = pytest.mark.skipif(
    sys.platform != "linux" or not huge_pages._thp_enabled(), reason="transparent huge pages are off here"
)


def test_pack_copies_each_array_at_its_offset() -> None:
    rng = np.random.default_rng(0)
    arrays = [
        mx.array(rng.integers(0, 2**32, (48, 12), dtype=np.uint32)),
        mx.array(rng.standard_normal((48, 3)).astype(np.float16)),
        mx.array(rng.standard_normal((5, 7)).astype(np.float32)).T,  # not row-contiguous
        mx.array(rng.integers(0, 255, 3, dtype=np.uint8)),
    ]
    buffer, offsets = cpu_kernels.pack_on_huge_pages(arrays)
    raw = np.array(buffer)
    assert buffer.dtype == mx.uint8 and all(o % 64 == 0 for o in offsets)
    for a, start in zip(arrays, offsets, strict=True):
        expected = np.ascontiguousarray(np.array(a)).view(np.uint8).reshape(-1)
        np.testing.assert_array_equal(raw[start : start + a.nbytes], expected)
        view = buffer[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
        np.testing.assert_array_equal(np.array(view), np.array(a))
    assert raw[offsets[0] + arrays[0].nbytes : offsets[1]].sum() == 0  # padding


@needs_thp
def test_a_large_pack_lands_on_huge_pages() -> None:
    a = mx.ones((16 << 20,), dtype=mx.uint8)  # 16 MiB: at least six whole 2 MiB windows
    buffer, _ = cpu_kernels.pack_on_huge_pages([a])
    assert cpu_kernels.huge_page_bytes(buffer) >= 6 << 21


@pytest.fixture(scope="module")
def loaded_both(smollm2_path: Path):
    """SmolLM2 loaded as users get it (weights moved), and once with the move switched off."""
    moved = load(str(smollm2_path))
    original = policy.move_to_huge_pages
    policy.move_to_huge_pages = lambda model: 0
    try:
        unmoved = load(str(smollm2_path))
    finally:
        policy.move_to_huge_pages = original
    return moved, unmoved


@needs_thp
def test_smollm2_weights_are_on_huge_pages_and_held_once(loaded_both) -> None:
    moved, unmoved = loaded_both
    layer = moved.model.model.layers[3]
    attn, mlp = layer.self_attn, layer.mlp
    arrays = [
        attn.q_proj._fused.params["weight"], attn.o_proj["weight"], mlp.gate_proj._fused.params["scales"],
        mlp.down_proj["biases"], moved.model.model.embed_tokens["weight"],
    ]
    assert all(cpu_kernels.huge_page_bytes(a) > 0 for a in arrays)
    # (Not asserted: that the unmoved weights are on small pages. The kernel may give a mapping huge pages
    # on its own (khugepaged; this VM also runs DAMON's kdamond), and which mapping an unmoved array lands
    # in depends on what ran before: in one full-suite run its mapping held 118 MiB of huge pages.)
    # A fused member's arrays still lie inside its fused ones (no copy of their own).
    base = np.array(attn.q_proj._fused.params["weight"], copy=False).ctypes.data
    assert np.array(attn.k_proj["weight"], copy=False).ctypes.data == base + attn.q_proj["weight"].nbytes


def test_moved_weights_hold_the_same_values_and_give_the_same_logits(loaded_both) -> None:
    moved, unmoved = loaded_both
    params = dict(tree_flatten(moved.model.parameters()))
    reference = dict(tree_flatten(unmoved.model.parameters()))
    assert params.keys() == reference.keys()
    for name, a in params.items():
        assert a.dtype == reference[name].dtype and a.shape == reference[name].shape, name
        assert mx.array_equal(a, reference[name]).item(), name
    from test_loading import all_logits

    tokens = [1, 504, 2143, 30, 7, 9031, 12, 45]
    np.testing.assert_array_equal(all_logits(moved.model, tokens), all_logits(unmoved.model, tokens))


def test_the_move_adds_at_most_one_pack_of_memory(smollm2_path: Path) -> None:
    """Each pack's source arrays are freed once their views are in place: the model holds its weights
    once, and loading peaks at most one pack (here the 32 MB head) above a load without the move."""

    def load_measured(move: bool) -> tuple[int, int, object]:
        original = policy.move_to_huge_pages
        if not move:
            policy.move_to_huge_pages = lambda model: 0
        try:
            mx.clear_cache()
            before = mx.get_active_memory()
            mx.reset_peak_memory()
            loaded = load(str(smollm2_path))
            return mx.get_active_memory() - before, mx.get_peak_memory() - before, loaded
        finally:
            policy.move_to_huge_pages = original

    _, unmoved_peak, unmoved = load_measured(move=False)
    del unmoved
    held, peak, loaded = load_measured(move=True)
    weights = sum(a.nbytes for _, a in tree_flatten(loaded.model.parameters()))
    assert held == pytest.approx(weights, rel=0.02)
    head = loaded.model.model.embed_tokens
    largest = max(huge_pages.PACK_BYTES, sum(head[n].nbytes for n in ("weight", "scales", "biases")))
    assert peak <= unmoved_peak + largest * 1.05


def test_no_memory_for_a_pack_leaves_the_rest_where_it_was(smollm2_path: Path, loaded_both, monkeypatch):
    """A pack that cannot be allocated stops the move there: the load goes on, the weights all hold their
    values, those already moved stay views into their pack."""
    packs = []
    real = cpu_kernels.pack_on_huge_pages

    def second_fails(arrays):
        if packs:
            raise RuntimeError("[malloc] Unable to allocate")
        packs.append(real(arrays))
        return packs[-1]

    monkeypatch.setattr(cpu_kernels, "pack_on_huge_pages", second_fails)
    partly = load(str(smollm2_path))
    _, unmoved = loaded_both
    reference = dict(tree_flatten(unmoved.model.parameters()))
    for name, a in tree_flatten(partly.model.parameters()):
        assert mx.array_equal(a, reference[name]).item(), name
    start = np.array(packs[0][0], copy=False).ctypes.data

    def in_first_pack(a: mx.array) -> bool:
        return start <= np.array(a, copy=False).ctypes.data < start + packs[0][0].nbytes

    # model order: the (tied) embedding table first, the last layer's arrays last
    assert in_first_pack(partly.model.model.embed_tokens["weight"])
    assert not in_first_pack(partly.model.model.layers[-1].mlp.down_proj["weight"])
