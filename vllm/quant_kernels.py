"""The GGUF block-quantized GEMM of csrc/cpu/quant_kernels.c: y = x @ W^T with W [N, K] in
GGML's Q8_0, Q4_0 or Q4_1 blocks (32 elements, fp16 scales), the activations quantized per
32-element block to two int8 digits inside the call (see the C file's header for the exact
math).

Built and loaded like the float32 kernels (vllm/cpu_kernels.py: one library per instruction-set
variant, the same flags, cache and CPU key); the avx512 variant uses vpdpbusd where the CPU has
avx512_vnni. The x86 variants convert fp16 with F16C: a CPU with AVX2 but no F16C (none is
known) gets the generic variant.
"""
import ctypes
import functools
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from vllm import cpu_kernels

_HERE = Path(__file__).resolve().parent
SOURCE = next((p for p in (_HERE / "_csrc" / "quant_kernels.c",
                           _HERE.parent / "csrc" / "cpu" / "quant_kernels.c") if p.exists()), None)

# GGML type ids (gguf.GGMLQuantizationType) -> bytes per 32-element block
Q4_0, Q4_1, Q8_0 = 2, 3, 8
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
TYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}
BLOCK = 32

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
    lib.vq_uses_vnni.restype = _int
    lib.vq_quantize_rows.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr]
    lib.vq_quantize_rows.restype = None
    lib.vq_gemm.argtypes = [_int, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr]
    lib.vq_gemm.restype = _int
    assert lib.vq_isa().decode() == isa
    return lib


def _has_f16c() -> bool:
    return any(line.startswith("flags") and "f16c" in line.split()
               for line in cpu_kernels._cpu_model().splitlines())


def active_isa() -> str:
    isa = cpu_kernels.active_isa()
    return isa if isa == "generic" or _has_f16c() else "generic"


def available() -> bool:
    return library(active_isa()) is not None


def gemm(x: torch.Tensor, blocks: torch.Tensor, qtype: int, n: int, k: int,
         bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
         isa: Optional[str] = None) -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, N] (+ bias [N]) (+ residual [M, N]); `blocks` uint8
    [N, K / 32 * block bytes] holds W in `qtype`'s GGML blocks. isa: the variant (default the
    active one)."""
    x = x.contiguous()
    m = x.shape[0]
    assert x.dtype == torch.float32 and x.shape[1] == k and k % BLOCK == 0
    assert blocks.dtype == torch.uint8 and blocks.is_contiguous()
    assert blocks.shape == (n, k // BLOCK * BLOCK_BYTES[qtype])
    if residual is not None:
        residual = residual.contiguous()
        assert residual.shape == (m, n) and residual.dtype == torch.float32
    if bias is not None:
        assert bias.dtype == torch.float32 and bias.is_contiguous() and bias.numel() == n
    y = torch.empty(m, n, dtype=torch.float32)
    rc = library(isa or active_isa()).vq_gemm(
        qtype, blocks.data_ptr(), n, k, x.data_ptr(), m,
        None if bias is None else bias.data_ptr(),
        None if residual is None else residual.data_ptr(), y.data_ptr())
    assert rc == 0, "vq_gemm failed (out of memory?)"
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
