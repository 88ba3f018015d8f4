"""The header of a GGUF file, read fast and bounds-checked: :class:`GGUFFile`, :class:`GGUFError`."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize


class GGUFError(ValueError):
    """A GGUF file this loader cannot turn into an mlx-lm model."""


_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # ggml tensors have at most four dimensions


class GGUFFile:
    """The header of a GGUF file: metadata and tensor descriptions, read fast.

    ``gguf.GGUFReader`` builds a numpy view per array element, which takes
    ~15 s for a 262k-token vocabulary; this reads the same header in well
    under a second and leaves tensor data memory-mapped.  Every read is
    bounds-checked and every tensor's bytes must lie inside the file, so a
    truncated or corrupt file raises :class:`GGUFError` here, never later.

    Attributes:
        metadata: {key: value}; arrays of numbers are numpy arrays, arrays of
            strings are lists of str.
        tensors: {name: (ggml type name, shape in numpy order, byte offset)}.
    """

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        if self.path.stat().st_size < 4:
            raise GGUFError(f"{self.path} is not a GGUF file (only {self.path.stat().st_size} bytes)")
        # A plain ndarray view: slicing an np.memmap is slow in numpy's hot loops.
        self._data = np.asarray(np.memmap(self.path, dtype=np.uint8, mode="r"))
        self._buf = memoryview(self._data)
        self._pos = 0
        if bytes(self._buf[:4]) != b"GGUF":
            raise GGUFError(f"{self.path} is not a GGUF file (bad magic)")
        self._pos = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: unsupported GGUF version {version}")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        self.metadata = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar("<I")
            if n_dims > _MAX_DIMS:
                raise GGUFError(f"{self.path}: tensor {name!r} has {n_dims} dimensions (corrupt header?)")
            dims = [self._scalar("<Q") for _ in range(n_dims)]
            kind, offset = self._scalar("<I"), self._scalar("<Q")
            try:
                kind_name = GGMLQuantizationType(kind).name
            except ValueError:
                raise GGUFError(f"unknown tensor type id {kind} for {name}") from None
            infos.append((name, kind_name, tuple(reversed(dims)), offset))
        align = int(self.metadata.get("general.alignment", 32))
        base = -(-self._pos // align) * align
        self.tensors = {n: (k, s, base + o) for n, k, s, o in infos}
        for name in self.tensors:
            end = self.tensors[name][2] + self.nbytes(name)
            if end > len(self._data):
                raise GGUFError(
                    f"{self.path}: tensor {name!r} ends at byte {end}, past the end of the file "
                    f"({len(self._data)} bytes): truncated or incomplete download?"
                )

    def _truncated(self, need: int):
        return GGUFError(
            f"{self.path}: GGUF header truncated or corrupt (needs {need} bytes at offset "
            f"{self._pos}, the file has {len(self._data)}): incomplete download?"
        )

    def _take(self, n: int) -> int:
        """Advance past ``n`` bytes; returns where they start."""
        if n < 0 or self._pos + n > len(self._data):
            raise self._truncated(n)
        start = self._pos
        self._pos += n
        return start

    def _scalar(self, fmt):
        (value,) = struct.unpack_from(fmt, self._buf, self._take(struct.calcsize(fmt)))
        return value

    def _string(self):
        n = self._scalar("<Q")
        start = self._take(n)
        return bytes(self._buf[start : start + n]).decode("utf-8", "replace")

    def _value(self, kind):
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item_kind, count = self._scalar("<I"), self._scalar("<Q")
            if item_kind == _STRING:
                return [self._string() for _ in range(count)]
            if item_kind == _ARRAY:
                return [self._value(self._scalar("<I")) for _ in range(count)]
            if item_kind not in _SCALAR_FORMATS:
                raise GGUFError(f"{self.path}: unknown metadata array item type {item_kind}")
            dtype = np.dtype(_SCALAR_FORMATS[item_kind])
            start = self._take(dtype.itemsize * count)
            return np.frombuffer(self._buf, dtype=dtype, count=count, offset=start).copy()
        if kind not in _SCALAR_FORMATS:
            raise GGUFError(f"{self.path}: unknown metadata value type {kind}")
        return self._scalar(_SCALAR_FORMATS[kind])

    def nbytes(self, name) -> int:
        """Bytes tensor ``name`` occupies in the file."""
        kind, shape, _ = self.tensors[name]
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
        if shape and shape[-1] % block:
            raise GGUFError(f"tensor {name!r}: rows of {shape[-1]} are not whole {kind} blocks of {block}")
        return math.prod(shape) // block * type_size

    def raw(self, name) -> np.ndarray:
        """The bytes of tensor ``name`` (uint8, a view of the memory-mapped file)."""
        offset = self.tensors[name][2]
        return self._data[offset : offset + self.nbytes(name)]

    def dequantized(self, name) -> np.ndarray:
        """Tensor ``name`` as fp32 numpy (numpy shape order), via the gguf package."""
        kind, shape, _ = self.tensors[name]
        qtype = GGMLQuantizationType[kind]
        block, type_size = GGML_QUANT_SIZES[qtype]
        raw = self.raw(name)
        if kind in ("F32", "F16"):
            return raw.view(np.float32 if kind == "F32" else np.float16).astype(np.float32).reshape(shape)
        row_bytes = shape[-1] // block * type_size
        try:
            out = gguf_dequantize(raw.reshape(-1, row_bytes), qtype)
        except NotImplementedError as e:
            raise GGUFError(f"unsupported tensor type {kind} for {name}") from e
        return np.asarray(out, np.float32).reshape(shape)


__all__ = ["GGUFError", "GGUFFile"]
