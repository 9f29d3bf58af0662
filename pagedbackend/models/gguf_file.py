"""A GGUF file, read and checked: its metadata and the place of every tensor
in it, with the file memory-mapped (copy-on-write, never written: pages are
read from the file as the kernels touch them and shared with the page cache).

Nothing in the header is trusted. Every count, length and shape is read as
an unbounded Python integer and checked against the file before anything is
sized from it: a string or array longer than what is left of the file, a
tensor of more than four dimensions, a dimension of zero or beyond 2^63, an
element count or byte size past 2^63 (products that overflow 64-bit
arithmetic), rows that are not whole blocks, an offset off the alignment,
or data past the end of the file are each refused with ``GGUFError`` naming
the tensor or key. Only then do tensors get views into the mapping.
"""
import mmap
import pathlib
import struct
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

INT64_MAX = 2 ** 63 - 1
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32
# ggml type id -> (name, values per block, bytes per block): the float and
# quantised types a GGUF of the served families holds.
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2), 2: ("Q4_0", 32, 18),
              3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
              12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}
QUANTIZED = frozenset(("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"))
# Metadata value types: id -> struct format (scalars), 8 string, 9 array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class GGUFError(ValueError):
    """A GGUF file that is malformed, truncated or describes impossible tensors."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: Tuple[int, ...]   # GGUF order: the fastest (input) dimension first
    type_id: int
    offset: int              # from the start of the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.type_id][0]

    @property
    def rows(self) -> int:
        rows = 1
        for dim in self.shape[1:]:
            rows *= dim
        return rows

    @property
    def cols(self) -> int:
        return self.shape[0]


class _Cursor:
    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, count: int, what: str) -> memoryview:
        if count < 0 or count > len(self.buf) - self.pos:
            raise GGUFError(f"{self.path}: truncated: {what} needs {count} bytes at offset {self.pos}, "
                            f"the file has {len(self.buf) - self.pos} left")
        view = memoryview(self.buf)[self.pos:self.pos + count]
        self.pos += count
        return view

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        length = self.scalar("<Q", f"the length of {what}")
        return bytes(self.take(length, what)).decode("utf-8", errors="replace")

    def value(self, kind: int, what: str):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], what)
        if kind == 8:
            return self.string(what)
        if kind == 9:
            item = self.scalar("<I", f"the item type of {what}")
            count = self.scalar("<Q", f"the length of {what}")
            if item in _SCALARS:
                size = struct.calcsize(_SCALARS[item])
                data = self.take(count * size, what)   # count checked against the file by take
                return list(struct.unpack(f"<{count}{_SCALARS[item][1]}", data))
            if item == 8:
                if count * 8 > len(self.buf) - self.pos:   # each string has at least its length
                    raise GGUFError(f"{self.path}: {what} claims {count} strings, more than the file holds")
                return [self.string(what) for _ in range(count)]
            if item == 9:
                raise GGUFError(f"{self.path}: {what} is an array of arrays, which no served key is")
            raise GGUFError(f"{self.path}: {what} has unknown item type {item}")
        raise GGUFError(f"{self.path}: {what} has unknown value type {kind}")


class GGUFFile:
    """``metadata`` (key -> value) and ``tensors`` (name -> ``TensorInfo``) of
    a checked GGUF file; ``tensor(name)`` is a uint8 ``[rows, row bytes]``
    view into the mapping (float32 ``[rows, cols]`` for F32 tensors)."""

    def __init__(self, path):
        self.path = pathlib.Path(path)
        with open(self.path, "rb") as handle:
            size = self.path.stat().st_size
            if size == 0:
                raise GGUFError(f"{self.path}: empty file, not a GGUF")
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        self.metadata, self.tensors = _parse(self._map, str(self.path))
        self._data = torch.frombuffer(self._map, dtype=torch.uint8)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def tensor(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        raw = self._data[info.offset:info.offset + info.nbytes]
        if info.type_name == "F32":
            return raw.view(torch.float32).view(info.rows, info.cols)
        if info.type_name in ("F16", "BF16"):
            return raw.view(torch.float16 if info.type_name == "F16" else torch.bfloat16).view(info.rows, info.cols)
        return raw.view(info.rows, info.nbytes // info.rows)


def _parse(buf, path: str) -> Tuple[Dict[str, object], Dict[str, TensorInfo]]:
    cur = _Cursor(buf, path)
    if bytes(cur.take(4, "the magic number")) != b"GGUF":
        raise GGUFError(f"{path}: not a GGUF file (no GGUF magic number)")
    version = cur.scalar("<I", "the version")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version}; versions 2 and 3 are read")
    n_tensors = cur.scalar("<Q", "the tensor count")
    n_kv = cur.scalar("<Q", "the metadata count")
    # Each entry takes at least 8 (tensor) or 12 (key) bytes: counts beyond that are lies.
    if n_tensors * 8 + n_kv * 12 > len(buf):
        raise GGUFError(f"{path}: header claims {n_tensors} tensors and {n_kv} metadata keys, "
                        f"more than a {len(buf)}-byte file can hold")
    metadata: Dict[str, object] = {}
    for _ in range(n_kv):
        key = cur.string("a metadata key")
        kind = cur.scalar("<I", f"the type of {key}")
        metadata[key] = cur.value(kind, key)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1) or alignment > 1 << 20:
        raise GGUFError(f"{path}: general.alignment {alignment!r} is not a power of two up to 1 MiB")
    infos: List[Tuple[str, Tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name = cur.string("a tensor name")
        n_dims = cur.scalar("<I", f"the rank of {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{path}: tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} are valid)")
        shape = tuple(cur.scalar("<Q", f"the shape of {name}") for _ in range(n_dims))
        type_id = cur.scalar("<I", f"the type of {name}")
        offset = cur.scalar("<Q", f"the offset of {name}")
        infos.append((name, shape, type_id, offset))
    data_start = -(-cur.pos // alignment) * alignment
    tensors: Dict[str, TensorInfo] = {}
    for name, shape, type_id, offset in infos:
        tensors[name] = _checked(path, name, shape, type_id, offset, data_start, alignment, len(buf))
    if len(tensors) != len(infos):
        raise GGUFError(f"{path}: tensor names repeat")
    return metadata, tensors


def _checked(path, name, shape, type_id, offset, data_start, alignment, file_size) -> TensorInfo:
    """The tensor's place, after checking its shape and bytes in 64-bit terms."""
    if type_id not in GGML_TYPES:
        raise GGUFError(f"{path}: tensor {name} has ggml type {type_id}, which is not served "
                        f"(served: {', '.join(t[0] for t in GGML_TYPES.values())})")
    type_name, block_values, block_bytes = GGML_TYPES[type_id]
    elements = 1
    for dim in shape:
        if dim == 0 or dim > INT64_MAX:
            raise GGUFError(f"{path}: tensor {name} has dimension {dim} in shape {list(shape)}")
        elements *= dim
        if elements > INT64_MAX:
            raise GGUFError(f"{path}: tensor {name} of shape {list(shape)} has more than 2^63 elements "
                            "(its size overflows 64-bit arithmetic)")
    if shape[0] % block_values:
        raise GGUFError(f"{path}: tensor {name} rows of {shape[0]} values are not whole {type_name} blocks "
                        f"of {block_values}")
    nbytes = elements // block_values * block_bytes
    if nbytes > INT64_MAX:
        raise GGUFError(f"{path}: tensor {name} of shape {list(shape)} needs more than 2^63 bytes")
    if offset % alignment:
        raise GGUFError(f"{path}: tensor {name} offset {offset} is not a multiple of the alignment {alignment}")
    start = data_start + offset
    if start + nbytes > file_size:
        raise GGUFError(f"{path}: tensor {name} ({type_name}, shape {list(shape)}, {nbytes} bytes at offset "
                        f"{start}) runs past the end of the {file_size}-byte file (truncated or corrupt)")
    return TensorInfo(name, tuple(shape), type_id, start, nbytes)
