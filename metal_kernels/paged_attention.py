"""Paged attention as Metal kernel bodies: decode and prefill chunks, GQA, optional split-KV.

One threadgroup per (query token, head[, key partition]); its SIMD groups take keys round-robin,
each keeping an online softmax (running max, sum, and its lanes' slice of the output) that the
threadgroup merges through threadgroup memory. A query at position p sees keys 0..p of its own
sequence (cached blocks plus its chunk's causal part), so decode and prefill chunks are one kernel.

Split-KV: when too few threadgroups would fill the GPU, the keys are cut into partitions, each
writes a normalised partial output with its max and sum, and a reduce kernel merges them.

The pools may be of any float type (read as float) or int8 (``models/base.py: LayerKV``): rows of
``D + 4`` bytes, ``D`` values then their float32 scale, which multiplies a key's dot product and a
value's softmax weight, so the rows are read where they lie and nothing is dequantized.
"""

from __future__ import annotations

import mlx.core as mx

from mlx_infer.interface.batch import BatchMetadata
from mlx_infer.metal_kernels.launch import KernelSpec, Launcher, metal_launch

N_SIMD = 4  # SIMD groups per threadgroup (128 threads)
PARTITION_KEYS = 256  # keys per partition of the split-KV variant
MIN_THREADGROUPS = 128  # below this many (token, head) pairs, long contexts are split

_BODY = """
  const uint part = threadgroup_position_in_grid.x;
  const uint head = threadgroup_position_in_grid.y;
  const uint tok = threadgroup_position_in_grid.z;
  const uint sg = simdgroup_index_in_threadgroup;
  const uint lane = thread_index_in_simdgroup;
  const uint kv_head = head / (H / HKV);
  const int seq = seq_ids[tok];
  const int pos = positions[tok];
  const int n_keys = min(pos + 1, context_lens[seq]);
  int start = int(part) * PART;
  const int stop = min(n_keys, start + PART);
  if (WINDOW) start = max(start, pos + 1 - window);
  constexpr int PER_LANE = (D + 31) / 32;
  constexpr int PER_LANE_V = (VD + 31) / 32;

  // This lane's slice of the (pre-scaled) query: dims lane, lane + 32, ...; and of the output.
  float q[PER_LANE];
  float acc[PER_LANE_V];
  for (int i = 0; i < PER_LANE; i++) {
    const int d = int(lane) + 32 * i;
    q[i] = d < D ? float(queries[(size_t(tok) * H + head) * D + d]) * scale : 0.0f;
  }
  for (int i = 0; i < PER_LANE_V; i++) acc[i] = 0.0f;
  float m = -MAXFLOAT;  // finite, so exp(m - m_new) is 0 (not NaN) before the first key
  float l = 0.0f;
  for (int j = start + int(sg); j < stop; j += N_SIMD) {
    const int slot = block_tables[seq * MAX_BLOCKS + j / BS] * BS + j % BS;
    const size_t base = (size_t(slot) * HKV + kv_head) * ROW;
    const size_t vbase = (size_t(slot) * HKV + kv_head) * VROW;  // values: the first VD of a VROW row
    float partial = 0.0f;
    for (int i = 0; i < PER_LANE; i++) {
      const int d = int(lane) + 32 * i;
      if (d < D) partial += q[i] * float(key_pool[base + d]);
    }
    float s = simd_sum(partial);
    float v_scale = 1.0f;
    if (KV_INT8) {
      s *= row_scale(key_pool, base + D);
      v_scale = row_scale(value_pool, vbase + VROW - 4);
    }
    if (SOFTCAP) s = metal::precise::tanh(s / softcap) * softcap;
    const float m_new = max(m, s);
    const float alpha = metal::exp(m - m_new);
    const float p = metal::exp(s - m_new);
    l = l * alpha + p;
    const float pv = p * v_scale;
    for (int i = 0; i < PER_LANE_V; i++) {
      const int d = int(lane) + 32 * i;
      if (d < VD) acc[i] = acc[i] * alpha + pv * float(value_pool[vbase + d]);
    }
    m = m_new;
  }

  threadgroup float sg_max[N_SIMD];
  threadgroup float sg_sum[N_SIMD];
  threadgroup float sg_acc[N_SIMD * VD];
  if (lane == 0) {
    sg_max[sg] = m;
    sg_sum[sg] = l;
  }
  for (int i = 0; i < PER_LANE_V; i++) {
    const int d = int(lane) + 32 * i;
    if (d < VD) sg_acc[sg * VD + d] = acc[i];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float big = -MAXFLOAT;
  for (int s = 0; s < N_SIMD; s++) big = max(big, sg_max[s]);
  float total = 0.0f;
  SINK
  for (int s = 0; s < N_SIMD; s++) total += sg_sum[s] * metal::exp(sg_max[s] - big);
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  for (int d = int(thread_index_in_threadgroup); d < VD; d += N_SIMD * 32) {
    float o = 0.0f;
    for (int s = 0; s < N_SIMD; s++) o += sg_acc[s * VD + d] * metal::exp(sg_max[s] - big);
    EPILOGUE
  }
"""

_SINGLE = """out[(size_t(tok) * H + head) * VD + d] = static_cast<O>(o * inv);"""
_PARTIAL = """const size_t row = (size_t(tok) * H + head) * PARTS + part;
    part_out[row * VD + d] = o * inv;
    if (d == 0) {
      part_max[row] = big;
      part_sum[row] = total;
    }"""

# An attention sink (gpt-oss: a logit per head joining the softmax's denominator with no value), added
# once where the partial softmaxes are merged: the maximum is taken over it too, so no exp overflows.
_SINK = """const float sink = float(sinks[SINK_HEAD]);
  big = max(big, sink);
  total = metal::exp(sink - big);"""

# The float32 scale stored after an int8 row's values (little-endian bytes, any alignment).
_HEADER = """
template <typename T>
inline float row_scale(const device T* pool, size_t at) {
  return as_type<float>(uint(uchar(pool[at])) | (uint(uchar(pool[at + 1])) << 8) |
                        (uint(uchar(pool[at + 2])) << 16) | (uint(uchar(pool[at + 3])) << 24));
}
"""

_INPUTS = ("queries", "key_pool", "value_pool", "block_tables", "context_lens", "seq_ids", "positions",
           "scale", "window", "softcap")
_SINGLE_BODY = _BODY.replace("EPILOGUE", _SINGLE)
ATTENTION = KernelSpec("paged_attention", _INPUTS, ("out",), _SINGLE_BODY.replace("SINK", ""), _HEADER)
ATTENTION_SINKS = KernelSpec(
    "paged_attention_sinks", (*_INPUTS, "sinks"), ("out",),
    _SINGLE_BODY.replace("SINK", _SINK.replace("SINK_HEAD", "head")), _HEADER,
)
ATTENTION_PARTIAL = KernelSpec(  # partitions never see the sink: the reduce adds it once
    "paged_attention_partial", _INPUTS, ("part_out", "part_max", "part_sum"),
    _BODY.replace("EPILOGUE", _PARTIAL).replace("SINK", ""), _HEADER,
)
_REDUCE_BODY = """
  const size_t row = size_t(threadgroup_position_in_grid.z) * H + threadgroup_position_in_grid.y;
  float big = -MAXFLOAT;
  for (int p = 0; p < PARTS; p++) big = max(big, part_max[row * PARTS + p]);
  float total = 0.0f;
  SINK
  for (int p = 0; p < PARTS; p++) {
    total += part_sum[row * PARTS + p] * metal::exp(part_max[row * PARTS + p] - big);
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  for (int d = int(thread_position_in_threadgroup.x); d < D; d += int(threads_per_threadgroup.x)) {
    float o = 0.0f;
    for (int p = 0; p < PARTS; p++) {
      const float w = part_sum[row * PARTS + p] * metal::exp(part_max[row * PARTS + p] - big);
      o += w * part_out[(row * PARTS + p) * D + d];
    }
    out[row * D + d] = static_cast<O>(o * inv);
  }
"""
REDUCE = KernelSpec(
    "paged_attention_reduce", ("part_out", "part_max", "part_sum"), ("out",), _REDUCE_BODY.replace("SINK", "")
)
REDUCE_SINKS = KernelSpec(
    "paged_attention_reduce_sinks", ("part_out", "part_max", "part_sum", "sinks"), ("out",),
    _REDUCE_BODY.replace("SINK", _SINK.replace("SINK_HEAD", "threadgroup_position_in_grid.y")),
)


def paged_attention(
    queries: mx.array,
    key_pool: mx.array,
    value_pool: mx.array,
    meta: BatchMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: mx.array | None = None,
    value_dim: int | None = None,
    *,
    launch: Launcher = metal_launch,
    partition_keys: int | None = None,
) -> mx.array:
    """Same contract as ``reference.paged_attention``; ``partition_keys`` forces the split-KV variant.
    ``head_dim`` comes from the queries: an int8 pool's rows are 4 bytes longer."""
    n_tokens, n_heads, head_dim = queries.shape
    value_row = value_pool.shape[2]
    value_dim = value_dim or value_row - (4 if value_pool.dtype == mx.int8 else 0)
    out_shape = (n_tokens, n_heads, value_dim)
    n_kv = key_pool.shape[1]
    key_len = meta.key_slots.shape[1]  # host-known bound on every context length
    if partition_keys is None and n_tokens * n_heads < MIN_THREADGROUPS and key_len > 2 * PARTITION_KEYS:
        partition_keys = PARTITION_KEYS
    parts = 1 if partition_keys is None else -(-key_len // partition_keys)
    seq_ids = (
        mx.arange(meta.batch_size, dtype=mx.int32)
        if meta.q_unpad_index is None
        else meta.q_unpad_index // meta.max_query_len
    )
    inputs = [
        queries, key_pool, value_pool, meta.block_tables, meta.context_lens, seq_ids, meta.positions,
        mx.array(scale, mx.float32), mx.array(sliding_window or 0, mx.int32),
        mx.array(logit_softcap or 1.0, mx.float32),
    ]
    template = [
        ("O", queries.dtype), ("D", head_dim), ("H", n_heads), ("HKV", n_kv), ("BS", meta.block_size),
        ("MAX_BLOCKS", meta.block_tables.shape[1]), ("N_SIMD", N_SIMD),
        ("PART", partition_keys or key_len), ("PARTS", parts),
        ("WINDOW", sliding_window is not None), ("SOFTCAP", logit_softcap is not None),
        ("KV_INT8", key_pool.dtype == mx.int8), ("ROW", key_pool.shape[2]), ("VD", value_dim),
        ("VROW", value_row),
    ]
    grid = (32 * N_SIMD * parts, n_heads, n_tokens)
    threadgroup = (32 * N_SIMD, 1, 1)
    sink_inputs = [] if sinks is None else [sinks.astype(mx.float32)]
    if parts == 1:
        spec = ATTENTION if sinks is None else ATTENTION_SINKS
        (out,) = launch(spec, inputs=inputs + sink_inputs, template=template, grid=grid,
                        threadgroup=threadgroup, output_shapes=[out_shape], output_dtypes=[queries.dtype])
        return out
    rows = n_tokens * n_heads * parts
    partial = launch(
        ATTENTION_PARTIAL, inputs=inputs, template=template, grid=grid, threadgroup=threadgroup,
        output_shapes=[(rows, value_dim), (rows,), (rows,)], output_dtypes=[mx.float32] * 3,
    )
    (out,) = launch(
        REDUCE if sinks is None else REDUCE_SINKS, inputs=partial + sink_inputs,
        template=[("O", queries.dtype), ("D", value_dim), ("H", n_heads), ("PARTS", parts)],
        grid=(32, n_heads, n_tokens), threadgroup=(32, 1, 1),
        output_shapes=[out_shape], output_dtypes=[queries.dtype],
    )
    return out
