"""The GGUF block-quantized GEMM of csrc/cpu/quant_kernels.c: y = x @ W^T with W [N, K] in
GGML's Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1 blocks (32 elements) or Q4_K / Q6_K super-blocks (256
elements), the activations quantized per 32-element block to two int8 digits inside the call
(see the C file's header for the exact math). `gemm_parts` multiplies by several weights of
different types at once (a fused Q/K/V of a Q4_K_M file), their outputs side by side.

Built and loaded like the float32 kernels (vllm/kernels/cpu_kernels.py: one library per instruction-set
variant, the same flags, cache and CPU key); the avx512 variant uses vpdpbusd where the CPU has
avx512_vnni. The x86 variants convert fp16 with F16C: a CPU with AVX2 but no F16C (none is
known) gets the generic variant.
"""
import ctypes
import functools
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from vllm.kernels import cpu_kernels

_HERE = Path(__file__).resolve().parent
SOURCE = next((p for p in (_HERE.parent / "_csrc" / "quant_kernels.c",
                           _HERE.parent.parent / "csrc" / "cpu" / "quant_kernels.c") if p.exists()), None)

# GGML type ids (gguf.GGMLQuantizationType) -> bytes per block, elements per block
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K = 2, 3, 6, 7, 8, 12, 14
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, Q4_K: 144, Q6_K: 210}
BLOCK_ELEMS = {Q4_0: 32, Q4_1: 32, Q5_0: 32, Q5_1: 32, Q8_0: 32, Q4_K: 256, Q6_K: 256}
TYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0",
              Q4_K: "Q4_K", Q6_K: "Q6_K"}
BF16 = 30               # GGML's bfloat16: no blocks; the float32 GEMM's bf16 panels take it
TYPE_NAMES[BF16] = "BF16"
BLOCK = 32              # the activations' block
MAX_PARTS = 8           # weights per gemm_parts call
PACKED = 0x100          # qtype flag: the weight is in repack()'s layout

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@functools.lru_cache(maxsize=None)
def library(isa: str) -> Optional[ctypes.CDLL]:
    """quant_kernels.c compiled for `isa` (one this CPU runs), or None (no compiler, or
    VLLM_CPU_KERNELS=0)."""
    if SOURCE is None:
        return None
    lib = cpu_kernels.library(isa, SOURCE)
    if lib is None:
        return None
    lib.vq_isa.restype = ctypes.c_char_p
    lib.vq_block_bytes.argtypes = [_int]
    lib.vq_block_bytes.restype = _int
    lib.vq_block_elems.argtypes = [_int]
    lib.vq_block_elems.restype = _int
    lib.vq_uses_vnni.restype = _int
    lib.vq_set_vnni.argtypes = [_int]
    lib.vq_set_vnni.restype = _int
    lib.vq_quantize_rows.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr]
    lib.vq_quantize_rows.restype = None
    lib.vq_gemm.argtypes = [_int, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr]
    lib.vq_gemm.restype = _int
    lib.vq_gemm_parts.argtypes = [_int, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr]
    lib.vq_gemm_parts.restype = _int
    lib.vq_gemm_grouped.argtypes = [_int, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr]
    lib.vq_gemm_grouped.restype = _int
    lib.vq_packs.argtypes = [_int]
    lib.vq_packs.restype = _int
    lib.vq_packed_bytes.argtypes = [_int, _i64, _i64]
    lib.vq_packed_bytes.restype = _i64
    lib.vq_repack.argtypes = [_int, _ptr, _i64, _i64, _ptr]
    lib.vq_repack.restype = _int
    assert lib.vq_isa().decode() == isa
    assert all(lib.vq_block_bytes(t) == BLOCK_BYTES[t] and lib.vq_block_elems(t) == BLOCK_ELEMS[t]
               for t in BLOCK_BYTES)
    return lib


@functools.lru_cache(maxsize=None)
def _has_f16c() -> bool:
    """(Cached: it reads /proc/cpuinfo.)"""
    return any(line.startswith("flags") and "f16c" in line.split()
               for line in cpu_kernels._cpu_model().splitlines())


def active_isa() -> str:
    isa = cpu_kernels.active_isa()
    return isa if isa == "generic" or _has_f16c() else "generic"


def available() -> bool:
    return library(active_isa()) is not None


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one K-element row in `qtype`'s blocks (K a multiple of its block)."""
    assert k % BLOCK_ELEMS[qtype] == 0, (TYPE_NAMES[qtype], k)
    return k // BLOCK_ELEMS[qtype] * BLOCK_BYTES[qtype]


def packs(qtype: int, isa: Optional[str] = None) -> bool:
    """Whether the `isa` variant (default the active one) multiplies `qtype` repacked (x86
    builds: Q4_0, Q4_1, Q8_0; the avx2 build Q5_0, Q4_K and Q6_K too); there repack() at load
    is the faster layout at every batch."""
    lib = library(isa or active_isa())
    return lib is not None and bool(lib.vq_packs(qtype))


def packed_row_bytes(qtype: int, k: int, isa: Optional[str] = None) -> int:
    """Bytes per column of a K-element weight in repack()'s layout: row_bytes(qtype, k), but for
    the types whose records are wider than their blocks: Q4_K's float32 scales and mins per 32
    elements (24 bytes against 18), Q6_K's fp16 d per 32 elements, not 256 (28 against 26.25),
    and Q5_0 in Q8_0's records (34 against 22)."""
    return library(isa or active_isa()).vq_packed_bytes(qtype, 16, k) // 16


def repack(blocks: torch.Tensor, qtype: int, isa: Optional[str] = None) -> torch.Tensor:
    """W [N, row_bytes] in `qtype`'s GGML blocks -> the same weight with 16 columns interleaved
    per 32-element block (quant_kernels.c, "repacked at load"): uint8 [N rounded up to 16,
    packed_row_bytes], multiplied as qtype | PACKED with the GEMM's n = N."""
    assert blocks.dtype == torch.uint8 and blocks.dim() == 2 and blocks.is_contiguous()
    if not packs(qtype, isa):
        raise ValueError(f"{TYPE_NAMES.get(qtype, qtype)} weights are not repacked by the "
                         f"{isa or active_isa()} quant kernels (see packs())")
    n, k = blocks.shape[0], blocks.shape[1] // BLOCK_BYTES[qtype] * BLOCK_ELEMS[qtype]
    assert blocks.shape[1] == row_bytes(qtype, k)
    lib = library(isa or active_isa())
    out = torch.empty((n + 15) // 16 * 16, packed_row_bytes(qtype, k, isa), dtype=torch.uint8)
    assert out.numel() == lib.vq_packed_bytes(qtype, n, k)
    assert lib.vq_repack(qtype, blocks.data_ptr(), n, k, out.data_ptr()) == 0
    return out


def _check_weight(blocks: torch.Tensor, qtype: int, n: int, k: int):
    """A weight's bytes: [n, row_bytes] blocks, or repack()'s [n rounded up to 16,
    packed_row_bytes]."""
    assert blocks.dtype == torch.uint8 and blocks.is_contiguous() and blocks.dim() == 2
    if qtype & PACKED:
        shape = ((n + 15) // 16 * 16, packed_row_bytes(qtype & ~PACKED, k))
    else:
        shape = (n, row_bytes(qtype, k))
    assert blocks.shape == shape, (blocks.shape, n, k)


def _check_io(x: torch.Tensor, k: int, n: int, bias, residual):
    x = x.contiguous()
    assert x.dtype == torch.float32 and x.shape[1] == k
    if residual is not None:
        residual = residual.contiguous()
        assert residual.shape == (x.shape[0], n) and residual.dtype == torch.float32
    if bias is not None:
        assert bias.dtype == torch.float32 and bias.is_contiguous() and bias.numel() == n
    return x, residual


def _ptr_or_none(t: Optional[torch.Tensor]):
    return None if t is None else t.data_ptr()


def gemm(x: torch.Tensor, blocks: torch.Tensor, qtype: int, n: int, k: int,
         bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
         isa: Optional[str] = None) -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, N] (+ bias [N]) (+ residual [M, N]); `blocks` uint8
    [N, row_bytes(qtype, K)] holds W in `qtype`'s GGML blocks (qtype | PACKED: repack()'s
    layout). isa: the variant (default the active one)."""
    _check_weight(blocks, qtype, n, k)
    x, residual = _check_io(x, k, n, bias, residual)
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    rc = library(isa or active_isa()).vq_gemm(
        qtype, blocks.data_ptr(), n, k, x.data_ptr(), x.shape[0], _ptr_or_none(bias),
        _ptr_or_none(residual), y.data_ptr())
    assert rc == 0, "vq_gemm failed (out of memory?)"
    return y


class Parts:
    """Weights for gemm_parts: (blocks uint8 [N_p, row_bytes(qtype_p, K)], qtype_p), or
    (repack()'s blocks, qtype_p | PACKED, N_p), up to MAX_PARTS, their outputs side by side
    (N = sum N_p). The C call's argument arrays are built once, so the tensors must stay in place
    (the engine never moves its model)."""

    def __init__(self, parts: Sequence[tuple], k: int):
        assert 1 <= len(parts) <= MAX_PARTS
        ns = [part[2] if len(part) == 3 else part[0].shape[0] for part in parts]
        for (blocks, qtype, *_), n in zip(parts, ns):
            _check_weight(blocks, qtype, n, k)
        p = len(parts)
        self.tensors = [part[0] for part in parts]
        self.count, self.k, self.n = p, k, sum(ns)
        self.types = (ctypes.c_int * p)(*(part[1] for part in parts))
        self.ptrs = (ctypes.c_void_p * p)(*(part[0].data_ptr() for part in parts))
        self.ns = (ctypes.c_int64 * p)(*ns)


def gemm_parts(x: torch.Tensor, parts: Parts, bias: Optional[torch.Tensor] = None,
               residual: Optional[torch.Tensor] = None,
               isa: Optional[str] = None) -> torch.Tensor:
    """x [M, K] float32 @ [W_0; W_1; ...]^T -> [M, N] (+ bias [N]) (+ residual [M, N]), x
    quantized once for all of them."""
    x, residual = _check_io(x, parts.k, parts.n, bias, residual)
    y = torch.empty(x.shape[0], parts.n, dtype=torch.float32)
    rc = library(isa or active_isa()).vq_gemm_parts(
        parts.count, parts.types, parts.ptrs, parts.ns, parts.k, x.data_ptr(), x.shape[0],
        _ptr_or_none(bias), _ptr_or_none(residual), y.data_ptr())
    assert rc == 0, "vq_gemm_parts failed (out of memory?)"
    return y


class Grouped:
    """Weights for gemm_grouped, one per group (a mixture of experts' experts): (blocks, qtype)
    or repack()'s (blocks, qtype | PACKED), every one n rows of k, with a bias [n] or None
    each. The C call's argument arrays are built once (the tensors must stay in place)."""

    def __init__(self, weights: Sequence[tuple], n: int, k: int,
                 biases: Optional[Sequence[Optional[torch.Tensor]]] = None):
        for blocks, qtype in weights:
            _check_weight(blocks, qtype, n, k)
        g = len(weights)
        self.count, self.n, self.k = g, n, k
        self.tensors = [w[0] for w in weights]
        self.types = (ctypes.c_int * g)(*(w[1] for w in weights))
        self.ptrs = (ctypes.c_void_p * g)(*(w[0].data_ptr() for w in weights))
        self.bias_tensors = list(biases) if biases is not None else [None] * g
        for b in self.bias_tensors:
            assert b is None or (b.dtype == torch.float32 and b.is_contiguous() and
                                 b.numel() == n)
        self.biases = (ctypes.c_void_p * g)(*(_ptr_or_none(b) for b in self.bias_tensors))


def gemm_grouped(x: torch.Tensor, grouped: Grouped, offsets: torch.Tensor,
                 isa: Optional[str] = None) -> torch.Tensor:
    """x [P, K] float32, its rows grouped: offsets int64 [G + 1] (0, ..., P), rows offsets[g] ..
    offsets[g + 1] go through weight g -> [P, N] (+ that weight's bias); x quantized row by
    row as gemm() does, every group's columns in one parallel loop."""
    x = x.contiguous()
    assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == grouped.k
    assert offsets.dtype == torch.int64 and offsets.is_contiguous() and \
        offsets.numel() == grouped.count + 1
    y = torch.empty(x.shape[0], grouped.n, dtype=torch.float32)
    rc = library(isa or active_isa()).vq_gemm_grouped(
        grouped.count, grouped.types, grouped.ptrs, grouped.biases, grouped.n, grouped.k,
        x.data_ptr(), offsets.data_ptr(), y.data_ptr())
    assert rc == 0, "vq_gemm_grouped failed (bad offsets, or out of memory?)"
    return y


def quantize_activations(x: np.ndarray):
    """The kernel's activation quantization in numpy float32, bit for bit: x [M, K] ->
    (q, e int8 [M, K], d, ed, s float32 [M, K/32]); x ~ d * q + ed * e per block."""
    x = np.asarray(x, dtype=np.float32)
    m, k = x.shape
    xb = x.reshape(m, k // BLOCK, BLOCK)
    amax = np.abs(xb).max(axis=-1)
    d = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv[..., None]), -127, 127).astype(np.float32)
    ed = (d / np.float32(254.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv_e = np.where(ed != 0, np.float32(1.0) / ed, np.float32(0.0)).astype(np.float32)
    # fma(-d, q, x): exact in float64, then rounded once to float32
    r = (xb.astype(np.float64) - d[..., None].astype(np.float64) * q).astype(np.float32)
    e = np.clip(np.rint(r * inv_e[..., None]), -127, 127).astype(np.float32)
    s = (d * q.sum(-1, dtype=np.float32) + ed * e.sum(-1, dtype=np.float32)).astype(np.float32)
    return (q.astype(np.int8).reshape(m, k), e.astype(np.int8).reshape(m, k), d, ed, s)
