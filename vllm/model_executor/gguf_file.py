"""A GGUF file's metadata and tensor table, read off a memory map: what gguf_loader and
quant_linear need of a file (its keys, each tensor's name, GGML type, shape and data view).

gguf-py's GGUFReader builds a numpy view per array element, which for a vocabulary of 49k-262k
tokens plus merges is hundreds of thousands of views; here numeric arrays are one frombuffer
each, and string arrays (tokens, merges) are only walked over and decoded when asked for.
Tensor data is never read: `GGUFTensor.data` is a read-only view of the map, shaped as
GGUFReader shapes it (values for float and integer types, [..., row bytes] uint8 for blocks).

Format (little-endian; big-endian files are refused): "GGUF", uint32 version (2 or 3), uint64
tensor count, uint64 key count; each key a string (uint64 length + UTF-8) with a uint32 value
type and its value (an array: uint32 element type, uint64 count, the elements); each tensor a
name, uint32 dims, uint64 dims (fastest-moving first), uint32 GGML type, uint64 offset into the
data section, which starts at the next multiple of general.alignment (32 by default).
"""
import struct
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
# GGUF value type -> struct format of one value
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}
# GGML value (not block) types -> numpy dtype of their elements
_VALUE_DTYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32,
                 27: np.int64, 28: np.float64}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: Any            # gguf.GGMLQuantizationType
    shape: Tuple[int, ...]      # GGML order: the row length (fastest-moving) first
    data: np.ndarray            # read-only view of the file


class _StringArray(NamedTuple):
    """Where a string array's value (its element type and count, then the elements) starts:
    decoded when its key is read."""
    pos: int


class GGUFFile:
    def __init__(self, path: str):
        self.path = str(path)
        self._map = np.memmap(self.path, mode="r", dtype=np.uint8)
        self._buf = memoryview(self._map)
        try:
            self._read()
        except (struct.error, UnicodeDecodeError) as e:
            raise ValueError(f"{self.path} is a truncated or corrupt GGUF file ({e})") from e

    def _read(self) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic)")
        version, n_tensors, n_keys = struct.unpack_from("<IQQ", self._buf, 4)
        if version not in _VERSIONS:
            swapped = struct.unpack(">I", struct.pack("<I", version))[0]
            what = ("a big-endian GGUF" if swapped in _VERSIONS
                    else f"GGUF version {version}")
            raise ValueError(f"{self.path} is {what}; versions {_VERSIONS} little-endian are "
                             "read")
        pos = 24
        self._fields: Dict[str, Any] = {}
        self._types: Dict[str, Tuple[int, Optional[int]]] = {}
        for _ in range(n_keys):
            key, pos = self._string(pos)
            (vtype,) = struct.unpack_from("<I", self._buf, pos)
            etype = struct.unpack_from("<I", self._buf, pos + 4)[0] if vtype == _ARRAY else None
            self._types[key] = (vtype, etype)
            self._fields[key], pos = self._value(vtype, pos + 4)
        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,) = struct.unpack_from("<I", self._buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, pos + 4)
            qtype, offset = struct.unpack_from("<IQ", self._buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, qtype, offset))
        align = int(self._fields.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"{self.path}: general.alignment {align} is not a power of two")
        start = (pos + align - 1) // align * align
        self.tensors: List[GGUFTensor] = []
        seen = set()
        for name, dims, qtype, offset in infos:
            if name in seen:
                raise ValueError(f"{self.path}: tensor {name} appears twice")
            seen.add(name)
            ggml_type = GGMLQuantizationType(qtype)
            n = int(np.prod(dims, dtype=np.int64))
            shape = tuple(reversed(dims))
            at = start + offset
            if qtype in _VALUE_DTYPES:
                dtype = np.dtype(_VALUE_DTYPES[qtype])
                nbytes, view = n * dtype.itemsize, shape
            else:
                block, size = GGML_QUANT_SIZES[ggml_type]
                if dims[0] % block:
                    raise ValueError(f"{self.path}: tensor {name}'s rows ({dims[0]}) are not "
                                     f"whole {ggml_type.name} blocks of {block}")
                dtype, nbytes = np.dtype(np.uint8), n // block * size
                view = (*shape[:-1], dims[0] // block * size)
            if at + nbytes > len(self._map):
                raise ValueError(f"{self.path}: tensor {name} runs past the end of the file")
            data = self._map[at:at + nbytes].view(dtype).reshape(view)
            self.tensors.append(GGUFTensor(name, ggml_type, dims, data))

    def get(self, key: str, default: Any = None) -> Any:
        """The value of a metadata key (a number, a string, or a list of them), or default."""
        value = self._fields.get(key, default)
        if isinstance(value, _StringArray):
            value = self._fields[key] = self._value(_ARRAY, value.pos, lazy=False)[0]
        return value

    def keys(self):
        return self._fields.keys()

    def value_type(self, key: str):
        """(gguf.GGUFValueType of the key's value, that of an array's elements or None): what
        a GGUFWriter needs to copy the key."""
        from gguf import GGUFValueType
        vtype, etype = self._types[key]
        return GGUFValueType(vtype), None if etype is None else GGUFValueType(etype)

    def _string(self, pos: int) -> Tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._buf, pos)
        return bytes(self._buf[pos + 8:pos + 8 + n]).decode("utf-8"), pos + 8 + n

    def _value(self, vtype: int, pos: int, lazy: bool = True) -> Tuple[Any, int]:
        if vtype in _SCALAR:
            fmt = "<" + _SCALAR[vtype]
            return struct.unpack_from(fmt, self._buf, pos)[0], pos + struct.calcsize(fmt)
        if vtype == _STRING:
            return self._string(pos)
        if vtype != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")
        start = pos
        etype, count = struct.unpack_from("<IQ", self._buf, pos)
        pos += 12
        if etype in _SCALAR:
            fmt = "<" + _SCALAR[etype]
            size = struct.calcsize(fmt)
            values = np.frombuffer(self._buf, dtype=np.dtype(fmt), count=count, offset=pos)
            return values.tolist(), pos + count * size
        if etype == _STRING and lazy:
            for _ in range(count):
                pos += 8 + struct.unpack_from("<Q", self._buf, pos)[0]
            return _StringArray(start), pos
        if etype in (_STRING, _ARRAY):     # an element is a string, or an array (own header)
            out = []
            for _ in range(count):
                value, pos = self._value(etype, pos, lazy=False)
                out.append(value)
            return out, pos
        raise ValueError(f"{self.path}: unknown GGUF array element type {etype}")
