"""FP8 checkpoints (quant_method "fp8") dequantized at load (mlx_infer/loading/fp8.py).

Folders are written here as the official FP8 releases lay them out: float8 e4m3 ``weight`` tensors
(safetensors dtype ``F8_E4M3``) with float32 ``weight_scale_inv`` per block (GLM / DeepSeek) or per
tensor with an ``activation_scale`` (Ministral 3), from the tiny checkpoints in tests/oracle/tiny. The
oracle: the same model built from the dequantized values computed here in NumPy.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_infer.errors import InvalidCheckpoint
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.interface.kv import new_cache
from mlx_infer.loading import load, open_checkpoint
from mlx_infer.loading.build import build_model
from mlx_infer.loading.policy import prepare_for_backend
from mlx_infer.plan import make_plan

TINY = Path(__file__).parent / "oracle" / "tiny"
FP8_MAX = 448.0
QUANTIZED = ("_proj.weight",)  # the linear layers FP8 releases quantize (not embeddings, norms, routers)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """``tensors``: name -> (safetensors dtype, array whose bytes are stored as they are)."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, array) in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        span = [offset, offset + len(data)]
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": span}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def quantize(w: np.ndarray, block: list[int] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(e4m3 bytes, float32 scale_inv, the float32 values they stand for)."""
    if block is None:
        scale = np.array([np.abs(w).max() / FP8_MAX], np.float32)
        full = np.broadcast_to(scale, w.shape)
    else:
        rows, cols = w.shape
        br, bc = block
        scale = np.zeros((-(-rows // br), -(-cols // bc)), np.float32)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                scale[i, j] = np.abs(w[i * br : (i + 1) * br, j * bc : (j + 1) * bc]).max() / FP8_MAX
        full = np.repeat(np.repeat(scale, br, 0), bc, 1)[:rows, :cols]
    q = mx.to_fp8(mx.array(w / full))
    values = np.array(mx.from_fp8(q, dtype=mx.float32)) * full
    return np.array(q), scale, values.astype(np.float32)


def fp8_folder(tmp_path: Path, name: str, block: list[int] | None) -> tuple[Path, dict[str, np.ndarray]]:
    """The tiny checkpoint ``name`` as an FP8 release, and the values its FP8 weights stand for."""
    folder = tmp_path / f"{name}-fp8"
    shutil.copytree(TINY / name, folder)
    (folder / "model.safetensors").unlink()
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": block}
    (folder / "config.json").write_text(json.dumps(config))
    weights = {k: np.array(v) for k, v in open_checkpoint(str(TINY / name)).weights.items()}
    tensors, values = {}, {}
    for k, w in weights.items():
        if not k.endswith(QUANTIZED):
            tensors[k], values[k] = ("F32", w), w
            continue
        q, scale, values[k] = quantize(w, block)
        tensors[k] = ("F8_E4M3", q)
        tensors[f"{k}_scale_inv"] = ("F32", scale)
        if block is None:  # Ministral 3's static activation scheme
            tensors[k.replace(".weight", ".activation_scale")] = ("F32", np.ones(1, np.float32))
    write_safetensors(folder / "model.safetensors", tensors)
    return folder, values


def logits(model) -> np.ndarray:
    tokens = np.load(TINY / "glm4_moe" / "reference.npz")["tokens_0"]
    meta = build_metadata([SequenceSlice(list(range(8)), 0, len(tokens), True)], 4)
    return np.array(model(mx.array(tokens), new_cache(model, 8, 4, mx.float32), meta))


@pytest.mark.parametrize(("name", "block"), [("glm4_moe", [24, 32]), ("ministral3", None)])
def test_fp8_checkpoint_gives_its_dequantized_model(tmp_path: Path, name: str, block: list[int] | None):
    folder, values = fp8_folder(tmp_path, name, block)
    ckpt = open_checkpoint(str(folder))
    assert not any(k.endswith(("_scale_inv", "activation_scale")) for k in ckpt.weights)
    projection = next(k for k in ckpt.weights if k.endswith("q_proj.weight"))
    assert ckpt.weights[projection].dtype == mx.float32  # the tiny config's dtype
    np.testing.assert_array_equal(np.array(ckpt.weights[projection]), values[projection])
    expected = build_model(ckpt.config, {k: mx.array(v) for k, v in values.items()}, name)
    prepare_for_backend(expected)  # as load leaves its model: the same fused ops, so equal to the bit
    loaded = load(str(folder))
    np.testing.assert_array_equal(logits(loaded.model), logits(expected))
    held = sum(p.nbytes for _, p in tree_flatten(loaded.model.parameters()))
    assert make_plan(str(folder)).weights_bytes == held


def test_fp8_scales_that_do_not_cover_the_weight_are_refused(tmp_path: Path):
    folder, _ = fp8_folder(tmp_path, "ministral3", [24, 32])
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [16, 16]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidCheckpoint, match="does not cover"):
        load(str(folder))
