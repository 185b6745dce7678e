"""Llama-style decoder blocks computed by the native CPU kernels' ``NativeLayer``: one graph node a block.

After :func:`~mlx_infer.models.fused.fuse_projections`, a Llama/Mistral/Qwen2/Qwen3 block whose
projections are quantized layers of the native CPU kernels is still about twenty MLX ops (norms,
products, splits, reshapes, RoPE, KV writes, attention, adds, the gate), and on the CPU backend the
fixed cost of each op was as large as the block's work at decode. :class:`NativeBlock` runs the same
arithmetic, K/V writes included, as one op (``cpu_kernels/src/decoder_block.cpp``).

Parameters stay where they were (the block keeps its children), so saving, ``parameters()`` and
sharding see the original block; a block whose parameters were replaced after the rewrite, or a
step the kernels do not apply to (another device, float16 activations), computes op by op as before.
"""

from __future__ import annotations

import operator

import mlx.core as mx
import mlx.nn as nn

from mlx_infer import cpu_kernels
from mlx_infer.interface import watched
from mlx_infer.interface.batch import BatchMetadata
from mlx_infer.interface.kv import LayerKV
from mlx_infer.metal_kernels.layers import KernelQuantizedLinear
from mlx_infer.models import llama, qwen2
from mlx_infer.models.fused import CompiledRMSNorm, FusedMLP, FusedQuantizedLinear, silu_gate
from mlx_infer.models.rope_cpu import step_tables

_BLOCKS = (llama.TransformerBlock, qwen2.TransformerBlock)
_ATTENTIONS = (llama.Attention, qwen2.Attention)
_PARAMS = ("weight", "scales", "biases")


def native_blocks(model: nn.Module) -> int:
    """Swap every eligible block of ``model`` for a :class:`NativeBlock`; returns how many. When every
    block was swapped, the model's ``native_stack`` runs them all as one op a step."""
    layers = model.layers
    swapped = 0
    for i, block in enumerate(layers):
        if _kind_fits(block) and _eligible(block):
            layers[i] = NativeBlock(block)
            swapped += 1
    if layers and swapped == len(layers) and NativeStack.uniform(layers):
        model.native_stack = NativeStack(layers)
    return swapped


def stacked(model: nn.Module) -> bool:
    """Whether ``model``'s blocks are all of the kinds :func:`native_blocks` can stack, judged by their
    types alone (``plan``: no weights, no fusing; whether the kernels cover its layers is the caller's)."""
    return bool(model.layers) and all(map(_kind_fits, model.layers))


def _kind_fits(block: nn.Module) -> bool:
    """A Llama/Qwen2 block with half-split RoPE: the kinds the native op computes (before its layers)."""
    return type(block) in _BLOCKS and not getattr(block.get("self_attn"), "rope_traditional", False)


def _eligible(block: nn.Module) -> bool:
    attn, mlp = block.get("self_attn"), block.get("mlp")
    if type(attn) not in _ATTENTIONS or type(mlp) is not FusedMLP or mlp._gate_fn is not silu_gate:
        return False
    qkv = [attn.get(n) for n in ("q_proj", "k_proj", "v_proj")]
    gate_up = [mlp.get(n) for n in ("gate_proj", "up_proj")]
    singles = [attn.get("o_proj"), mlp.get("down_proj")]
    if not all(type(m) is FusedQuantizedLinear for m in qkv + gate_up):
        return False
    if not all(type(m) is KernelQuantizedLinear and "bias" not in m for m in singles):
        return False
    if "bias" in gate_up[0]:
        return False
    if qkv[0]._fused is not qkv[2]._fused or gate_up[0]._fused is not gate_up[1]._fused:
        return False
    norms = [block.get("input_layernorm"), block.get("post_attention_layernorm")]
    if _has_qk_norm(attn):
        norms += [attn.q_norm, attn.k_norm]
    if not all(type(n) is CompiledRMSNorm for n in norms):
        return False
    fused = [qkv[0]._fused, gate_up[0]._fused]
    layers = [(f.params["scales"], f) for f in fused] + [(m["scales"], m) for m in singles]
    return all(cpu_kernels.supports_quantized(scales, m.group_size, m.bits) for scales, m in layers)


class NativeBlock(nn.Module):
    """A block (``self_attn``, ``mlp``, two norms) computed by the native block ops; see the module
    docstring. Falls back to the wrapped block's own ``__call__`` where the ops do not apply."""

    def __init__(self, block: nn.Module):
        super().__init__()
        for name, child in block.children().items():  # in the original order: parameters() order
            setattr(self, name, child)
        self._op_by_op = type(block).__call__
        attn, mlp = block.self_attn, block.mlp
        qkv, gate_up, o, down = attn.q_proj._fused, mlp.gate_proj._fused, attn.o_proj, mlp.down_proj
        norm, post = block.input_layernorm, block.post_attention_layernorm
        qk_norms = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if _has_qk_norm(attn) else None
        self._ops = cpu_kernels.BlockOps(
            (attn.n_heads, attn.n_kv_heads, attn.head_dim),
            (norm.weight, norm.eps),
            (qkv.params, qkv.group_size, qkv.bits),
            qk_norms,
            attn.scale,
            attn.sliding_window,
            ({n: o[n] for n in _PARAMS}, o.group_size, o.bits),
            (post.weight, post.eps),
            (gate_up.params, gate_up.group_size, gate_up.bits),
            ({n: down[n] for n in _PARAMS}, down.group_size, down.bits),
        )
        self._rope = (attn.head_dim, attn.rope_base, attn.rope_scale, attn._freqs, mx.float32)
        self._use_rope = getattr(attn, "use_rope", True)
        self._rope_factor = getattr(attn, "rope_factor", 1.0)
        bound = self._parameters()
        # _unreplaced relies on it: a parameter set on any other module would not move the generation.
        assert all(isinstance(m, watched.Watched) for m, _, _ in bound), "a bound layer is not Watched"
        self._watched = ([m for m, _, _ in bound], [n for _, n, _ in bound], [a for _, _, a in bound])
        self._generation = watched.generation()

    def _parameters(self) -> list[tuple[nn.Module, str, mx.array]]:
        """Every parameter the native ops read (through the fused copies), where the block holds it."""
        attn, mlp = self.self_attn, self.mlp
        modules = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                   mlp.down_proj, self.input_layernorm, self.post_attention_layernorm]
        if _has_qk_norm(attn):
            modules += [attn.q_norm, attn.k_norm]
        return [(m, name, a) for m in modules for name, a in m.items() if isinstance(a, mx.array)]

    def _applies(self, x: mx.array, kv: LayerKV) -> bool:
        if x.dtype != mx.float32 or not cpu_kernels.applies():
            return False
        if kv.keys.dtype not in cpu_kernels.KV_POOL_DTYPES:
            return False
        # A parameter replaced since the rewrite (load_weights, update): the bound weights are stale.
        return _unreplaced(self)

    def __call__(self, x: mx.array, kv: LayerKV, meta: BatchMetadata) -> mx.array:
        if not self._applies(x, kv):
            return self._op_by_op(self, x, kv, meta)
        cos, sin = step_tables(meta.positions, *self._rope)
        if not self._use_rope:  # a NoPE layer (SmolLM3): the identity rotation
            cos, sin = mx.ones_like(cos), mx.zeros_like(sin)
        elif self._rope_factor != 1.0:  # YaRN's attention factor, on cos and sin as transformers applies it
            cos, sin = cos * self._rope_factor, sin * self._rope_factor
        # The op writes the pools in place and returns them as the arrays that depend on this step's
        # writes (what evaluating the cache's state computes).
        out, kv.keys, kv.values = self._ops(x, kv.keys, kv.values, meta.pages(kv.windowed), cos, sin)
        return out


class NativeStack:
    """A model's blocks, all :class:`NativeBlock` with the same RoPE, run as one native op a step
    (``cpu_kernels.run_blocks``): ``CausalLM.hidden`` asks it first. Where a step does not qualify
    (another device or dtype, a replaced parameter, layers paged by different tables, other layers in
    the model) it returns None and the blocks run one by one, each deciding for itself."""

    def __init__(self, blocks: list[NativeBlock]):
        self.blocks = list(blocks)
        self._rope = blocks[0]._rope
        self._ops = [b._ops for b in blocks]
        # Every block's watched parameters in three flat lists: one C loop checks them all, in the steps
        # after a watched layer's entry was set (_unreplaced).
        self._watched = tuple([item for b in blocks for item in b._watched[i]] for i in range(3))
        self._generation = watched.generation()

    @staticmethod
    def uniform(blocks: list[nn.Module]) -> bool:
        """Whether the blocks share one RoPE (tables built once a step for all of them): the same settings,
        and frequencies that are one array or equal ones (Llama 3's scaled ones are built per layer)."""
        *settings, freqs, dtype = blocks[0]._rope

        def same(rope: tuple) -> bool:
            *other, other_freqs, other_dtype = rope
            if other != settings or other_dtype != dtype or (other_freqs is None) != (freqs is None):
                return False
            return other_freqs is freqs or mx.array_equal(other_freqs, freqs).item()

        return all(b._use_rope and b._rope_factor == 1.0 and same(b._rope) for b in blocks)

    def __call__(
        self, x: mx.array, layers: list[nn.Module], cache: list[LayerKV], meta: BatchMetadata
    ) -> mx.array | None:
        blocks = self.blocks
        if len(layers) != len(blocks) or len(cache) < len(blocks):
            return None
        if not all(map(operator.is_, layers, blocks)):  # a block swapped out since
            return None
        if x.dtype != mx.float32 or not cpu_kernels.applies():
            return None
        kvs = cache[: len(blocks)]
        windowed = kvs[0].windowed
        if not all(type(kv) is LayerKV and kv.windowed == windowed for kv in kvs):
            return None
        if not all(kv.keys.dtype in cpu_kernels.KV_POOL_DTYPES for kv in kvs):
            return None
        if not _unreplaced(self):
            return None
        cos, sin = step_tables(meta.positions, *self._rope)
        results = cpu_kernels.run_blocks(
            self._ops, x, [kv.keys for kv in kvs], [kv.values for kv in kvs], meta.pages(windowed), cos, sin
        )
        for i, kv in enumerate(kvs):  # written in place; the new arrays depend on this step's writes
            kv.keys, kv.values = results[1 + 2 * i], results[2 + 2 * i]
        return results[0]


def _unreplaced(owner: NativeBlock | NativeStack) -> bool:
    """Whether the parameters ``owner`` watches (``_watched``: modules, names, the arrays bound) are still
    those arrays, checked one by one (C loops) only when the watched generation moved since ``owner``'s
    last check that passed."""
    now = watched.generation()
    if owner._generation == now:
        return True
    modules, names, arrays = owner._watched
    if not all(map(operator.is_, map(dict.get, modules, names), arrays)):
        return False
    owner._generation = now
    return True


def _has_qk_norm(attn: nn.Module) -> bool:
    return bool(getattr(attn, "qk_norm", False))
