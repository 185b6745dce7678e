"""The Gated DeltaNet recurrence as a Metal kernel: ``B`` sequences of up to ``L`` tokens each (a decode
step is ``L = 1``; chunked prefill and speculative verification rows are longer), each run token after
token from the state in its slot.

A simdgroup owns one value column ``j`` of one (sequence, head) state matrix and keeps it in registers
across the sequence's tokens, each lane ``Dk / 32`` of its rows (as mlx-lm's ``gated_delta_kernel``):
per token a ``simd_sum`` forms the prediction ``(k^T S)_j``, then each lane updates its rows and a
second ``simd_sum`` reads them with ``q``. Columns are independent (the delta rule's update touches column
``j`` only through its own error ``delta_j``), so there is no threadgroup memory and no barrier, and the
state is read and written once per call however many tokens it carries. Each head's block is laid out
as in the state pool (``interface/state.py``): its ``[Dk, Dv]`` matrix, then a row for its last output; a
Metal kernel cannot write its inputs, so the rows come out as a new array that the state's write copies
into the slots.
"""

from __future__ import annotations

import mlx.core as mx

from mlx_infer.metal_kernels.launch import KernelSpec, Launcher, metal_launch

_SOURCE = """
  const uint lane = thread_position_in_threadgroup.x;
  const uint j = thread_position_in_grid.y;
  const uint bh = thread_position_in_grid.z;
  const uint b = bh / uint(H);
  const uint h = bh % uint(H);
  const int L = queries_shape[1];
  constexpr int PER_LANE = (DK + 31) / 32;
  constexpr size_t HEAD = size_t(DK + 1) * DV;
  const device float* S = states + (size_t(slots[b]) * H + h) * HEAD;
  device float* S_new = rows + size_t(bh) * HEAD;
  float s[PER_LANE];
  for (int r = 0; r < PER_LANE; r++) {
    const int i = r * 32 + int(lane);
    s[r] = i < DK ? S[i * DV + j] : 0.0f;
  }
  const int n = lengths[b];
  float o = 0.0f;
  for (int t = 0; t < L; t++) {
    const size_t row = (size_t(b) * L + t) * H + h;
    if (t >= n) {  // padding: the same for every lane of the simdgroup
      if (lane == 0) out[row * DV + j] = 0.0f;
      continue;
    }
    const device float* qv = queries + row * DK;
    const device float* kv = keys + row * DK;
    const float dec = decay[row];
    float pred = 0.0f;
    for (int r = 0; r < PER_LANE; r++) {
      const int i = r * 32 + int(lane);
      if (i < DK) pred += s[r] * kv[i];
    }
    pred = simd_sum(pred);
    const float delta = (values[row * DV + j] - pred * dec) * beta[row];
    o = 0.0f;
    for (int r = 0; r < PER_LANE; r++) {
      const int i = r * 32 + int(lane);
      if (i < DK) {
        s[r] = s[r] * dec + kv[i] * delta;
        o += s[r] * qv[i];
      }
    }
    o = simd_sum(o);
    if (lane == 0) out[row * DV + j] = o;
  }
  for (int r = 0; r < PER_LANE; r++) {
    const int i = r * 32 + int(lane);
    if (i < DK) S_new[i * DV + j] = s[r];
  }
  if (lane == 0) S_new[DK * DV + j] = o;
"""

GATED_DELTA = KernelSpec(
    name="gated_delta",
    input_names=("states", "slots", "lengths", "queries", "keys", "values", "decay", "beta"),
    output_names=("rows", "out"),
    source=_SOURCE,
)


def gated_delta(
    pool: mx.array,
    slots: mx.array,
    q: mx.array,
    k: mx.array,
    v: mx.array,
    decay: mx.array,
    beta: mx.array,
    lengths: mx.array | None = None,
    *,
    launch: Launcher = metal_launch,
) -> tuple[mx.array, mx.array]:
    """``pool`` ``[S, 1, H * (Dk + 1) * Dv]`` float32, ``slots`` ``[B]``, ``q``/``k`` ``[B, L, H, Dk]``, ``v``
    ``[B, L, H, Dv]``, ``decay``/``beta`` ``[B, L, H]``, ``lengths`` ``[B]`` (None: all ``L``)
    -> (``[B, H * (Dk + 1) * Dv]``, each sequence's new slot row; the outputs ``[B, L, H, Dv]``, 0 on
    padding)."""
    b, length, h, dk = k.shape
    dv = v.shape[-1]
    if lengths is None:
        lengths = mx.full((b,), length, dtype=mx.int32)
    inputs = [pool, slots.astype(mx.int32), lengths.astype(mx.int32)]
    inputs += [a.astype(mx.float32) for a in (q, k, v, decay, beta)]
    rows, out = launch(
        GATED_DELTA,
        inputs=inputs,
        template=[("H", h), ("DK", dk), ("DV", dv)],
        grid=(32, dv, b * h),
        threadgroup=(32, 4 if dv % 4 == 0 else 1, 1),
        output_shapes=[(b, h * (dk + 1) * dv), (b, length, h, dv)],
        output_dtypes=[mx.float32, mx.float32],
    )
    return rows, out
