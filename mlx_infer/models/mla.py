"""Multi-head latent attention (MLA, DeepSeek V2/V3, Kimi K2): the latent cache and its attention.

An MLA layer keeps, per token, one row ``[c_kv, k_pe]``: the compressed latent (``kv_lora_rank``
values, after ``kv_a_layernorm``) and the shared rope key (``qk_rope_head_dim``). Per-head keys and
values are never materialised. Attention runs in the absorbed form (as mlx-lm's deepseek_v3 decode
and vLLM's MLA do): each head's ``q_nope`` goes through the key half of ``kv_b_proj``
(:class:`MultiLinear` ``embed_q``) into latent space and, concatenated with its ``q_pe``, attends over
the rows as keys of one "KV head"; the values are the first ``kv_lora_rank`` columns of the same rows,
and the output goes back through the value half (``unembed_out``). So the pool holds one row of
``kv_lora_rank + qk_rope_head_dim`` per token and layer (576 values for DeepSeek V3) instead of
``2 * heads * head_dim`` (128 heads: 40960).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from mlx_infer.interface.batch import BatchMetadata
from mlx_infer.interface.kv import LatentKV


def latent_attention(
    queries: mx.array, latent: mx.array, kv: LatentKV, meta: BatchMetadata, scale: float, value_dim: int
) -> mx.array:
    """Write ``latent`` ([T, 1, row]) into ``kv`` and attend the absorbed ``queries`` ([T, H, row]) over
    the rows as keys and their first ``value_dim`` columns as values. Returns ``[T, H, value_dim]``."""
    from mlx_infer.metal_kernels.dispatch import paged_attention

    kv.write(latent, None, meta.slot_mapping)
    # The key pool is the value pool too: every attention path reads the value prefix where it lies.
    return paged_attention(queries, kv.keys, kv.keys, meta, scale, value_dim=value_dim)


class MultiLinear(nn.Module):
    """One bias-free linear map per head: ``weight`` ``[heads, out, in]``, input ``[heads, T, in]``.

    mlx-lm's layout and names for the halves of ``kv_b_proj`` (``embed_q``, ``unembed_out``), so its
    converted MLA checkpoints load as they are.
    """

    def __init__(self, input_dims: int, output_dims: int, num_heads: int):
        super().__init__()
        scale = math.sqrt(1.0 / input_dims)
        self.weight = mx.random.uniform(-scale, scale, (num_heads, output_dims, input_dims))

    def __call__(self, x: mx.array) -> mx.array:
        return x @ self.weight.swapaxes(-1, -2)

    def to_quantized(
        self, group_size: int | None = None, bits: int | None = None, mode: str = "affine", **_
    ) -> QuantizedMultiLinear:
        """Called by ``nn.quantize`` so quantized checkpoints (mlx-community's) load into the same tree."""
        return QuantizedMultiLinear(self.weight, group_size, bits, mode)


class QuantizedMultiLinear(nn.Module):
    def __init__(self, weight: mx.array, group_size: int | None, bits: int | None, mode: str):
        super().__init__()
        self.weight, self.scales, *biases = mx.quantize(weight, group_size, bits, mode=mode)
        if biases:
            self.biases = biases[0]
        # Read back what mx.quantize chose when group_size/bits were left to the mode's defaults.
        in_dims = weight.shape[-1]
        self.group_size = in_dims // self.scales.shape[-1]
        self.bits = self.weight.shape[-1] * 32 // in_dims
        self.mode = mode
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        return mx.quantized_matmul(
            x,
            self["weight"],
            scales=self["scales"],
            biases=self.get("biases"),
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )
