"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the causal convolution and the gated delta rule, in pure MLX.

A linear-attention layer keeps, per sequence, the last ``K - 1`` inputs of its depthwise convolution
(``[K - 1, conv_dim]``) and a state matrix per value head (``[Hv, Dk, Dv]``) instead of K/V. A step
carries a flattened ragged batch (``[T]`` rows of ``B`` sequences): :class:`Ragged` lays it out as
``[B, Qmax]`` (padding after each sequence's rows), the convolution and the recurrence run per
sequence from the state read out of its slot, and padded rows leave the state untouched (decay 1,
``beta`` 0).

The recurrence comes in the two forms transformers has (``torch_chunk_gated_delta_rule`` for
prefill, ``torch_recurrent_gated_delta_rule`` for decode), step for step the same arithmetic, so either
equals transformers' float32 forward to rounding.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn

from mlx_infer import cpu_kernels
from mlx_infer.interface.batch import BatchMetadata
from mlx_infer.interface.state import LayerState
from mlx_infer.interface.step_memo import StepMemo

CHUNK = 64  # transformers' chunk_gated_delta_rule default (and FLA's)

_layouts = StepMemo()


class Ragged:
    """The step's rows as ``[B, Qmax]``: built once per step, shared by every linear-attention layer."""

    def __init__(self, meta: BatchMetadata):
        self.batch = meta.batch_size
        self.q_max = meta.max_query_len
        self.pad_index = meta.q_pad_index
        self.unpad_index = meta.q_unpad_index
        q_lens = mx.array(meta.query_lens, dtype=mx.int32)
        self.query_lens = q_lens
        # [B, Qmax] 1 for real rows, 0 for padding
        self.valid = (mx.arange(self.q_max, dtype=mx.int32)[None, :] < q_lens[:, None]).astype(mx.float32)

    @staticmethod
    def of(meta: BatchMetadata) -> Ragged:
        return _layouts.get(meta, "ragged", lambda: Ragged(meta))

    def pad(self, x: mx.array) -> mx.array:
        """``[T, ...]`` -> ``[B, Qmax, ...]`` (padding rows repeat a real row; callers mask them)."""
        if self.pad_index is None:
            return x[:, None]
        return x[self.pad_index]

    def unpad(self, x: mx.array) -> mx.array:
        """``[B, Qmax, ...]`` -> ``[T, ...]``."""
        if self.unpad_index is None:
            return x[:, 0]
        return x.reshape(self.batch * self.q_max, *x.shape[2:])[self.unpad_index]


def causal_conv1d(
    x: mx.array, window: mx.array, weight: mx.array, layout: Ragged
) -> tuple[mx.array, mx.array]:
    """Depthwise causal convolution of ``x`` ``[B, Q, C]`` continuing from ``window`` ``[B, K-1, C]``
    (each sequence's previous inputs), with ``weight`` ``[C, K]``; no activation.

    Returns the output ``[B, Q, C]`` and each sequence's new window: its last ``K - 1`` inputs, which
    end at its own length, not at the padded ``Q``.
    """
    k = weight.shape[-1]
    ext = mx.concatenate([window.astype(x.dtype), x], axis=1)  # [B, K-1+Q, C]
    q = x.shape[1]
    out = ext[:, 0:q] * weight[:, 0]
    for j in range(1, k):
        out = out + ext[:, j : j + q] * weight[:, j]
    if layout.pad_index is None:  # every sequence has exactly Q new rows
        new_window = ext[:, q:]
    else:
        idx = layout.query_lens[:, None] + mx.arange(k - 1, dtype=mx.int32)[None, :]  # [B, K-1]
        new_window = mx.take_along_axis(ext, idx[:, :, None], axis=1)
    return out, new_window


def l2norm(x: mx.array, eps: float = 1e-6) -> mx.array:
    """As transformers (and FLA): ``x / sqrt(sum(x^2) + eps)``."""
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def prepare_qk(q: mx.array, k: mx.array, num_v_heads: int) -> tuple[mx.array, mx.array]:
    """L2-normalised float32 ``q`` (also scaled by ``Dk ** -0.5``) and ``k``, each key head repeated for
    the value heads it serves (head ``h`` of ``v`` reads key head ``h // (Hv / Hk)``)."""
    ratio = num_v_heads // k.shape[-2]
    q, k = l2norm(q.astype(mx.float32)), l2norm(k.astype(mx.float32))
    if ratio > 1:
        q, k = mx.repeat(q, ratio, axis=-2), mx.repeat(k, ratio, axis=-2)
    return q * (q.shape[-1] ** -0.5), k


def recurrent_gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    keep: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """One token per sequence: ``q``/``k`` ``[B, H, Dk]`` (prepared), ``v`` ``[B, H, Dv]``, ``g``/``beta``
    ``[B, H]``, ``state`` ``[B, H, Dk, Dv]`` -> (``[B, H, Dv]``, new state). ``keep`` ``[B]`` (0 or 1)
    scales the incoming state: 0 starts a sequence from zeros.

    The delta rule: decay the state, read what it predicts for ``k``, write back ``beta`` times the
    error, then read it with ``q``.
    """
    decay = mx.exp(g) if keep is None else mx.exp(g) * keep[:, None]
    state = state * decay[..., None, None]
    predicted = (k[..., None, :] @ state)[..., 0, :]
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return (q[..., None, :] @ state)[..., 0, :], state


def chunk_gated_delta(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array, chunk: int = CHUNK
) -> tuple[mx.array, mx.array]:
    """Whole sequences at once: ``q``/``k`` ``[B, L, H, Dk]`` (prepared), ``v`` ``[B, L, H, Dv]``,
    ``g``/``beta`` ``[B, L, H]`` (float32), ``state`` ``[B, H, Dk, Dv]`` -> (``[B, L, H, Dv]``, state).

    transformers' ``torch_chunk_gated_delta_rule``: within each chunk of ``chunk`` tokens the updates
    are condensed into matrix products (the UT transform, one triangular solve), then one sequential
    pass over the chunks carries the state.
    """
    b, length, h, dk = k.shape
    dv = v.shape[-1]
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # [B, H, L, D]
    g, beta = g.transpose(0, 2, 1), beta.transpose(0, 2, 1)  # [B, H, L]
    pad = -length % chunk
    if pad:
        q, k, v = (mx.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)]) for x in (q, k, v))
        g, beta = (mx.pad(x, [(0, 0), (0, 0), (0, pad)]) for x in (g, beta))
    n = (length + pad) // chunk
    v_beta = v * beta[..., None]
    k_beta = k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = mx.cumsum(g.reshape(b, h, n, chunk), axis=-1)  # log of the decay since the chunk's start

    upper = mx.triu(mx.ones((chunk, chunk), dtype=mx.bool_), k=1)
    pairwise = mx.exp(mx.where(upper, -mx.inf, cum[..., :, None] - cum[..., None, :]))
    k_t = k.swapaxes(-1, -2)
    ut = (k_beta @ k_t) * pairwise
    intra = (q @ k_t) * pairwise
    decayed_k_beta = k_beta * mx.exp(cum)[..., None]
    # transformers solves with unitriangular=True: the strictly lower part over an identity diagonal.
    lower = mx.tril(ut, k=-1) + mx.eye(chunk, dtype=ut.dtype)
    # The triangular solve has only a CPU kernel; on a GPU stream MLX would refuse it.
    solved = mx.linalg.solve_triangular(
        lower, mx.concatenate([v_beta, decayed_k_beta], axis=-1), upper=False, stream=mx.cpu
    )
    new_values, k_cumdecay = solved[..., :dv], solved[..., dv:]

    q = q * mx.exp(cum)[..., None]
    k = k * mx.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = mx.exp(cum[..., -1])[..., None, None]  # [B, H, N, 1, 1]
    outs = []
    for i in range(n):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outs.append(q[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k[:, :, i].swapaxes(-1, -2) @ v_new
    out = mx.concatenate(outs, axis=2)[:, :, :length]  # [B, H, L, Dv]
    return out.transpose(0, 2, 1, 3), state


def decode_step(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: LayerState,
    index: int,
    slots: mx.array,
    keep: mx.array,
) -> mx.array:
    """One token per sequence, each state read from and written back to its slot of ``state``'s array
    ``index`` (``[S, 1, H * (Dk + 1) * Dv]``: per head the ``[Dk, Dv]`` matrix, then a row that receives
    the head's last output); returns the outputs ``[B, H, Dv]``.

    The recurrence kernel (:func:`_kernel`) with one token per sequence where there is one;
    :func:`recurrent_gated_delta` otherwise (the reference).
    """
    h, dk = k.shape[1:]
    dv = v.shape[-1]
    decay = mx.exp(g) * keep[:, None]
    one = (x[:, None] for x in (q, k, v, decay, beta))
    out = _kernel(*one, state, index, slots, None)
    if out is not None:
        return out[:, 0]
    out, new = recurrent_gated_delta(q, k, v, g, beta, _slot_matrices(state, index, slots, h, dk, dv), keep)
    state.put(index, slots, mx.concatenate([new, out[:, :, None]], axis=2))
    return out


def sequences_step(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: LayerState,
    index: int,
    slots: mx.array,
    keep: mx.array,
    layout: Ragged,
) -> mx.array:
    """Sequences of any length in the padded layout (``q``/``k`` ``[B, Qmax, H, Dk]`` prepared, ``v``
    ``[B, Qmax, H, Dv]``, ``g``/``beta`` ``[B, Qmax, H]``), each continuing from its slot as
    :func:`decode_step` does; returns the outputs ``[B, Qmax, H, Dv]`` (padding rows: don't care).

    The recurrence kernel (:func:`_kernel`), token after token, where there is one: on the CPU the native
    kernel is faster than the chunked form at every chunk length measured, 16 to 512 tokens
    (``benchmarks/bench_gated_delta.py``); :func:`chunk_gated_delta` otherwise (the reference).
    """
    b, q_max, h, dk = k.shape
    dv = v.shape[-1]
    # keep scales the state each sequence starts from: fold it into its first token's decay.
    first = (mx.arange(q_max) == 0)[None, :, None]
    decay = mx.exp(g) * mx.where(first, keep[:, None, None], 1.0)
    out = _kernel(q, k, v, decay, beta, state, index, slots, layout.query_lens)
    if out is not None:
        return out
    # Padding rows must leave the state as it is: no decay (g = 0) and no write (beta = 0).
    valid = layout.valid[..., None]
    initial = _slot_matrices(state, index, slots, h, dk, dv) * keep[:, None, None, None]
    out, recurrent = chunk_gated_delta(q, k, v, g * valid, beta * valid, initial)
    # The slot's row after each head's matrix is the kernels' output row: nothing to keep there.
    scratch = mx.zeros((b, h, 1, dv), dtype=recurrent.dtype)
    state.put(index, slots, mx.concatenate([recurrent, scratch], axis=2))
    return out


def _slot_matrices(state: LayerState, index: int, slots: mx.array, h: int, dk: int, dv: int) -> mx.array:
    """``[B, H, Dk, Dv]``: each sequence's state matrices as its slot holds them (the reference paths)."""
    return state.arrays[index][slots].reshape(-1, h, dk + 1, dv)[:, :, :dk]


def _kernel(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    decay: mx.array,
    beta: mx.array,
    state: LayerState,
    index: int,
    slots: mx.array,
    lengths: mx.array | None,
) -> mx.array | None:
    """The recurrence over ``[B, L]`` tokens by a kernel, the states updated in their slots: the Metal
    kernel (``metal_kernels/dispatch.py``), or off Metal the native CPU kernel, which updates the slots in
    place. Returns the outputs ``[B, L, H, Dv]``, or None where neither applies."""
    from mlx_infer.metal_kernels import dispatch

    if dispatch.USE_KERNELS:
        rows, out = dispatch.gated_delta(state.arrays[index], slots, q, k, v, decay, beta, lengths)
        state.put(index, slots, rows)
        return out
    pool = state.detach(index)  # unreferenced, so the kernel may update it in place
    native = cpu_kernels.gated_delta(pool, slots, q, k, v, decay, beta, lengths)
    if native is None:
        state.attach(index, pool)
        return None
    state.attach(index, native[0])
    return native[1]


@functools.cache
def decode_prelude(key_heads: int, key_dim: int, value_heads: int, value_dim: int):
    """One compiled function for a decode step's inputs to the recurrence (one token per sequence), so
    the convolution, its activation, the q/k normalisation and the gates are a few fused kernels rather
    than the hundred small ops they are as a graph (the fixed cost per op is what a decode step pays).

    ``(qkv [B, C], window [B, K-1, C], weight [K, C], a, b [B, Hv], A_log, dt_bias [Hv], keep [B])`` ->
    ``(q, k [B, Hv, Dk] prepared, v [B, Hv, Dv], g, beta [B, Hv], new window)``, the same arithmetic as
    :func:`causal_conv1d`, :func:`prepare_qk` and :func:`decay_and_beta`.
    """

    def prelude(qkv, window, weight, a, b, a_log, dt_bias, keep):
        ext = mx.concatenate([window * keep[:, None, None], qkv[:, None].astype(window.dtype)], axis=1)
        mixed = nn.silu((ext * weight).sum(axis=1))
        n = mixed.shape[0]
        q = mixed[:, : key_heads * key_dim].reshape(n, key_heads, key_dim)
        k = mixed[:, key_heads * key_dim : 2 * key_heads * key_dim].reshape(n, key_heads, key_dim)
        v = mixed[:, 2 * key_heads * key_dim :].reshape(n, value_heads, value_dim).astype(mx.float32)
        q, k = prepare_qk(q, k, value_heads)
        g, beta = decay_and_beta(a, b, a_log, dt_bias)
        return q, k, v, g, beta, ext[:, 1:]

    return mx.compile(prelude)


def decay_and_beta(a: mx.array, b: mx.array, a_log: mx.array, dt_bias: mx.array) -> tuple[mx.array, mx.array]:
    """Per-token log decay ``g = -exp(A_log) * softplus(a + dt_bias)`` and write strength
    ``beta = sigmoid(b)``, in float32 as transformers computes them."""
    g = -mx.exp(a_log.astype(mx.float32)) * nn.softplus(a.astype(mx.float32) + dt_bias.astype(mx.float32))
    return g, mx.sigmoid(b.astype(mx.float32))
