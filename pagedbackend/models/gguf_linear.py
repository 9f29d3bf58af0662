"""Linear layers and embeddings over GGUF blocks, as the file holds them.

``GGUFLinear`` multiplies x by the rows of one or more GGUF tensors (a merged
q/k/v or gate/up projection: each shard its own tensor, each of its own type,
as a Q4_K_M file mixes Q4_K and Q6_K) with ``kernels/csrc/gguf_gemm.c``: the
blocks are widened to float32 in registers, exactly the values the reference
dequantisation gives, and never stored wider. x stays in the run's dtype
(bfloat16 rows widen exactly in the call). Rows a shard needs in another
order (Llama-architecture q/k, which llama.cpp stores permuted for its RoPE)
are read through a row map, so the blocks stay in the file's mapping.
``GGUFEmbedding`` widens the rows of the looked-up tokens only.

With ``int8_activations`` (``quantization=w8a8`` on a GGUF model) x is
rounded to int8 as llama.cpp rounds it (per group of 32 for the 32-value
types, per super-block of 256 for the K-quants) and each group's product is an
integer dot product (AVX-512 VNNI); see the kernel's "int8 activations".
Parts of the types that have them are then read from panels of 16 rows copied
once when the setting is applied (``pack_panels``; the kernel's "int8
activations on panels"), the original blocks staying mapped for the default
products and ``dequantized``.

The calls are ``torch.library`` operators, so a compiled step keeps them as
opaque calls. Each has a Python kernel (ctypes) and a C++ twin
(``gguf_linear_native``, ``gguf_linear_q8_native``: ``csrc/packed_ops.cpp``,
built at first use against the installed torch, one library with the packed
layers' operators) that does the same checks and
calls the same C function without entering Python; layers call the twins
wherever they build, unless ``EngineConfig.native_ops`` is false (as the
packed layers do: ``kernels.packed_linear.native_ops``).
"""
import ctypes
import threading
from typing import List, Optional, Sequence

import torch
from torch import nn

from pagedbackend.kernels import hugepages, native, onednn_linear

# ggml type ids the kernels take.
TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
BLOCK_VALUES = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}

_lock = threading.Lock()
_library: Optional[ctypes.CDLL] = None


def load_library() -> ctypes.CDLL:
    """``gguf_gemm.c``, built on first use (RuntimeError saying why it cannot be)."""
    global _library
    with _lock:
        if _library is None:
            lib = native.load("gguf_gemm")
            lib.gguf_gemm_parts.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                            ctypes.c_void_p, ctypes.c_int]
            lib.gguf_gemm_parts.restype = ctypes.c_int
            lib.gguf_get_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                          ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
            lib.gguf_get_rows.restype = ctypes.c_int
            lib.gguf_gemm_avx512.argtypes = [ctypes.c_int]
            lib.gguf_gemm_avx512.restype = ctypes.c_int
            lib.gguf_gemm_q8_parts.argtypes = lib.gguf_gemm_parts.argtypes
            lib.gguf_gemm_q8_parts.restype = ctypes.c_int
            lib.gguf_gemm_q8_panels.argtypes = (lib.gguf_gemm_parts.argtypes[:6] + [ctypes.c_void_p]
                                                + lib.gguf_gemm_parts.argtypes[6:])
            lib.gguf_gemm_q8_panels.restype = ctypes.c_int
            lib.gguf_panel_bytes.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            lib.gguf_panel_bytes.restype = ctypes.c_int64
            lib.gguf_panel_pack.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                            ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
            lib.gguf_panel_pack.restype = ctypes.c_int
            lib.gguf_gemm_q8_usable.argtypes = []
            lib.gguf_gemm_q8_usable.restype = ctypes.c_int
            _library = lib
        return _library


def _check_weight(weight: torch.Tensor, type_id: int, cols: int) -> None:
    name = next((n for n, i in TYPE_IDS.items() if i == type_id), None)
    if name is None:
        raise ValueError(f"ggml type {type_id} is not one the GGUF kernels take ({', '.join(TYPE_IDS)})")
    if (weight.dtype != torch.uint8 or weight.dim() != 2 or cols % BLOCK_VALUES[name]
            or weight.shape[1] != cols // BLOCK_VALUES[name] * BLOCK_BYTES[name] or weight.stride(1) != 1
            or weight.stride(0) != weight.shape[1]):
        raise ValueError(f"a {name} weight of {cols} columns is uint8 [rows, "
                         f"{cols // BLOCK_VALUES[name] * BLOCK_BYTES[name]}] contiguous; got {weight.dtype} "
                         f"{tuple(weight.shape)}")


# From this many rows a step widens the weight's blocks once and multiplies in
# float32 (the same values, summed by torch's GEMM) instead of widening them
# again for every tile of rows: 0.56-0.65x the time at 512 rows of a 8192 x 2048
# Q4_K / Q8_0 weight, 1.4-1.6x at 128 (2 threads, AMD Zen 4).
WIDEN_ROWS = 256

_ops = torch.library.Library("pagedbackend", "FRAGMENT")
_ops.define("gguf_linear(Tensor x, Tensor[] weights, Tensor[] row_maps, int[] types, int out_features) -> Tensor")
_ops.define("gguf_embedding(Tensor ids, Tensor weight, int type, int cols) -> Tensor")
_ops.define("gguf_linear_q8(Tensor x, Tensor[] weights, Tensor[] row_maps, Tensor[] panels, int[] types, "
            "int out_features) -> Tensor")


def int8_activations_unavailable() -> Optional[str]:
    """Why the int8-activation products cannot run here (None: they can)."""
    try:
        lib = load_library()
    except RuntimeError as exc:
        return str(exc)
    return None if lib.gguf_gemm_q8_usable() else "they need a CPU with AVX-512 VNNI"


def _check_parts(x, weights, row_maps, types, out_features) -> List[int]:
    """Each part's row count, after checking the parts against x."""
    cols = x.shape[1]
    parts = len(weights)
    if not (parts == len(row_maps) == len(types)) or parts == 0:
        raise ValueError("gguf_linear takes one row map and type per weight")
    sizes = []
    for weight, row_map, type_id in zip(weights, row_maps, types):
        _check_weight(weight, type_id, cols)
        if row_map.numel() and (row_map.dtype != torch.int64 or row_map.numel() != weight.shape[0]):
            raise ValueError("a row map has one int64 index per weight row")
        sizes.append(weight.shape[0])
    if sum(sizes) != out_features:
        raise ValueError(f"gguf_linear weights have {sum(sizes)} rows, not {out_features}")
    return sizes


def _call_parts(function, xf, weights, row_maps, types, sizes, out_features, panels=None) -> torch.Tensor:
    """``function`` (``gguf_gemm_parts``, or ``gguf_gemm_q8_panels`` with ``panels``) into a new float32 y."""
    rows, cols = xf.shape
    parts = len(weights)
    y = torch.empty((rows, out_features), dtype=torch.float32)
    if rows:
        ptrs = (ctypes.c_void_p * parts)(*[w.data_ptr() for w in weights])
        maps = (ctypes.c_void_p * parts)(*[m.data_ptr() if m.numel() else None for m in row_maps])
        kinds = (ctypes.c_int * parts)(*types)
        counts = (ctypes.c_int64 * parts)(*sizes)
        tail = (kinds, counts, y.data_ptr(), torch.get_num_threads())
        if panels is not None:
            tail = ((ctypes.c_void_p * parts)(*[q.data_ptr() if q.numel() else None for q in panels]),) + tail
        code = function(xf.data_ptr(), rows, cols, parts, ptrs, maps, *tail)
        if code:
            raise ValueError({-2: "the int8-activation GGUF products need a CPU with AVX-512 VNNI",
                              -3: "no memory for the int8 activations"}.get(
                                  code, "gguf_gemm refused the weights (type or shape)"))
    return y


def _gguf_linear_cpu(x, weights, row_maps, types, out_features):
    """``x W^T`` for 2-D ``x``, W the rows of ``weights`` (GGUF blocks of ``types``) one after another."""
    rows, cols = x.shape
    sizes = _check_parts(x, weights, row_maps, types, out_features)
    xf = x.to(torch.float32).contiguous()
    if rows >= WIDEN_ROWS:   # a long prefill chunk: widen each block once, then one float32 GEMM
        widened = [_gguf_embedding_cpu(m if m.numel() else torch.arange(w.shape[0]), w, t, cols)
                   for w, m, t in zip(weights, row_maps, types)]
        y = onednn_linear.dense_linear(xf, torch.cat(widened))
        return y if x.dtype == torch.float32 else y.to(x.dtype)
    y = _call_parts(load_library().gguf_gemm_parts, xf, weights, row_maps, types, sizes, out_features)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def _gguf_linear_q8_cpu(x, weights, row_maps, panels, types, out_features):
    """``gguf_linear`` with x rounded to int8 (the module's docstring), reading
    part i from ``panels[i]`` where that is not empty (``pack_panels``)."""
    sizes = _check_parts(x, weights, row_maps, types, out_features)
    if len(panels) != len(weights):
        raise ValueError("gguf_linear_q8 takes one panel tensor (or an empty one) per weight")
    lib = load_library()
    for panel, size, type_id in zip(panels, sizes, types):
        if panel.numel() and (panel.dtype != torch.uint8 or not panel.is_contiguous()
                              or panel.numel() != lib.gguf_panel_bytes(type_id, size, x.shape[1])):
            raise ValueError("a panel tensor is the contiguous uint8 panel copy of its weight")
    y = _call_parts(lib.gguf_gemm_q8_panels, x.to(torch.float32).contiguous(), weights, row_maps,
                    types, sizes, out_features, panels)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def pack_panels(weight: torch.Tensor, row_map: torch.Tensor, type_id: int, cols: int) -> torch.Tensor:
    """The panel copy of a weight for the int8-activation products (the
    kernel's "int8 activations on panels"), rows in the row map's order; an
    empty tensor for a type without panels."""
    lib = load_library()
    rows = row_map.numel() or weight.shape[0]
    size = lib.gguf_panel_bytes(type_id, rows, cols)
    out = hugepages.empty((size,), torch.uint8)
    if size and lib.gguf_panel_pack(type_id, weight.data_ptr(), row_map.data_ptr() if row_map.numel() else None,
                                    rows, cols, out.data_ptr(), torch.get_num_threads()):
        raise ValueError("gguf_panel_pack refused the weight")
    return out


def _gguf_linear_fake(x, weights, row_maps, types, out_features):
    return x.new_empty((x.shape[0], out_features))


def _gguf_linear_q8_fake(x, weights, row_maps, panels, types, out_features):
    return x.new_empty((x.shape[0], out_features))


def _gguf_embedding_cpu(ids, weight, type_id, cols):
    _check_weight(weight, type_id, cols)
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty((flat.numel(), cols), dtype=torch.float32)
    if flat.numel() and load_library().gguf_get_rows(weight.data_ptr(), flat.data_ptr(), out.data_ptr(),
                                                     flat.numel(), cols, weight.shape[0], weight.shape[1],
                                                     type_id):
        raise IndexError(f"token id outside the vocabulary of {weight.shape[0]}")
    return out.view(*ids.shape, cols)


def _gguf_embedding_fake(ids, weight, type_id, cols):
    return torch.empty((*ids.shape, cols), dtype=torch.float32, device=ids.device)


def native_ops_usable() -> bool:
    """Whether layers call the C++ operators: the process's ``native_ops``
    setting is on and ``csrc/packed_ops.cpp`` builds (once per process)."""
    global _native
    with _native_lock:
        if _native is None:
            from pagedbackend.kernels.packed_linear import native_ops
            _native = False
            if native_ops().settings[0]:
                try:
                    _hand_over(native.load_op_library("packed_ops"))
                    _native = True
                except RuntimeError:
                    pass   # the Python operators serve (no C++ compiler, or torch's headers missing)
        return _native


_native: Optional[bool] = None
_native_lock = threading.Lock()


def _hand_over(ops: ctypes.CDLL) -> None:
    lib = load_library()
    names = list(TYPE_IDS)
    address = lambda f: ctypes.cast(f, ctypes.c_void_p)   # noqa: E731
    ops.gguf_ops_set_kernels(address(lib.gguf_gemm_parts), address(lib.gguf_gemm_q8_panels),
                             address(lib.gguf_get_rows), address(lib.gguf_panel_bytes), WIDEN_ROWS, len(names),
                             (ctypes.c_int * len(names))(*[TYPE_IDS[n] for n in names]),
                             (ctypes.c_longlong * len(names))(*[BLOCK_VALUES[n] for n in names]),
                             (ctypes.c_longlong * len(names))(*[BLOCK_BYTES[n] for n in names]),
                             ",".join(names).encode())
    ops.packed_ops_set_prefill(int(onednn_linear.unavailable() is None))   # its widened GEMM, as dense_linear
    torch.library.register_fake("pagedbackend::gguf_linear_native")(_gguf_linear_fake)
    torch.library.register_fake("pagedbackend::gguf_linear_q8_native")(_gguf_linear_q8_fake)


_ops.impl("gguf_linear", _gguf_linear_cpu, "CPU")
_ops.impl("gguf_embedding", _gguf_embedding_cpu, "CPU")
_ops.impl("gguf_linear_q8", _gguf_linear_q8_cpu, "CPU")
torch.library.register_fake("pagedbackend::gguf_linear")(_gguf_linear_fake)
torch.library.register_fake("pagedbackend::gguf_embedding")(_gguf_embedding_fake)
torch.library.register_fake("pagedbackend::gguf_linear_q8")(_gguf_linear_q8_fake)


class GGUFLinear(nn.Module):
    """``x W^T`` (no bias: the caller adds it), W the rows of ``shards`` one
    after another: each a uint8 ``[rows, row bytes]`` GGUF tensor of ``type``
    (a name of ``TYPE_IDS``), with an optional row map (``W[i] = shard[map[i]]``)."""

    def __init__(self, shards: Sequence[torch.Tensor], types: Sequence[str], in_features: int,
                 row_maps: Optional[Sequence[Optional[torch.Tensor]]] = None):
        super().__init__()
        row_maps = list(row_maps or [None] * len(shards))
        self.in_features = in_features
        self.types: List[int] = [TYPE_IDS[t] for t in types]
        self.type_names = list(types)
        # Buffers (so a compiled step takes them as the module's state), not saved
        # with it: views into the file's mapping, never copied.
        self.parts = len(shards)
        for i, (weight, type_id, row_map) in enumerate(zip(shards, self.types, row_maps)):
            _check_weight(weight, type_id, in_features)
            self.register_buffer(f"blocks{i}", weight, persistent=False)
            self.register_buffer(f"row_map{i}", torch.empty(0, dtype=torch.int64) if row_map is None
                                 else row_map.to(torch.int64).contiguous(), persistent=False)
        self.out_features = sum(w.shape[0] for w in shards)
        self._int8_activations = False
        load_library()
        self.native = False   # the C++ operators: set by quant.policy (native_ops_usable)

    @property
    def int8_activations(self) -> bool:
        return self._int8_activations

    @int8_activations.setter
    def int8_activations(self, on: bool) -> None:
        """On: x rounded to int8 (the module's docstring); the parts whose type
        has panels are copied into them once (as many bytes as their blocks),
        and those copies are what the products read."""
        self._int8_activations = bool(on)
        for i in range(self.parts):
            panel = (pack_panels(self.weights[i], self.row_maps[i], self.types[i], self.in_features) if on
                     else torch.empty(0, dtype=torch.uint8))
            self.register_buffer(f"panel{i}", panel, persistent=False)

    @property
    def panels(self) -> List[torch.Tensor]:
        return [getattr(self, f"panel{i}", torch.empty(0, dtype=torch.uint8)) for i in range(self.parts)]

    @property
    def weights(self) -> List[torch.Tensor]:
        return [getattr(self, f"blocks{i}") for i in range(self.parts)]

    @property
    def row_maps(self) -> List[torch.Tensor]:
        return [getattr(self, f"row_map{i}") for i in range(self.parts)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        ops = torch.ops.pagedbackend
        if self.int8_activations:
            op = ops.gguf_linear_q8_native if self.native else ops.gguf_linear_q8
            y = op(flat, self.weights, self.row_maps, self.panels, self.types, self.out_features)
        else:
            op = ops.gguf_linear_native if self.native else ops.gguf_linear
            y = op(flat, self.weights, self.row_maps, self.types, self.out_features)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 ``[out, in]`` weight the kernel multiplies by (for tests)."""
        return torch.cat([self._shard(i) for i in range(len(self.weights))])

    def _shard(self, i: int) -> torch.Tensor:
        ids = torch.arange(self.weights[i].shape[0]) if not self.row_maps[i].numel() else self.row_maps[i]
        return torch.ops.pagedbackend.gguf_embedding(ids, self.weights[i], self.types[i], self.in_features)


class GGUFEmbedding(nn.Module):
    """Token embeddings from a GGUF tensor: the rows of the step's tokens, widened."""

    def __init__(self, weight: torch.Tensor, type_name: str, cols: int, dtype: torch.dtype):
        super().__init__()
        _check_weight(weight, TYPE_IDS[type_name], cols)
        self.register_buffer("weight_blocks", weight, persistent=False)   # a view into the file's mapping
        self.type_id, self.cols, self.dtype = TYPE_IDS[type_name], cols, dtype
        self.num_embeddings, self.embedding_dim = weight.shape[0], cols

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.ops.pagedbackend.gguf_embedding(ids, self.weight_blocks, self.type_id, self.cols)
        return out if self.dtype == torch.float32 else out.to(self.dtype)
