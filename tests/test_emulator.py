"""The Metal emulator runs kernel bodies like a Mac would and catches each failure class."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from mlx_infer.metal_kernels.emulator import (
    BarrierDivergence,
    DataRace,
    Emulator,
    KernelFault,
    OutOfBounds,
    UnwrittenOutput,
    toolchain_available,
)
from mlx_infer.metal_kernels.emulator.translate import translate
from mlx_infer.metal_kernels.launch import KernelSpec

pytestmark = pytest.mark.skipif(not toolchain_available(), reason="the emulator needs `pip install ziglang`")


def run(source: str, n: int = 64, tg: int = 32, emulator: Emulator | None = None, **kw) -> np.ndarray:
    spec = KernelSpec("probe", ("a",), ("out",), source)
    (out,) = (emulator or Emulator()).launch(
        spec, inputs=[mx.arange(n).astype(mx.float32)], template=[("T", mx.float32)], grid=(n, 1, 1),
        threadgroup=(tg, 1, 1), output_shapes=[(n,)], output_dtypes=[mx.float32], **kw,
    )
    return np.asarray(out)


def test_threadgroup_memory_barriers_and_simd_collectives():
    out = run(
        """
        const uint i = thread_position_in_grid.x, t = thread_position_in_threadgroup.x;
        threadgroup float shared[64];
        shared[t] = a[i];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[i] = simd_sum(shared[63 - t]) + simd_max(a[i]) * 1000.0f + float(simdgroup_index_in_threadgroup);
        """,
        n=128, tg=64,
    )
    a = np.arange(128, dtype=np.float32).reshape(2, 2, 32)  # threadgroup, SIMD group, lane
    reversed_sums = a[:, ::-1].sum(-1)  # lanes of SIMD group s read the other group's values
    expect = reversed_sums[:, :, None] + a.max(-1)[:, :, None] * 1000 + np.arange(2)[None, :, None]
    np.testing.assert_array_equal(out, np.broadcast_to(expect, (2, 2, 32)).reshape(-1))


def test_shuffles_prefix_sums_and_partial_threadgroups():
    # 40 threads in groups of 32: the second threadgroup holds 8 threads and reports that size.
    out = run(
        """
        const uint i = thread_position_in_grid.x;
        const uint n = threads_per_threadgroup.x;
        out[i] = simd_shuffle_down(a[i], 1) + 100.0f * simd_prefix_exclusive_sum(1.0f) + 10000.0f * n
                 + simd_shuffle_xor(a[i], 1) * 0.0f;
        """,
        n=40, tg=32,
    )
    lane = np.arange(40) % 32
    size = np.where(np.arange(40) < 32, 32, 8)
    down = np.where(lane + 1 < size, np.arange(40) + 1, np.arange(40))  # last lane keeps its own value
    np.testing.assert_array_equal(out, down + 100 * lane + 10000 * size)


def test_vector_constructors_conversions_and_atomics():
    spec = KernelSpec("vectors", ("a",), ("out", "count"), """
        const uint i = thread_position_in_grid.x;
        float4 v = float4(float2(a[i], 1.0f), 2.0f, 3.0f);
        half4 h = half4(v);                       // conversion, not a bit cast
        float4 back = static_cast<float4>(h);
        const float value = back.x + back.y * 10.0f + dot(v.zw, float2(1.0f)) * 100.0f;
        atomic_store_explicit(&out[i], value, memory_order_relaxed);  // atomic_outputs: every output
        atomic_fetch_add_explicit(&count[0], 1, memory_order_relaxed);
    """, atomic_outputs=True)
    out, count = Emulator().launch(
        spec, inputs=[mx.arange(64).astype(mx.float32)], template=[], grid=(64, 1, 1), threadgroup=(32, 1, 1),
        output_shapes=[(64,), (1,)], output_dtypes=[mx.float32, mx.float32], init_value=0,
    )
    np.testing.assert_array_equal(np.asarray(out), np.arange(64) + 10 + 500)
    assert int(count[0]) == 64


def test_out_of_bounds_read_is_caught():
    with pytest.raises(OutOfBounds, match="byte 256 of buffer 'a'"):
        run("uint i = thread_position_in_grid.x; out[i] = a[i + 1];")


def test_out_of_bounds_write_is_caught():
    with pytest.raises(OutOfBounds, match="buffer 'out'"):
        run("uint i = thread_position_in_grid.x; out[i + 1] = a[i];")


def test_barrier_skipped_by_returned_threads_is_a_deadlock():
    with pytest.raises(BarrierDivergence, match="16 of 32 threads"):
        run("""
            uint i = thread_position_in_grid.x;
            if (i % 32 >= 16) { out[i] = a[i]; return; }
            threadgroup_barrier(mem_flags::mem_threadgroup);
            out[i] = a[i];
        """)


def test_barriers_in_divergent_branches_are_caught():
    with pytest.raises(BarrierDivergence, match="different threadgroup_barrier"):
        run("""
            uint i = thread_position_in_grid.x;
            if (i % 2) { threadgroup_barrier(mem_flags::mem_threadgroup); }
            else { threadgroup_barrier(mem_flags::mem_threadgroup); }
            out[i] = a[i];
        """)


def test_unwritten_output_is_caught():
    with pytest.raises(UnwrittenOutput, match="1 of 64 elements never written"):
        run("uint i = thread_position_in_grid.x; if (i < 63) out[i] = a[i];")


def test_missing_barrier_race_is_caught_by_schedule_perturbation():
    racy = """
        uint i = thread_position_in_grid.x, t = thread_position_in_threadgroup.x;
        threadgroup float s[32];
        s[t] = a[i];
        BARRIER
        out[i] = s[(t + 1) % 32];
    """
    both = Emulator(schedule="both")
    fixed = run(racy.replace("BARRIER", "threadgroup_barrier(mem_flags::mem_threadgroup);"), emulator=both)
    np.testing.assert_array_equal(fixed, (np.arange(64) // 32) * 32 + (np.arange(64) + 1) % 32)
    with pytest.raises(DataRace):
        run(racy.replace("BARRIER", ""), emulator=Emulator(schedule="both", check_unwritten=False))


def test_shuffle_from_inactive_lane_is_a_fault():
    with pytest.raises(KernelFault, match="not active"):
        run("uint i = thread_position_in_grid.x; out[i] = simd_shuffle(a[i], (i + 1) % 32);", n=40)


@pytest.mark.skipif(os.environ.get("MLX_INFER_EMULATOR_TSAN") != "1",
                    reason="ThreadSanitizer builds need zig's TSan runtime (about 8 minutes to build once); "
                           "set MLX_INFER_EMULATOR_TSAN=1")
def test_thread_sanitizer_reports_same_address_race():
    # Every thread writes then reads s[0] with no barrier: fibers hide it, TSan does not.
    racy = "uint i = thread_position_in_grid.x; threadgroup float s[1]; s[0] = a[i]; out[i] = s[0];"
    with pytest.raises(DataRace, match="ThreadSanitizer"):
        run(racy, emulator=Emulator(tsan=True, check_unwritten=False))
    run(racy.replace("s[0] = a[i]; out[i] = s[0];", "out[i] = a[i];"), emulator=Emulator(tsan=True))


def test_translation_rewrites_threadgroup_declarations_and_vector_calls():
    source = """template <typename T>
[[kernel]] void custom_kernel_x(
  const device float* a [[buffer(0)]],
  device float* out [[buffer(1)]],
  uint3 thread_position_in_grid [[thread_position_in_grid]]) {
  threadgroup float tile[4][8];
  float4 v = float4(a[0], 1.0f, float2(2.0f));
}
template [[host_name("custom_kernel_x")]] [[kernel]] decltype(custom_kernel_x<float>) custom_kernel_x<float>;
"""
    unit = translate(source)
    assert "__mtl_threadgroup_alloc(0, sizeof(float[4][8]), alignof(float))" in unit.cpp
    assert "__mtl_make<float, 4>(a[0], 1.0f, __mtl_make<float, 2>(2.0f))" in unit.cpp
    assert "custom_kernel_x<float>((const device float*)b[0]" in unit.cpp
    assert [p.name for p in unit.params] == ["a", "out", "thread_position_in_grid"]
