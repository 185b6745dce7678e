"""A small, fast reader for a GGUF file's header: metadata and the tensor table.

``gguf.GGUFReader`` builds a numpy view per string and takes ~9 s on SmolLM2's 49k-token vocabulary
(far longer on Gemma's 262k); this reads the same header with ``struct`` in well under a second.
Tensor bytes stay on disk: :func:`tensor_bytes` returns a read-only memory map of one tensor.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from mlx_infer.errors import InvalidCheckpoint

_MAGIC = b"GGUF"
# GGUF value type -> struct format of a scalar (8: string, 9: array are handled apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {
    0: "u1",
    1: "i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first): ggml's ne reversed
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class GGUFHeader:
    metadata: dict[str, Any]  # plain Python values: int, float, bool, str, lists of them
    tensors: dict[str, TensorInfo]


class _Cursor:
    def __init__(self, data: mmap.mmap):
        self.data, self.pos = data, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.data):
            raise EOFError
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.data):
            raise EOFError
        s = self.data[self.pos : self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == 8:
            return self.string()
        if vtype == 9:
            item_type, count = self.take("I"), self.take("Q")
            if item_type in _NUMPY:  # numeric arrays in one numpy read: token types, scores
                size = count * np.dtype(_NUMPY[item_type]).itemsize
                if self.pos + size > len(self.data):
                    raise EOFError
                arr = np.frombuffer(self.data, _NUMPY[item_type], count, self.pos)
                self.pos += size
                return arr.tolist()
            return [self.value(item_type) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self.take(_SCALARS[vtype])


def read_header(path: Path) -> GGUFHeader:
    """Metadata and tensor table of ``path``; raises InvalidCheckpoint on a truncated or corrupt header."""
    try:
        # Memory-mapped: only the header's pages are read, whatever the file's size.
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(data)
    except (EOFError, ValueError, struct.error, KeyError) as e:
        reason = str(e) or ("it ends inside its header" if isinstance(e, EOFError) else type(e).__name__)
        raise InvalidCheckpoint(f"{path}: corrupt or truncated GGUF file ({reason})") from None


def _parse(data: mmap.mmap) -> GGUFHeader:
    cur = _Cursor(data)
    if bytes(data[:4]) != _MAGIC:
        raise ValueError("not a GGUF file")
    cur.pos = 4
    version = cur.take("I")
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    n_tensors, n_kv = cur.take("Q"), cur.take("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.take("I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("Q") for _ in range(cur.take("I"))]
        qtype = GGMLQuantizationType(cur.take("I"))
        infos.append((name, tuple(reversed(dims)), qtype, cur.take("Q")))
    alignment = int(metadata.get("general.alignment", 32))
    start = -(-cur.pos // alignment) * alignment
    file_size = len(data)
    tensors = {}
    for name, shape, qtype, offset in infos:
        block, type_size = GGML_QUANT_SIZES[qtype]
        n = int(np.prod(shape, dtype=np.int64))
        nbytes = n // block * type_size
        if start + offset + nbytes > file_size:
            raise ValueError(f"tensor {name!r} extends past the end of the file")
        tensors[name] = TensorInfo(name, shape, qtype, start + offset, nbytes)
    return GGUFHeader(metadata, tensors)


def tensor_bytes(path: Path, info: TensorInfo) -> np.ndarray:
    """The raw bytes of one tensor as ``gguf.quants.dequantize`` expects them (last axis in bytes)."""
    block, type_size = GGML_QUANT_SIZES[info.qtype]
    byte_shape = (*info.shape[:-1], info.shape[-1] // block * type_size)
    return np.memmap(path, dtype=np.uint8, mode="r", offset=info.offset, shape=byte_shape)
