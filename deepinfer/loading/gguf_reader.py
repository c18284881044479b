"""A lean GGUF reader: metadata as Python values, tensors as views of one memory map.

``gguf.GGUFReader`` builds a numpy object per field part (hundreds of thousands for a
49k-token vocabulary with its merges), which makes opening the default model take
seconds. This reader walks the header once with ``struct`` and keeps tensor data in a
single ``np.memmap``; tensors are only touched when dequantized. Files are cached per
(path, size, mtime): the model loader and the tokenizer share one parse.

Format (GGUF v2/v3, little-endian): magic ``GGUF``, version u32, tensor count u64,
metadata count u64; each metadata entry is a string key, a u32 value type and the value
(arrays: element type u32, count u64, elements); then per tensor its name, dims count
u32, dims u64 each (ggml order: fastest first), type u32 and data offset u64; tensor
data starts at the next multiple of ``general.alignment`` (32 by default).
"""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# Scalar value types: struct format and size.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


@dataclass
class GGUFTensor:
    """One tensor: ``shape`` in ggml order (fastest dimension first, as in the file),
    ``tensor_type`` a ``GGMLQuantizationType`` value, ``data`` its bytes viewed as the
    array ``gguf.quants.dequantize`` takes (typed for F32/F16/BF16, uint8 rows else)."""

    name: str
    shape: np.ndarray
    tensor_type: int
    data: np.ndarray


class BadGGUF(ValueError):
    """A file that is not a GGUF file deepinfer reads; ``GGUFFile`` adds the path."""


class GGUFFile:
    """An opened GGUF file: ``metadata`` (key -> int, float, bool, str or list) and
    ``tensors`` in file order. Raises ``ValueError`` naming the file when it is not a
    GGUF file or is cut short."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._map = np.memmap(path, dtype=np.uint8, mode="r")  # an empty file fails
            self.metadata, self.tensors = self._parse(memoryview(self._map))
        except BadGGUF as e:
            raise ValueError(f"{path}: {e}") from None
        except (struct.error, IndexError, UnicodeDecodeError, ValueError) as e:
            # numpy and struct on a file cut short or corrupt: name the file.
            raise ValueError(f"{path}: not a valid GGUF file ({e})") from None

    def _parse(self, buf: memoryview) -> tuple[dict[str, Any], list[GGUFTensor]]:
        if bytes(buf[:4]) != _MAGIC:
            raise BadGGUF("not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise BadGGUF(f"GGUF version {version} is not supported (>= 2)")
        pos = 24
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = _string(buf, pos)
            (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            metadata[key], pos = _value(buf, pos, vtype)
        infos = []
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            (ndim,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            dims = np.array(struct.unpack_from(f"<{ndim}Q", buf, pos), dtype=np.int64)
            pos += 8 * ndim
            ttype, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            infos.append((name, dims, ttype, offset))
        align = int(metadata.get("general.alignment", 32))
        start = -(-pos // align) * align
        tensors = [GGUFTensor(name, dims, ttype,
                              self._tensor_data(name, start + off, dims, ttype))
                   for name, dims, ttype, off in infos]
        return metadata, tensors

    def _tensor_data(self, name: str, offset: int, dims: np.ndarray,
                     ttype: int) -> np.ndarray:
        try:
            qtype = GGMLQuantizationType(ttype)
        except ValueError:
            raise BadGGUF(f"tensor {name!r} has unknown ggml type id {ttype}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise BadGGUF(f"tensor {name!r}: its rows of {int(dims[0])} weights are not "
                          f"whole {qtype.name} blocks of {block}")
        rows = tuple(int(d) for d in reversed(dims[1:].tolist()))
        row_bytes = int(dims[0]) // block * type_size
        n = int(np.prod(rows, dtype=np.int64)) * row_bytes
        if offset + n > self._map.shape[0]:
            raise BadGGUF(f"tensor {name!r}'s data runs past the end of the file (cut short?)")
        data = self._map[offset:offset + n]
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            dtype = np.float32 if qtype == GGMLQuantizationType.F32 else np.float16
            return data.view(dtype).reshape(*rows, int(dims[0]))
        return data.reshape(*rows, row_bytes)


def _string(buf: memoryview, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    pos += 8
    return str(buf[pos:pos + n], "utf-8"), pos + n


def _value(buf: memoryview, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype == _STRING:
        return _string(buf, pos)
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype != _ARRAY:
        raise BadGGUF(f"unknown GGUF value type {vtype}")
    etype, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if etype in _NUMPY:  # numbers: one frombuffer, not one object per element
        dtype = np.dtype(_NUMPY[etype])
        arr = np.frombuffer(buf, dtype=dtype, count=count, offset=pos)
        return arr.tolist(), pos + count * dtype.itemsize
    out = []
    for _ in range(count):
        item, pos = _value(buf, pos, etype)
        out.append(item)
    return out, pos


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, size: int, mtime_ns: int) -> GGUFFile:
    del size, mtime_ns  # part of the cache key only: a rewritten file is parsed again
    return GGUFFile(path)


def open_gguf(path: str) -> GGUFFile:
    """The parsed file at ``path``, shared by every caller while the file is unchanged."""
    st = os.stat(path)
    return _open_cached(os.path.abspath(path), st.st_size, st.st_mtime_ns)
