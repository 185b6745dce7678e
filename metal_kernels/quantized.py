"""Fused dequantize + matrix-vector kernels for decode (a few rows of activations).

Decode reads every weight once per token, so these kernels read the packed weights exactly once
for up to ``MAX_ROWS`` activation rows and never materialise a dequantized matrix. One SIMD group
per output feature: lanes stride over packed words (MLX affine) or 256-value blocks (GGUF K-quants),
accumulate in float32 and meet in ``simd_sum``; lane 0 applies the epilogue (bias, residual).
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from mlx_infer.errors import InvalidRequest
from mlx_infer.metal_kernels.gguf_reference import BLOCK_BYTES, QK_K
from mlx_infer.metal_kernels.launch import KernelSpec, Launcher, metal_launch

MAX_ROWS = 8  # activation rows per launch; more rows are a matmul, not a matvec
SIMD_PER_TG = 4  # output features per threadgroup

_AFFINE = """
  const uint n = thread_position_in_grid.y;
  const uint lane = thread_index_in_simdgroup;
  constexpr int PER_WORD = 32 / BITS;
  constexpr uint MASK = (1u << BITS) - 1u;
  constexpr int WORDS = K / PER_WORD;
  constexpr int GROUPS = K / GROUP;
  float acc[M];
  for (int m = 0; m < M; m++) acc[m] = 0.0f;
  for (int w = int(lane); w < WORDS; w += 32) {
    const uint word = w_q[size_t(n) * WORDS + w];
    const int k0 = w * PER_WORD;
    const float s = float(scales[size_t(n) * GROUPS + k0 / GROUP]);
    const float b = float(biases[size_t(n) * GROUPS + k0 / GROUP]);
    for (int m = 0; m < M; m++) {
      float xq = 0.0f, xs = 0.0f;
      for (int i = 0; i < PER_WORD; i++) {
        const float xv = float(x[m * K + k0 + i]);
        xq += xv * float((word >> (BITS * i)) & MASK);
        xs += xv;
      }
      acc[m] += s * xq + b * xs;  // sum(x * (s q + b)) without forming s q + b per element
    }
  }
  for (int m = 0; m < M; m++) {
    const float total = simd_sum(acc[m]);
    if (lane == 0) {
      float r = total;
      EPILOGUE
      out[m * N + n] = static_cast<O>(r);
    }
  }
"""

_KQUANT = """
  const uint n = thread_position_in_grid.y;
  const uint lane = thread_index_in_simdgroup;
  constexpr int NB = K / 256;
  float acc[M];
  for (int m = 0; m < M; m++) acc[m] = 0.0f;
  for (int bi = int(lane); bi < NB; bi += 32) {
    const device uint8_t* blk = w + (size_t(n) * NB + bi) * BLOCK_BYTES;
    BLOCK_DOT
  }
  for (int m = 0; m < M; m++) {
    const float total = simd_sum(acc[m]);
    if (lane == 0) {
      float r = total;
      EPILOGUE
      out[m * N + n] = static_cast<O>(r);
    }
  }
"""

# llama.cpp dequantize_row_q4_K / _q5_K: d and dmin, then 8 sub-blocks of 32 values with 6-bit
# scales/mins packed in 12 bytes; Q5_K adds a fifth bit per value (bit j of qh[l] for sub-block j).
_SCALE_MIN_K4 = """
    const float d = float(as_type<half>(ushort(blk[0] | (blk[1] << 8))));
    const float dmin = float(as_type<half>(ushort(blk[2] | (blk[3] << 8))));
    const device uint8_t* sc = blk + 4;
    for (int j = 0; j < 8; j++) {
      const int scale = j < 4 ? (sc[j] & 63) : ((sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4));
      const int mn = j < 4 ? (sc[j + 4] & 63) : ((sc[j + 4] >> 4) | ((sc[j] >> 6) << 4));
      const int shift = (j % 2) * 4;
      for (int m = 0; m < M; m++) {
        const int x0 = m * K + bi * 256 + j * 32;
        float xq = 0.0f, xs = 0.0f;
        for (int l = 0; l < 32; l++) {
          const float xv = float(x[x0 + l]);
          xq += xv * float(QUANT);
          xs += xv;
        }
        acc[m] += d * scale * xq - dmin * mn * xs;
      }
    }
"""
_Q4_K_DOT = """
    const device uint8_t* qs0 = blk + 16;
""" + _SCALE_MIN_K4.replace("QUANT", "(qs0[(j / 2) * 32 + l] >> shift) & 15")

_Q5_K_DOT = """
    const device uint8_t* qh = blk + 16;
    const device uint8_t* qs0 = blk + 48;
""" + _SCALE_MIN_K4.replace("QUANT", "((qs0[(j / 2) * 32 + l] >> shift) & 15) | (((qh[l] >> j) & 1) << 4)")

# llama.cpp dequantize_row_q6_K: two halves of 128; 6-bit values from ql (low 4) and qh (high 2).
_Q6_K_DOT = """
    const float d = float(as_type<half>(ushort(blk[208] | (blk[209] << 8))));
    for (int h = 0; h < 2; h++) {
      const device uint8_t* ql = blk + h * 64;
      const device uint8_t* qh = blk + 128 + h * 32;
      const device int8_t* sc = (const device int8_t*)(blk + 192 + h * 8);
      for (int l = 0; l < 32; l++) {
        const int q1 = int((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = int((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = int((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = int((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        const int is = l / 16;
        for (int m = 0; m < M; m++) {
          const int x0 = m * K + bi * 256 + h * 128 + l;
          acc[m] += d * (float(sc[is]) * q1 * float(x[x0]) + float(sc[is + 2]) * q2 * float(x[x0 + 32])
                         + float(sc[is + 4]) * q3 * float(x[x0 + 64])
                         + float(sc[is + 6]) * q4 * float(x[x0 + 96]));
        }
      }
    }
"""


def _epilogue(has_bias: bool, has_residual: bool) -> tuple[tuple[str, ...], str]:
    names = (("bias",) if has_bias else ()) + (("residual",) if has_residual else ())
    code = ("r += float(bias[n]);" if has_bias else "")
    code += " r += float(residual[m * N + n]);" if has_residual else ""
    return names, code


@cache
def affine_spec(has_bias: bool, has_residual: bool) -> KernelSpec:
    extra, code = _epilogue(has_bias, has_residual)
    suffix = "".join(n[0] for n in extra)
    return KernelSpec(f"affine_qmv{suffix}", ("x", "w_q", "scales", "biases", *extra), ("out",),
                      _AFFINE.replace("EPILOGUE", code))


@cache
def kquant_spec(kind: str, has_bias: bool) -> KernelSpec:
    extra, code = _epilogue(has_bias, False)
    body = _KQUANT.replace("BLOCK_DOT", {"Q4_K": _Q4_K_DOT, "Q5_K": _Q5_K_DOT, "Q6_K": _Q6_K_DOT}[kind])
    return KernelSpec(f"{kind.lower()}_qmv{'b' if has_bias else ''}", ("x", "w", *extra), ("out",),
                      body.replace("EPILOGUE", code).replace("BLOCK_BYTES", str(BLOCK_BYTES[kind])))


def _rows(x: mx.array) -> mx.array:
    if x.ndim != 2 or x.shape[0] > MAX_ROWS:
        raise InvalidRequest(f"matvec kernels take [rows <= {MAX_ROWS}, K] activations, got {x.shape}")
    return x


def affine_matvec(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
    bias: mx.array | None = None, residual: mx.array | None = None, *, launch: Launcher = metal_launch,
) -> mx.array:
    """``x @ dequantize(w).T (+ bias) (+ residual)`` for MLX affine 4/8-bit weights, ``x`` ``[M, K]``."""
    x = _rows(x)
    if bits not in (4, 8) or group_size not in (32, 64, 128):
        raise InvalidRequest(f"affine matvec supports 4/8 bits, groups 32/64/128; got {bits}, {group_size}")
    rows, k = x.shape
    n = w.shape[0]
    extra = [a for a in (bias, residual) if a is not None]
    (out,) = launch(
        affine_spec(bias is not None, residual is not None),
        inputs=[x, w, scales, biases, *extra],
        template=[("O", x.dtype), ("M", rows), ("K", k), ("N", n), ("BITS", bits), ("GROUP", group_size)],
        grid=(32, n, 1), threadgroup=(32, SIMD_PER_TG, 1),
        output_shapes=[(rows, n)], output_dtypes=[x.dtype],
    )
    return out


def kquant_matvec(
    x: mx.array, raw: mx.array, kind: str, bias: mx.array | None = None, *, launch: Launcher = metal_launch
) -> mx.array:
    """``x @ dequantize(raw).T (+ bias)`` for GGUF ``Q4_K``/``Q5_K``/``Q6_K`` rows of raw bytes."""
    x = _rows(x)
    if kind not in BLOCK_BYTES:
        raise InvalidRequest(f"K-quant matvec supports {sorted(BLOCK_BYTES)}, got {kind}")
    rows, k = x.shape
    n = raw.shape[0]
    if k % QK_K or raw.shape[1] != k // QK_K * BLOCK_BYTES[kind]:
        raise InvalidRequest(f"{kind} weight {raw.shape} does not match activations of width {k}")
    (out,) = launch(
        kquant_spec(kind, bias is not None),
        inputs=[x, raw, *([bias] if bias is not None else [])],
        template=[("O", x.dtype), ("M", rows), ("K", k), ("N", n)],
        grid=(32, n, 1), threadgroup=(32, SIMD_PER_TG, 1),
        output_shapes=[(rows, n)], output_dtypes=[x.dtype],
    )
    return out
