"""The bytes of a checkpoint's weights as mlx-infer would hold them, from its metadata alone.

Nothing here reads a weight. A GGUF file gives its tensor table (``loading/gguf_file.py``); a Hugging
Face / MLX folder gives its ``config.json``, from which the architecture is built *lazily* (MLX does not
evaluate the random initial parameters, so a 70B model costs no memory and a fraction of a second) to
name every parameter the engine would hold and its shape, and the safetensors headers, when the shards
are here, give each tensor's dtype (else the config's ``torch_dtype``). Then the load path's decisions
are replayed on that table: how ``read_gguf`` reads each GGUF type, and what ``loading/policy.py`` does
for this backend (keep 4/8-bit layers quantized for the native CPU kernels, their float16 scales and
biases as they are, every other float widened to float32; dequantize to float32 where the kernels do
not cover a layer; on Metal keep quantized layers and re-quantize dequantized K-quants). ``--q-bits``
first replays what ``mlx-infer convert`` would write.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_infer.errors import InvalidCheckpoint, InvalidRequest, ModelNotFound, UnreadableWeights
from mlx_infer.loading import hf, hub, single_gguf

log = logging.getLogger(__name__)

FLOAT_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
_SAFETENSORS_FLOATS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass(frozen=True)
class Tensor:
    """One held parameter, as its bytes are counted.

    A float tensor has ``bits`` 0 and ``dtype`` its own; an affine quantized matrix (MLX's packed
    uint32 words plus one scale and one bias per group) has ``bits``, ``group_size`` and ``dtype`` its
    scales'; an ``mxfp4`` one (gpt-oss's experts) one uint8 exponent per group and no biases; a GGUF
    matrix kept as raw blocks has ``gguf_bytes``. ``expert``: a stacked MoE expert matrix, which the
    weight policy leaves quantized on every backend (gather_qmm computes it).
    """

    name: str
    shape: tuple[int, ...]  # logical elements; (out, in) for a matrix
    dtype: str
    bits: int = 0
    group_size: int = 0
    gguf_bytes: int = 0
    matrix: bool = False  # a Linear/Embedding weight: what quantization applies to
    requantize: int = 0  # Metal: bits it is re-quantized to (dequantized from a GGUF type, policy.py)
    read_fraction: float = 1.0  # share of its bytes one decode step reads (embedding table, experts)
    mode: str = "affine"
    expert: bool = False

    @property
    def nbytes(self) -> int:
        n = math.prod(self.shape)
        if self.gguf_bytes:
            return self.gguf_bytes
        if self.bits and self.mode == "mxfp4":
            return n * self.bits // 8 + n // self.group_size
        if self.bits:
            return n * self.bits // 8 + 2 * (n // self.group_size) * FLOAT_BYTES[self.dtype]
        return n * FLOAT_BYTES[self.dtype]


@dataclass
class Metadata:
    """What a checkpoint says about itself without its weights."""

    config: dict[str, Any]  # Hugging Face style (a GGUF file's is derived from its metadata)
    model: nn.Module  # built lazily: names, shapes and kv_shape(); never evaluated
    tensors: list[Tensor]  # as read by the loader, before the backend policy


# ---- reading ---------------------------------------------------------------------------------------
def read_metadata(spec: str, backend: str, keep_quantized: bool | None) -> Metadata:
    """The metadata of ``spec`` (a GGUF file, a model folder, or a Hub repo id already in the cache or
    fetched as its JSON files only), with tensors as ``load`` would read them on ``backend``."""
    path = _resolve(spec)
    gguf_file = path if path.is_file() else single_gguf(path)
    if gguf_file is not None:
        return _gguf_metadata(gguf_file, backend, keep_quantized)
    return _folder_metadata(path)


def _resolve(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_file() and path.suffix != ".gguf":
            raise InvalidRequest(f"{spec}: not a .gguf file nor a model folder")  # a wrong path: exit 2
        return path
    if not hub.looks_like_repo_id(spec):
        raise ModelNotFound(f"{spec}: no such file or folder")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        # Only the JSON files (config, index): the plan never needs the weights. Offline, the cache.
        return Path(snapshot_download(spec, allow_patterns=["*.json"]))
    except LocalEntryNotFoundError:
        raise ModelNotFound(f"{spec}: not in the Hugging Face cache (offline or Hub unreachable)") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ModelNotFound(f"{spec}: no metadata from the Hugging Face Hub ({hf.one_line(e)})") from None


def lazy_model(config: dict[str, Any], source: str) -> nn.Module:
    """The architecture of ``config`` with unevaluated parameters (no memory is taken)."""
    from mlx_infer.errors import UnsupportedArchitecture
    from mlx_infer.models import model_module

    if "model_type" not in config:
        raise InvalidCheckpoint(f"{source}: config has no model_type")
    module = model_module(config["model_type"])
    try:
        return module.Model(module.ModelArgs.from_dict(config))
    except (TypeError, ValueError, KeyError) as e:
        raise UnsupportedArchitecture(f"{source}: config does not fit {config['model_type']} ({e})") from None


def _gguf_metadata(path: Path, backend: str, keep_quantized: bool | None) -> Metadata:
    from gguf.constants import GGMLQuantizationType as Q

    from mlx_infer.loading.gguf import (
        BLOCK_KINDS,
        EIGHT_BIT_SOURCES,
        FLOAT_TYPES,
        MX_LOAD_EXACT,
        ROPE_TENSORS,
        block_index,
    )
    from mlx_infer.loading.gguf_config import hf_config
    from mlx_infer.loading.gguf_file import read_header
    from mlx_infer.loading.gguf_hybrid import column_permuted

    header = read_header(path)
    config = hf_config(header.metadata, header.tensors, path.name)
    # The loader skips multi-token-prediction layers (numbered from num_hidden_layers on).
    layers = config["num_hidden_layers"]
    infos = [
        t for name, t in header.tensors.items() if name not in ROPE_TENSORS and block_index(name) < layers
    ]
    # mx.load reads these types exactly (Q4_0/Q4_1/Q8_0 as MLX affine, group 32, float16 scales and
    # biases); a file with any other type is read tensor by tensor and dequantized to float32, except
    # the K-quant matrices that stay raw blocks for the Metal kernels (loading/gguf.py, policy.py).
    exact = all(t.qtype in MX_LOAD_EXACT for t in infos)
    raw_blocks = not exact and _kquants_stay_raw(backend, keep_quantized)
    decoded = column_permuted(header.metadata["general.architecture"], config)  # read dequantized
    affine = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q8_0: 8}
    tied = "output.weight" not in header.tensors
    tensors = []
    for t in infos:
        common: dict[str, Any] = {
            "name": t.name,
            "shape": t.shape,
            "matrix": len(t.shape) >= 2,
            "read_fraction": _gguf_read_fraction(t.name, tied, config),
            "expert": "_exps." in t.name and len(t.shape) == 3,  # a stack of MoE experts
        }
        if exact and t.qtype in affine:
            tensors.append(Tensor(dtype="float16", bits=affine[t.qtype], group_size=32, **common))
        elif exact:
            tensors.append(Tensor(dtype="float32" if t.qtype == Q.F32 else "float16", **common))
        elif t.qtype == Q.MXFP4:  # gpt-oss's experts, read as MLX mxfp4 (loading/gguf_mxfp4.py)
            common["expert"] = True
            tensors.append(Tensor(dtype="uint8", bits=4, group_size=32, mode="mxfp4", **common))
        elif raw_blocks and t.qtype in BLOCK_KINDS and len(t.shape) == 2 and t.name not in decoded:
            tensors.append(Tensor(dtype="float32", gguf_bytes=t.nbytes, **common))
        else:
            requantize = 0
            if t.qtype not in FLOAT_TYPES and len(t.shape) >= 2:
                requantize = 8 if t.qtype in EIGHT_BIT_SOURCES else 4
            tensors.append(Tensor(dtype="float32", requantize=requantize, **common))
    return Metadata(config, lazy_model(config, path.name), tensors)


def _kquants_stay_raw(backend: str, keep_quantized: bool | None) -> bool:
    from mlx_infer.metal_kernels import dispatch

    # policy.kquants_stay_raw, for the backend planned for rather than the one running.
    return backend == "metal" and keep_quantized is not False and dispatch.USE_KERNELS


def _gguf_read_fraction(name: str, tied: bool, config: dict[str, Any]) -> float:
    if name == "token_embd.weight" and not tied:
        return 0.0  # a lookup reads one row per token; the untied head is read instead
    if name == "per_layer_token_embd.weight":
        return 0.0  # Gemma 4's per-layer inputs: a lookup too
    if "_exps." in name and name.endswith(".weight"):  # not gemma4's per-expert scale (ffn_down_exps.scale)
        chosen = config.get("num_experts_per_tok") or config["top_k_experts"]  # gemma4: top_k_experts
        return chosen / _expert_count(config)
    return 1.0


def _expert_count(config: dict[str, Any]) -> int:
    """Routed experts per MoE layer, under the names the architectures' configs use (1: dense)."""
    return config.get("num_experts") or config.get("n_routed_experts") or config.get("num_local_experts") or 1


def _folder_metadata(folder: Path) -> Metadata:
    config = hf.read_config(folder)
    model = lazy_model(config, folder.name)
    headers = _safetensors_headers(folder)
    default = _default_dtype(config, headers, folder, model)
    quantized = _quantized_modules(model, config, headers)
    params = dict(tree_flatten(model.parameters()))
    modules = dict(model.named_modules())
    tied = "lm_head.weight" not in params
    text = config.get("text_config", config)
    chosen = text.get("num_experts_per_tok") or text.get("top_k_experts") or 1  # gemma4: top_k_experts
    experts = chosen / _expert_count(text)
    # gpt-oss's official checkpoints: every expert matrix MXFP4 (models/gpt_oss.py).
    mxfp4 = (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    tensors = []
    for name, p in params.items():
        module, _, suffix = name.rpartition(".")
        expert = ".switch_mlp." in name or ".experts." in name
        if (module.endswith("embed_tokens") and not tied) or module.endswith("embed_tokens_per_layer"):
            fraction = 0.0  # a lookup reads one row per token (an untied head is read instead)
        elif expert:
            fraction = experts
        else:
            fraction = 1.0
        matrix = suffix == "weight" and hasattr(modules.get(module), "to_quantized")
        quant = quantized.get(module) if matrix else None
        if matrix and expert and mxfp4:
            tensors.append(Tensor(name, tuple(p.shape), "uint8", 4, 32, matrix=True, read_fraction=fraction,
                                  mode="mxfp4", expert=True))
        elif quant is not None:
            dtype = headers.get(f"{module}.scales", default)
            tensors.append(Tensor(name, tuple(p.shape), dtype, *quant, matrix=True, read_fraction=fraction,
                                  expert=expert))
        else:
            dtype = headers.get(name, default)
            tensors.append(Tensor(name, tuple(p.shape), dtype, matrix=matrix, read_fraction=fraction))
    return Metadata(config, model, tensors)


def _safetensors_headers(folder: Path) -> dict[str, str]:
    """Tensor name -> float dtype name, from the headers of the shards present (none when the folder has
    only the config and index, as a Hub id's cached metadata)."""
    from safetensors import SafetensorError, safe_open

    try:
        files = hf.weight_files(folder)
    except InvalidCheckpoint:
        return {}
    dtypes = {}
    for path in files:
        try:
            with safe_open(str(path), framework="numpy") as f:  # the header only; tensors stay on disk
                for name in f.keys():
                    kind = f.get_slice(name).get_dtype()
                    if kind in _SAFETENSORS_FLOATS:
                        dtypes[name] = _SAFETENSORS_FLOATS[kind]
        except (OSError, ValueError, SafetensorError) as e:  # a download cut short, a corrupt header
            raise UnreadableWeights(f"{path.name}: {hf.one_line(e)}") from None
    return dtypes


def _default_dtype(config: dict[str, Any], headers: dict[str, str], folder: Path, model: nn.Module) -> str:
    """The dtype of a tensor the headers do not name: the config's, else the headers' commonest, else
    the index's total size over the parameter count."""
    text = config.get("text_config", config)
    for key in ("torch_dtype", "dtype"):
        value = text.get(key) or config.get(key)
        if value in FLOAT_BYTES:
            return value
    if headers:
        return Counter(headers.values()).most_common(1)[0][0]
    index = folder / hf.INDEX_FILE
    if index.is_file():
        total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        count = sum(p.size for _, p in tree_flatten(model.parameters()))
        if total and count:
            return "float32" if total / count > 3 else "bfloat16"
    # Nothing says: plan for the largest a tensor would be held in, and say so (a bigger estimate than the
    # truth is the safe side of "does it fit").
    named = text.get("torch_dtype") or config.get("torch_dtype") or text.get("dtype") or config.get("dtype")
    why = "the config names no dtype"
    if named:
        why = f"the config's dtype {named!r} is not one of {', '.join(FLOAT_BYTES)}"
    log.warning("plan: %s and no weight headers are at hand: unquantized tensors counted as float32", why)
    return "float32"


def _quantized_modules(
    model: nn.Module, config: dict[str, Any], headers: dict[str, str]
) -> dict[str, tuple[int, int]]:
    """Module path -> (bits, group size) of the layers an MLX-quantized folder holds quantized: those with
    ``.scales`` in the headers, else (metadata only) those mlx-lm's convert quantizes (``to_quantized``
    and a group dividing the inputs), with the config's per-layer overrides (loading/quantized.py)."""
    quantization = config.get("quantization")
    if not isinstance(quantization, dict):
        return {}
    bits, group = quantization.get("bits", 4), quantization.get("group_size", 64)
    found = {}
    for path, module in model.named_modules():
        if not hasattr(module, "to_quantized") or "weight" not in module:
            continue
        override = quantization.get(path)
        if override is False:
            continue
        if isinstance(override, dict):
            found[path] = (override.get("bits", bits), override.get("group_size", group))
        elif headers:
            if f"{path}.scales" in headers:
                found[path] = (bits, group)
        elif module.weight.shape[-1] % group == 0:
            found[path] = (bits, group)
    return found


# ---- what the load path makes of them ----------------------------------------------------------
def convert_to_bits(tensors: Iterable[Tensor], bits: int) -> list[Tensor]:
    """The tensors as ``mlx-infer convert --q-bits BITS`` would write them: float matrices quantized
    (affine, group the source's commonest, else 64, where it divides the inputs), quantized ones below
    ``bits`` widened exactly at their group, those above kept (convert/choice.py)."""
    from mlx_infer.convert.quant import quant_params

    tensors = list(tensors)
    groups = Counter(t.group_size for t in tensors if t.bits)
    group = groups.most_common(1)[0][0] if groups else quant_params("affine", bits, None).group_size
    quant_params("affine", bits, group)  # bad bits fail as convert fails
    out = []
    for t in tensors:
        if t.bits:
            out.append(replace(t, bits=max(t.bits, bits)))
        elif t.matrix and t.shape[-1] % group == 0:
            out.append(replace(t, bits=bits, group_size=group, gguf_bytes=0, requantize=0))
        else:
            out.append(t)
    return out


def held(
    tensors: Iterable[Tensor], backend: str, keep_quantized: bool | None, row_tables: Collection[str] = ()
) -> tuple[list[Tensor], str, bool]:
    """The tensors after ``loading/policy.py``'s ``apply_weight_policy`` on ``backend`` ("cpu" or
    "metal"), how (the policy's own words), and whether the native CPU kernels compute the quantized
    layers (their embedding lookups come out float32 whatever the scales). ``row_tables``: the model's
    float tables that the CPU policy keeps as stored (``CausalLM.row_tables``)."""
    tensors = list(tensors)

    def stays(t: Tensor) -> bool:
        return t.name in row_tables and not t.bits

    def stays_for_kernels(t: Tensor) -> bool:  # policy._float16_group_params: read as they are
        return stays(t) or (bool(t.bits) and not t.expert and t.mode == "affine" and t.dtype == "float16")

    # Quantized experts are no layer the policy converts: they keep their bits on every backend.
    bits = sorted({t.bits for t in tensors if t.bits and not t.expert})
    bits_text = "/".join(f"{b}-bit" for b in bits)
    if backend == "cpu":
        if bits and keep_quantized is not False and _cpu_kernels_cover(tensors):
            widened = [t if stays_for_kernels(t) else replace(t, dtype="float32") for t in tensors]
            return widened, f"kept {bits_text} for the native CPU kernels", True
        if keep_quantized:
            return tensors, f"kept {bits_text} on the CPU backend" if bits else "", False
        half = "/".join(sorted({t.dtype for t in tensors if t.dtype in ("float16", "bfloat16")}))
        how = f"dequantized from {bits_text}" if bits else (f"from {half}" if half else "")
        widened = [t if stays(t) else replace(_dequantized(t), dtype="float32") for t in tensors]
        return widened, f"{how} for the CPU backend" if how else "", False
    if keep_quantized is False:
        return [_dequantized(t) for t in tensors], f"dequantized from {bits_text}" if bits else "", False
    from mlx_infer.loading.policy import REQUANT_GROUP_SIZE

    out = []
    for t in tensors:
        if t.requantize:
            # policy._requantize: weights cast to bfloat16 first, so the scales are bfloat16.
            out.append(replace(t, dtype="bfloat16", bits=t.requantize, group_size=REQUANT_GROUP_SIZE))
        else:
            out.append(t)
    return out, f"quantized {bits_text}" if bits else "", False


def _dequantized(t: Tensor) -> Tensor:
    """``t`` after policy._dequantize, which converts quantized layers, not stacked experts."""
    return t if t.expert else replace(t, bits=0, group_size=0)


def _cpu_kernels_cover(tensors: list[Tensor]) -> bool:
    from mlx_infer import cpu_kernels

    # policy._cpu_kernels_cover: affine 4/8-bit with groups of a multiple of 8, kernels built here.
    quantized = [t for t in tensors if t.bits and not t.expert]
    return all(t.bits in (4, 8) and t.group_size % 8 == 0 for t in quantized) and cpu_kernels.applies()
