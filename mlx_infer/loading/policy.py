"""Which form the weights take for the backend that runs them.

On the CPU backend, MLX's ``quantized_matmul`` and half-precision matmuls do not go through BLAS and
are slow (docs: /work/shared/FACTS.md). Where the native CPU kernels are available (``cpu_kernels``),
affine 4/8-bit layers stay quantized and compute through them (decode reads a quarter of the bytes of
float32, or less). Otherwise quantized layers are dequantized and half-precision weights widened to
float32 for the optimized BLAS, unless ``keep_quantized`` is True. ``keep_quantized=False``
dequantizes everywhere.
On Metal quantized layers stay quantized (fast kernels, a quarter of the memory traffic). With the
kernels in use (``metal_kernels.dispatch``), affine quantized layers are swapped for twins whose products
go through the kernel dispatch, and GGUF Q4_K/Q5_K/Q6_K matrices arrive as their raw blocks (see
:func:`kquants_stay_raw`); float weights dequantized from the other GGUF types MLX cannot hold as such
are quantized again to MLX's affine 4- or 8-bit format.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlx_infer import cpu_kernels
from mlx_infer.loading.huge_pages import move_to_huge_pages
from mlx_infer.metal_kernels import dispatch
from mlx_infer.metal_kernels.layers import (
    GGUFEmbedding,
    GGUFLinear,
    KernelQuantizedEmbedding,
    KernelQuantizedLinear,
)
from mlx_infer.models.fused import fuse_projections
from mlx_infer.models.native_block import native_blocks
from mlx_infer.models.qwen3_moe import QuantizedSwitchLinear

log = logging.getLogger(__name__)

# Group size used when re-quantizing K-quant weights: K-quants scale sub-blocks of 16 or 32 values.
REQUANT_GROUP_SIZE = 32
QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding)


def cpu_backend() -> bool:
    return mx.default_device() == mx.cpu or not mx.metal.is_available()


def prepare_for_backend(model: nn.Module) -> None:
    """The last step of loading, once the weights are evaluated (and, on a distributed rank, sharded): on
    MLX's CPU backend, the same parameters as fewer and faster ops per step (models/fused.py's fused
    projections, models/native_block.py's native block ops, whose kernels are built or loaded now rather
    than in the first step). Every process that runs the model's layers gets it from the loader, so rank 0,
    distributed followers and draft models compute with the same kernels; runners only run. On Metal the
    weight policy's kernel twins (:func:`apply_weight_policy`) are the whole preparation."""
    if not cpu_backend():
        return
    summary = fuse_projections(model)
    on_huge_pages = move_to_huge_pages(model)  # before the native blocks bind the arrays
    blocks = native_blocks(model)
    log.info(
        "CPU decode step: %s, %d blocks as native block ops, %s matvec activations, %.0f MiB of weights on "
        "huge pages", summary, blocks, cpu_kernels.activations(), on_huge_pages / 2**20,
    )


def kquants_stay_raw(keep_quantized: bool | None) -> bool:
    """Whether GGUF Q4_K/Q5_K/Q6_K matrices are loaded as their raw blocks, for the K-quant kernels:
    on Metal with the kernels in use, unless everything is to be dequantized."""
    return not cpu_backend() and keep_quantized is not False and dispatch.USE_KERNELS


def apply_weight_policy(
    model: nn.Module, keep_quantized: bool | None, requantize: dict[str, int] | None = None
) -> str:
    """Convert ``model``'s weights in place for the current backend; return a one-line description.

    ``keep_quantized``: None chooses per backend (above), True keeps quantized layers quantized
    everywhere, False dequantizes them everywhere. ``requantize`` maps module paths of float weights
    that were dequantized from K-quants to the bits to re-quantize them with on Metal.
    """
    bits = _quantized_bits(model)
    if cpu_backend():
        if bits and keep_quantized is not False and _cpu_kernels_cover(model):
            # The kernels compute in float32: widen every half-precision parameter once but the float16
            # scales and biases of the quantized layers, which the kernels widen as they read them (a
            # sixth fewer bytes a step for 4-bit layers at group 32); then swap in the dispatch twins
            # (dispatch routes them to the kernels), whose embedding lookups come out float32.
            _widen_to_float32(model, keep=_float16_group_params(model))
            _use_kernels(model, lookup_dtype=mx.float32)
            return _describe(model, f"kept {_bits_text(bits)} for the native CPU kernels")
        if keep_quantized:
            return _describe(model, f"kept {_bits_text(bits)} on the CPU backend" if bits else "")
        widened = _widen_to_float32(model)
        if bits:
            _dequantize(model, mx.float32)
            return _describe(model, f"dequantized from {_bits_text(bits)} for the CPU backend")
        return _describe(model, f"from {widened} for the CPU backend" if widened else "")
    if keep_quantized is False:
        if bits:
            _dequantize(model, None)
            return _describe(model, f"dequantized from {_bits_text(bits)}")
        return _describe(model, "")
    how = []
    if requantize:
        _requantize(model, requantize)
        target = _bits_text(set(requantize.values()))
        log.warning("GGUF K-quant weights re-quantized to MLX affine %s (lossy)", target)
        how.append(f"K-quants re-quantized to {target}")
    elif bits:
        how.append(f"quantized {_bits_text(bits)}")
    if raw := _gguf_kinds(model):
        how.append(f"GGUF {'/'.join(sorted(raw))} kept as blocks")
    if dispatch.USE_KERNELS:
        _use_kernels(model)
    return _describe(model, ", ".join(how))


def _use_kernels(model: nn.Module, lookup_dtype: mx.Dtype | None = None) -> None:
    """Swap each affine QuantizedLinear/QuantizedEmbedding for its twin computing through the kernel
    dispatch (same parameters); other modes (microscaling formats) stay MLX's. ``lookup_dtype``: the
    dtype embedding lookups return (None: their scales')."""
    swaps: list[tuple[str, nn.Module]] = []
    for path, m in model.named_modules():
        if m.__class__ is nn.QuantizedLinear and m.mode == "affine":
            swaps.append((path, KernelQuantizedLinear(m)))
        elif m.__class__ is nn.QuantizedEmbedding and m.mode == "affine":
            swaps.append((path, KernelQuantizedEmbedding(m, lookup_dtype)))
    model.update_modules(tree_unflatten(swaps))


def _float16_group_params(model: nn.Module) -> set[str]:
    """The parameter paths of the float16 scales and biases of the affine quantized layers."""
    return {
        f"{path}.{name}" for path, m in model.named_modules()
        if isinstance(m, QUANTIZED) and m.mode == "affine" and m.scales.dtype == mx.float16
        for name in ("scales", "biases")
    }


def _cpu_kernels_cover(model: nn.Module) -> bool:
    """Whether the native CPU kernels compute every quantized layer of ``model`` (affine 4/8-bit):
    a layer they do not cover would be dequantized at every step, so such models are dequantized
    once at load instead."""
    layers = [m for _, m in model.named_modules() if isinstance(m, QUANTIZED)]
    return cpu_kernels.applies() and all(
        m.mode == "affine" and m.bits in (4, 8) and m.group_size % 8 == 0 for m in layers
    )


def _gguf_kinds(model: nn.Module) -> set[str]:
    return {m.kind for _, m in model.named_modules() if isinstance(m, (GGUFLinear, GGUFEmbedding))}


def _quantized_bits(model: nn.Module) -> set[int]:
    return {m.bits for _, m in model.named_modules() if isinstance(m, QUANTIZED)}


def _bits_text(bits: set[int]) -> str:
    return "/".join(f"{b}-bit" for b in sorted(bits))


def _dequantize(model: nn.Module, dtype: mx.Dtype | None) -> None:
    """Replace every QuantizedLinear/QuantizedEmbedding by its float counterpart (exact dequantization).

    ``dtype`` None keeps the dtype of the scales. Other quantized modules (MoE experts) stay as they are.
    """
    replaced = []
    for path, m in model.named_modules():
        if not isinstance(m, QUANTIZED):
            continue
        # Scales/biases widened first so that the dequantized values are computed in float32, not in
        # the float16 GGUF scales come in. The microscaling modes' scales are uint8 exponents: kept.
        floating = mx.issubdtype(m.scales.dtype, mx.floating)
        out_dtype = dtype or (m.scales.dtype if floating else mx.float16)
        biases = m.get("biases")
        w = mx.dequantize(
            m.weight,
            m.scales.astype(mx.float32) if floating else m.scales,
            None if biases is None else biases.astype(mx.float32),
            group_size=m.group_size,
            bits=m.bits,
            mode=m.mode,
        ).astype(out_dtype)
        if isinstance(m, nn.QuantizedEmbedding):
            new: nn.Module = nn.Embedding(*w.shape)
        else:
            new = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            if "bias" in m:
                new.bias = m.bias.astype(out_dtype)
        new.weight = w
        replaced.append((path, new))
    model.update_modules(tree_unflatten(replaced))


def _widen_to_float32(model: nn.Module, keep: set[str] | None = None) -> str:
    """Cast float16/bfloat16 parameters to float32, but for the model's ``row_tables`` (only gathered, see
    ``models/base.py``) and the paths in ``keep``; return the names of the dtypes widened."""
    half = {mx.float16, mx.bfloat16}
    keep = set(getattr(model, "row_tables", ())) | (keep or set())
    narrow = [(k, p) for k, p in tree_flatten(model.parameters()) if p.dtype in half and k not in keep]
    found = sorted({str(p.dtype).split(".")[-1] for _, p in narrow})
    if narrow:
        model.update(tree_unflatten([(k, p.astype(mx.float32)) for k, p in narrow]), strict=False)
    return "/".join(found)


def _requantize(model: nn.Module, requantize: dict[str, int]) -> None:
    def predicate(path: str, module: nn.Module) -> bool | dict:
        if path not in requantize or not hasattr(module, "to_quantized"):
            return False
        module.weight = module.weight.astype(mx.bfloat16)  # scales take the weight's dtype
        return {"group_size": REQUANT_GROUP_SIZE, "bits": requantize[path], "mode": "affine"}

    nn.quantize(model, class_predicate=predicate)


def _describe(model: nn.Module, how: str) -> str:
    params = tree_flatten(model.parameters())
    nbytes = sum(p.nbytes for _, p in params)
    packed = (mx.uint32, mx.uint8)  # MLX affine words, GGUF blocks
    kinds = sorted({str(p.dtype).split(".")[-1] for _, p in params if p.dtype not in packed})
    # Quantized MoE experts stay as they are on every backend (gather_qmm computes them).
    experts = sorted({m.mode for _, m in model.named_modules() if isinstance(m, QuantizedSwitchLinear)})
    if experts:
        how = ", ".join(filter(None, [how, f"{'/'.join(experts)} MoE experts kept"]))
    quantized = bool(_quantized_bits(model) or _gguf_kinds(model) or experts)
    what = ("quantized + " if quantized else "") + "/".join(kinds)
    return f"weights: {what}{f' ({how})' if how else ''}, {nbytes / 1e6:.0f} MB"
