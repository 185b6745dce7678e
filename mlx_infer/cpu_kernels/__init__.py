"""Native kernels for MLX's CPU backend: quantized matrix-vector products and paged attention.

MLX's CPU ``quantized_matmul`` is slow and its float32 matmuls read eight times the bytes of 4-bit
weights, while decode on a CPU is bound by the bytes it reads; and attention over a paged cache
built from MLX ops must gather every layer's context into a contiguous copy first. These kernels
(C++, AVX2, a small thread pool; sources in ``src/``) read 4/8-bit weights and the KV pool where they
lie. They are MLX primitives, so they sit in the lazy graph like any op.

:func:`available` says whether they can be used here (built on first use, see ``build.py``); callers
fall back to MLX ops when not, and ``MLX_INFER_CPU_KERNELS=off`` forces that.

Products quantize their activations per 32 values (as llama.cpp does for its Q4/Q8 weights), by
default to int16 (held as two signed bytes, so the inner loop is VNNI integer multiply-adds, AVX-VNNI or
AVX-512 VNNI where the CPU has them, over weights prefetched ahead), and each product is exactly
``w . x^`` for the quantized ``x^``. The same kernel serves every row count, decode to prefill, so a
row's result is the same bits whatever else the product holds: a request's answer does not depend on
the batch, the prefix cache or prefill chunking (attention's key chunks are fixed per query for the
same reason), and prefill needs no BLAS. On SmolLM2 against float32 activations
(``benchmarks/bench_quality.py --chunk 256``, 508 positions) int16 activations give mean KL 0.0000 and
the same top token at every position. ``MLX_INFER_CPU_ACTIVATIONS=int8`` (or :func:`set_activations`,
or ``--cpu-activations``) quantizes x to int8 for the 4-bit weights (8-bit ones, such as an output
head, keep int16 x): half the integer work, at mean KL 0.0028 and top-1 97.6% (llama.cpp's 8-bit
activations on the same weights: 0.0046, 96.7%), with the same row invariance. ``float32`` keeps them
float32, exact to float32 rounding (dequantized tiles through the BLAS for 8 rows and more).
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from mlx_infer.cpu_kernels.build import Unavailable, load
from mlx_infer.interface.step_memo import StepMemo

if TYPE_CHECKING:  # models.base uses this package (RoPE): no import cycle at run time
    from mlx_infer.interface.batch import BatchMetadata

log = logging.getLogger("mlx_infer")

_native: ModuleType | None = None
_reason = "not loaded yet"
_step = StepMemo()

ACTIVATIONS_ENV_VAR = "MLX_INFER_CPU_ACTIVATIONS"
# int16: int16 x for the 4-bit weights too (8-bit ones always); -avx512: the 512-bit kernel without AMX
# tiles even where they would be used; -256: the integer kernel in 256-bit vectors (VNNI where the CPU
# has it) even where AVX-512 VNNI would be chosen; -avx2: without VNNI. All give the same bits.
ACTIVATIONS = (
    "int8", "int8-avx512", "int8-256", "int8-avx2",
    "int16", "int16-avx512", "int16-256", "int16-avx2",
    "float32",
)
DEFAULT_ACTIVATIONS = "int16"
# Pools the kernels read and write (src/kv_format.h): int8 ones hold each head's row and its scale.
# The dtypes of scales and biases the affine kernels read as they are (policy.py keeps float16 ones).
SCALE_DTYPES = (mx.float32, mx.float16)
KV_POOL_DTYPES = (mx.float32, mx.float16, mx.bfloat16, mx.int8)


def available() -> bool:
    """Whether the kernels are built and loadable in this process (builds them on the first call)."""
    global _native, _reason
    if _native is None and _reason == "not loaded yet":
        try:
            _native = load()
            _reason = ""
        except Unavailable as e:
            _reason = str(e)
            log.warning("native CPU kernels unavailable (%s); using MLX ops", _reason)
        else:
            _apply_activations_env()
    return _native is not None


def _apply_activations_env() -> None:
    requested = os.environ.get(ACTIVATIONS_ENV_VAR, "").strip().lower() or DEFAULT_ACTIVATIONS
    if requested not in ACTIVATIONS:
        known = "|".join(ACTIVATIONS)
        log.warning("%s=%s is not one of %s; using %s",
                    ACTIVATIONS_ENV_VAR, requested, known, DEFAULT_ACTIVATIONS)
        requested = DEFAULT_ACTIVATIONS
    set_activations(requested)


def set_activations(kind: str) -> None:
    """The activations the quantized products multiply with: one of :data:`ACTIVATIONS`; takes effect
    for products evaluated from then on."""
    if kind not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {'|'.join(ACTIVATIONS)}, not {kind!r}")
    if available():
        _native.set_activations(kind)


def activations() -> str:
    """The activations in use: ``"int16"`` (the default), ``"int8-amx"`` (512-bit vectors and AMX tiles),
    ``"int8-avx512"``, ``"int8-vnni"``, ``"int8-avx2"`` or ``"float32"`` (also where the kernels are
    unavailable)."""
    return _native.activations() if available() else "float32"


def unavailable_reason() -> str:
    available()
    return _reason


def applies() -> bool:
    """Kernels for this step: built here, and the graph runs on the CPU (not, say, MLX's CUDA backend)."""
    return mx.default_device() == mx.cpu and available()


def supports_quantized(scales: mx.array, group_size: int, bits: int) -> bool:
    """Whether :func:`quantized_matmul` computes an affine layer of these settings (float32 or float16
    scales, which the weight policy gives the layers it keeps quantized for these kernels)."""
    return bits in (4, 8) and group_size % 8 == 0 and scales.dtype in SCALE_DTYPES and applies()


def pack_on_huge_pages(arrays: list[mx.array]) -> tuple[mx.array, list[int]]:
    """``arrays`` copied into one new uint8 buffer advised for transparent huge pages before its first
    touch (Linux), each at a multiple of 64 bytes: the buffer and each array's byte offset in it."""
    return _native.pack_on_huge_pages(arrays)


def huge_page_bytes(a: mx.array) -> int:
    """The bytes of ``a``'s memory mapping(s) on huge pages (``AnonHugePages``; 0 off Linux)."""
    return _native.huge_page_bytes(a)


def quantized_matmul(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> mx.array:
    """``x @ dequantize(w).T`` in float32 for MLX affine 4/8-bit ``w`` with float32 or float16
    ``scales``/``biases`` (both the same dtype; float16 ones are widened exactly as they are read).

    With int8 activations one integer kernel computes any number of rows, each row the same way; with
    float32 activations the fused matvec computes a few rows, tiles dequantized into the BLAS more.
    """
    return _native.affine_qmv(x.astype(mx.float32), w, scales, biases, group_size, bits)


def embed_rows(
    ids: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> mx.array | None:
    """Rows ``ids`` of an affine 4/8-bit table, dequantized to float32 exactly as ``mx.dequantize`` of the
    gathered rows with widened scales, as one op; None where the kernel does not apply."""
    if not supports_quantized(scales, group_size, bits):
        return None
    return _native.embed_rows(ids, w, scales, biases, group_size, bits)


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
) -> mx.array:
    """Same contract as ``metal_kernels.reference.paged_attention``, for float32 queries over pools of
    any :data:`KV_POOL_DTYPES` (:func:`supports_attention`, and a ``value_dim`` multiple of 8), read
    where they lie."""
    return _native.paged_attention(
        queries,
        key_pool,
        value_pool,
        meta.block_tables,
        meta.context_lens,
        meta.positions,
        token_seq(meta),
        meta.block_size,
        scale,
        sliding_window or 0,
        logit_softcap or 0.0,
        sinks,
        value_dim or 0,
    )


def argmax(x: mx.array) -> mx.array:
    """``mx.argmax(x, axis=-1)`` of a step's logits [rows, V]: the native kernel for float32 ones where it
    applies (the same indices: first of equal maxima, first NaN), MLX's op otherwise."""
    if x.dtype == mx.float32 and x.ndim == 2 and x.shape[1] > 0 and applies():
        return _native.argmax_rows(x)
    return mx.argmax(x, axis=-1)


def logprobs(logits: mx.array, tokens: mx.array, k: int) -> tuple[mx.array, mx.array, mx.array] | None:
    """The chosen tokens' log-probabilities [R] and the top ``k`` ids [R, k] (int32) and log-probabilities
    [R, k] (descending; equal ones by the lower id) of float32 ``logits`` [R, V], in one op; None where
    the kernel does not apply (MLX ops then)."""
    rows_of_logits = logits.dtype == mx.float32 and logits.ndim == 2 and logits.shape[1] > 0
    if not rows_of_logits or not 0 <= k <= logits.shape[1] or not applies():
        return None
    chosen, top_ids, top_logprobs = _native.logprobs(logits, tokens, k)
    return chosen, top_ids, top_logprobs


def draw(logits: mx.array, temperatures: list[float], uniforms: mx.array) -> mx.array | None:
    """A token of each row of float32 ``logits`` [R, V] from softmax(logits / t) at its temperature (0: the
    argmax), the inverse of its CDF at its uniform in [0, 1) ([R]); None where the kernel does not
    apply (MLX ops then)."""
    if logits.dtype != mx.float32 or logits.ndim != 2 or logits.shape[1] == 0 or not applies():
        return None
    return _native.draw_rows(logits, mx.array(temperatures, dtype=mx.float32), uniforms)


def truncate_top(
    logits: mx.array, top_k: list[int], top_p: list[float], min_p: list[float]
) -> mx.array | None:
    """Top-k, then top-p, then min-p of each row of float32 ``logits`` [R, V] (0 / 1.0 / 0.0: off), the cut
    ones -inf, in one op; None where the kernel does not apply (MLX ops then)."""
    if logits.dtype != mx.float32 or logits.ndim != 2 or logits.shape[1] == 0 or not applies():
        return None
    return _native.truncate_top(
        logits,
        mx.array(top_k, dtype=mx.int32),
        mx.array(top_p, dtype=mx.float32),
        mx.array(min_p, dtype=mx.float32),
    )


def adjust_logits(
    logits: mx.array,
    starts: np.ndarray,
    ids: np.ndarray,
    entries: np.ndarray,
    params: np.ndarray,
    pending: mx.array,
) -> mx.array | None:
    """Float32 ``logits`` [R, V] with penalties and biases applied at the tokens each row lists, in one op
    (``src/sampling_ops.h``: row r's distinct ids ``ids[starts[r]:starts[r + 1]]``, ``entries`` [N, 3]
    their output count, seen flag and bias, ``params`` [R, 3] the row's repetition, frequency and
    presence penalties, ``pending`` [R] one more output token not yet read, -1: none); None where the
    kernel does not apply (MLX ops then)."""
    if logits.dtype != mx.float32 or logits.ndim != 2 or not applies():
        return None
    arrays = (mx.array(starts), mx.array(ids), mx.array(entries), mx.array(params))
    return _native.adjust_logits(logits, *arrays, pending)


def rms_norm(x: mx.array, weight: mx.array, eps: float, offset: bool = False) -> mx.array | None:
    """RMSNorm of float32 ``x`` as one op (``offset``: Gemma's ``1 + weight``); None where the kernel
    does not apply (other dtypes, kernels unavailable): the caller computes it with MLX ops."""
    if x.dtype != mx.float32 or weight.dtype != mx.float32 or not applies():
        return None
    return _native.rms_norm(x, weight, eps, offset)


def rope(x: mx.array, cos: mx.array, sin: mx.array, dims: int) -> mx.array | None:
    """Half-split RoPE of float32 ``x`` [T, H, D] with the step's ``[T, 1, dims/2]`` tables as one op;
    None where the kernel does not apply."""
    if x.dtype != mx.float32 or x.ndim != 3 or not applies():
        return None
    return _native.rope(x, cos, sin, dims)


def gated_delta(
    pool: mx.array,
    slots: mx.array,
    q: mx.array,
    k: mx.array,
    v: mx.array,
    decay: mx.array,
    beta: mx.array,
    lengths: mx.array | None = None,
) -> tuple[mx.array, mx.array] | None:
    """The gated delta rule over ``B`` sequences of up to ``L`` tokens (``q``/``k`` ``[B, L, H, Dk]``,
    ``v`` ``[B, L, H, Dv]``, ``decay``/``beta`` ``[B, L, H]``, ``lengths`` ``[B]`` or None: all ``L``), in
    place in the state pool (``[S, 1, H * (Dk + 1) * Dv]``: per head a state matrix, then a row for its
    last output; see ``src/gated_delta.h``), as one op; returns (the updated pool, the outputs
    ``[B, L, H, Dv]``), or None where the kernel does not apply (the caller computes it with MLX ops,
    ``models/gated_delta.py``)."""
    if pool.dtype != mx.float32 or not applies():
        return None
    pool, out = _native.gated_delta(pool, slots, q, k, v, decay, beta, lengths)
    return pool, out


def kv_write(
    pool: mx.array, rows: mx.array, slots: mx.array, column: int = 0, in_place: bool = False
) -> mx.array | None:
    """``pool`` with ``rows`` written at ``slots`` as one op (in place when the pool is donated, or always
    with ``in_place``: the engine's pools, whose arrays are handles on its KV memory); None where the
    kernel does not apply. ``rows`` is ``[T, n_kv, D]``, or ``[T, W]`` whose row ``t`` holds the
    ``n_kv * D`` values from ``column`` on. Rows of the pool's own float dtype are copied, float32 ones
    rounded or quantized (int8 pools, see ``models/base.py: LayerKV``) by the write itself."""
    if pool.dtype not in KV_POOL_DTYPES or not applies():
        return None
    if rows.dtype != pool.dtype or pool.dtype == mx.int8:
        rows = rows.astype(mx.float32)
    return _native.kv_write(pool, rows, slots, column, in_place)


Affine = tuple[dict[str, mx.array], int, int]  # an affine layer: parameters, group_size, bits
Norm = tuple[mx.array, float]  # an RMSNorm: weight, eps


class BlockOps:
    """One Llama-style decoder block as the native ``NativeLayer``, its weights bound once (in C++, so
    that a step's op takes only the step's arrays): RMSNorm, fused q/k/v product (+ bias), Qwen3's
    per-head q/k norms when given, RoPE on q and k, the K/V rows written into the pools, attention,
    o_proj, residual, RMSNorm, fused gate/up, SiLU gate, down_proj, residual.
    """

    def __init__(
        self,
        heads: tuple[int, int, int],
        input_norm: Norm,
        qkv: Affine,
        qk_norms: tuple[mx.array, mx.array, float] | None,
        scale: float,
        window: int | None,
        o_proj: Affine,
        post_norm: Norm,
        gate_up: Affine,
        down_proj: Affine,
    ):
        n_heads, n_kv_heads, head_dim = heads
        names = ("weight", "scales", "biases")
        params, group, bits = qkv
        layers = (o_proj, gate_up, down_proj)
        o, gu, down = ([layer[0][n] for n in names] for layer in layers)
        self._layer = _native.NativeLayer(
            *input_norm, [params[n] for n in names], group, bits, params.get("bias"),
            n_heads, n_kv_heads, head_dim, head_dim, *(qk_norms or (None, None, 0.0)), scale, window or 0,
            o, *post_norm, gu, down, [q for layer in layers for q in layer[1:]],
        )

    def __call__(
        self, x: mx.array, keys: mx.array, values: mx.array, meta: BatchMetadata, cos: mx.array, sin: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        """The block's output and the pools with this step's K/V written in place (the same buffers: the
        arrays passed in read the new rows too)."""
        out, keys, values = self._layer(
            x, keys, values, cos, sin, meta.slot_mapping, meta.block_tables, meta.context_lens,
            meta.positions, token_seq(meta), meta.block_size,
        )
        return out, keys, values


def run_blocks(
    blocks: list[BlockOps], x: mx.array, keys: list[mx.array], values: list[mx.array], meta: BatchMetadata,
    cos: mx.array, sin: mx.array,
) -> list[mx.array]:
    """``blocks`` one after another from ``x``, block i on pools ``keys[i]``/``values[i]``, as one op (the
    host's cost of building, scheduling and dispatching a step's blocks paid once):
    ``[out, keys 0, values 0, keys 1, ...]``."""
    return _native.run_layers(
        [b._layer for b in blocks], x, keys, values, cos, sin, meta.slot_mapping, meta.block_tables,
        meta.context_lens, meta.positions, token_seq(meta), meta.block_size,
    )


def supports_attention(queries: mx.array, key_pool: mx.array) -> bool:
    """float32 queries over any KV pool dtype (the kernel converts rows as it reads them)."""
    return (
        queries.dtype == mx.float32
        and key_pool.dtype in KV_POOL_DTYPES
        and queries.shape[-1] % 8 == 0
        and applies()
    )


def token_seq(meta: BatchMetadata) -> mx.array:
    """The sequence each of the step's tokens belongs to (built once per step, on the host)."""
    def build() -> mx.array:
        return mx.array(np.repeat(np.arange(meta.batch_size, dtype=np.int32), meta.query_lens))

    return _step.get(meta, "token_seq", build)
