"""The Gated DeltaNet decode step (one token per sequence) as a Metal kernel.

Each thread owns one value column ``j`` of one (sequence, head) state matrix, read straight out of the
sequence's slot of the state pool: it predicts ``(k^T S')_j`` of the decayed state, forms its error,
then updates and reads column ``j`` in one pass. Columns are independent (the delta rule's outer-product
update touches column ``j`` only through ``delta_j``), so there is no threadgroup memory and no barrier.
Each head's block is laid out as in the state pool (``interface/state.py``): its ``[Dk, Dv]`` matrix, then
a row for its output; a Metal kernel cannot write its inputs, so the rows come out as a new array that
the state's write copies into the slots.
"""

from __future__ import annotations

import mlx.core as mx

from mlx_infer.metal_kernels.launch import KernelSpec, Launcher, metal_launch

_SOURCE = """
  const uint j = thread_position_in_grid.x;
  const uint bh = thread_position_in_grid.y;
  if (j >= uint(DV)) return;
  const uint b = bh / uint(H);
  constexpr size_t HEAD = size_t(DK + 1) * DV;
  const device float* S = states + (size_t(slots[b]) * H + bh % uint(H)) * HEAD;
  device float* S_new = rows + size_t(bh) * HEAD;
  const device float* qv = queries + size_t(bh) * DK;
  const device float* kv = keys + size_t(bh) * DK;
  const float dec = decay[bh];
  float pred = 0.0f;
  for (int i = 0; i < DK; i++) pred += S[i * DV + j] * (kv[i] * dec);
  const float delta = (values[size_t(bh) * DV + j] - pred) * beta[bh];
  float o = 0.0f;
  for (int i = 0; i < DK; i++) {
    const float s = S[i * DV + j] * dec + kv[i] * delta;
    S_new[i * DV + j] = s;
    o += s * qv[i];
  }
  S_new[DK * DV + j] = o;
"""

GATED_DELTA_STEP = KernelSpec(
    name="gated_delta_step",
    input_names=("states", "slots", "queries", "keys", "values", "decay", "beta"),
    output_names=("rows",),
    source=_SOURCE,
)


def gated_delta_step(
    pool: mx.array,
    slots: mx.array,
    q: mx.array,
    k: mx.array,
    v: mx.array,
    decay: mx.array,
    beta: mx.array,
    *,
    launch: Launcher = metal_launch,
) -> mx.array:
    """``pool`` ``[S, 1, H * (Dk + 1) * Dv]`` float32, ``slots`` ``[B]``, ``q``/``k`` ``[B, H, Dk]``, ``v``
    ``[B, H, Dv]``, ``decay``/``beta`` ``[B, H]`` -> ``[B, H * (Dk + 1) * Dv]``, each sequence's new slot
    row."""
    b, h, dk = k.shape
    dv = v.shape[-1]
    inputs = [pool, slots.astype(mx.int32)] + [a.astype(mx.float32) for a in (q, k, v, decay, beta)]
    (rows,) = launch(
        GATED_DELTA_STEP,
        inputs=inputs,
        template=[("H", h), ("DK", dk), ("DV", dv)],
        grid=(dv, b * h, 1),
        threadgroup=(min(dv, 128), 1, 1),
        output_shapes=[(b, h * (dk + 1) * dv)],
        output_dtypes=[mx.float32],
    )
    return rows
