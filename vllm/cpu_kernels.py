"""The float32 CPU kernels of csrc/cpu/decode_kernels.c: packed GEMM, paged decode attention,
RMSNorm, SiLU-and-multiply, and rotary embedding fused with the K/V cache write.

Compiled on first use with the system C compiler (-O3 -march=native -fopenmp) into
<cache root>/cpu_kernels/, keyed by the source's hash and the CPU model, and loaded with ctypes.
The library links the same libgomp as torch, so both share one OpenMP pool and
torch.set_num_threads() governs both. No C compiler, or VLLM_CPU_KERNELS=0 (or
VLLM_KERNEL_BACKEND=torch): `available()` is False and callers keep their torch path.
"""
import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
from pathlib import Path
from typing import Optional

import torch

from vllm import envs

logger = logging.getLogger(__name__)

# an installed wheel carries the source as vllm/_csrc/ (setup.py); a checkout has it in csrc/
_HERE = Path(__file__).resolve().parent
SOURCE = next((p for p in (_HERE / "_csrc" / "decode_kernels.c",
                           _HERE.parent / "csrc" / "cpu" / "decode_kernels.c") if p.exists()), None)
PANEL = 16                    # must match PANEL in the C source
MAX_GEMM_ROWS = 128           # the C GEMM's range; above it MKL is faster (compute-bound)

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class LayerWeights(ctypes.Structure):
    """vtok_layer: one decoder layer's shapes and weights (GEMMs packed). It holds raw pointers:
    the tensors must stay alive and in place (the engine never moves its model)."""
    _fields_ = [("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
                ("intermediate", _i64), ("eps", _f32), ("scale", _f32),
                *((name, _ptr) for name in ("ln1", "qkv", "qkv_bias", "o", "o_bias", "ln2",
                                            "gate_up", "down"))]


def _cpu_model() -> str:
    """The CPU's name and instruction-set flags: -march=native code is only valid on a match."""
    try:
        lines = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
        return "\n".join(l for l in lines if l.startswith(("model name", "flags", "Features")))
    except OSError:
        return platform.processor() or platform.machine()


def _build() -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + _cpu_model().encode()).hexdigest()[:16]
    lib = envs.cache_root() / "cpu_kernels" / f"decode_kernels-{key}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared",
                        str(SOURCE), "-o", str(tmp), "-lm"], check=True, capture_output=True)
        tmp.replace(lib)            # atomic: concurrent builders never load a partial file
    return lib


@functools.lru_cache(maxsize=None)
def _library() -> Optional[ctypes.CDLL]:
    if os.environ.get("VLLM_CPU_KERNELS", "1") == "0" or SOURCE is None:
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.info("CPU decode kernels unavailable (%s %s); using torch", e, detail[-500:])
        return None
    lib.vtok_packed_gemm.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr]
    lib.vtok_packed_gemm.restype = None
    lib.vtok_decode_attention.argtypes = [_ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64,
                                          _f32, _ptr, _i64, _ptr, _ptr, _i64]
    lib.vtok_decode_attention.restype = None
    lib.vtok_rms_norm.argtypes = [_ptr, _i64, _i64, _ptr, _f32, _ptr]
    lib.vtok_silu_mul.argtypes = [_ptr, _i64, _i64, _ptr]
    lib.vtok_rope_write_kv.argtypes = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr,
                                       _ptr]
    layer = ctypes.POINTER(LayerWeights)
    lib.vtok_decode_layer_scratch.argtypes = [layer, _i64, _i64]
    lib.vtok_decode_layer_scratch.restype = _i64
    lib.vtok_decode_layer.argtypes = [layer, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr,
                                      _i64, _ptr, _i64, _ptr]
    return lib


def available() -> bool:
    return _library() is not None


def pack_weight(wt: torch.Tensor) -> torch.Tensor:
    """wt [K, N] float32 -> panels [ceil(N / 16), K, 16] (zero columns past N)."""
    k, n = wt.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(k, panels * PANEL, dtype=torch.float32)
    padded[:, :n] = wt
    # [K, P * 16] -> [K, P, 16] -> [P, K, 16]: panel p holds columns 16p .. 16p + 15
    return padded.view(k, panels, PANEL).permute(1, 0, 2).contiguous()


def packed_gemm(x: torch.Tensor, packed: torch.Tensor, n: int,
                bias: Optional[torch.Tensor] = None,
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] float32 @ the [K, n] weight that `packed` holds (+ bias [n])
    (+ residual [M, n]) -> [M, n]."""
    x = x.contiguous()
    m, k = x.shape
    assert packed.shape[1] == k and x.dtype == torch.float32
    if residual is not None:
        residual = residual.contiguous()
        assert residual.shape == (m, n) and residual.dtype == torch.float32
    y = torch.empty(m, n, dtype=torch.float32)
    _library().vtok_packed_gemm(x.data_ptr(), m, k, packed.data_ptr(), n,
                                None if bias is None else bias.data_ptr(),
                                None if residual is None else residual.data_ptr(), y.data_ptr())
    return y


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: Optional[torch.Tensor] = None,
           residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] @ W (+ bias) (+ residual) for any M, W held only as panels: the C GEMM up to
    MAX_GEMM_ROWS rows, else one MKL einsum over the panels (its transient [K, N] copy is cheap
    next to that many rows)."""
    if x.shape[0] <= MAX_GEMM_ROWS:
        return packed_gemm(x, packed, n, bias, residual)
    # x [M, K] . panels [P, K, 16] -> [M, P, 16] -> [M, P * 16]; columns past n are padding
    y = torch.einsum("mk,pkn->mpn", x, packed).reshape(x.shape[0], -1)[:, :n]
    if bias is not None:
        y = y + bias
    return y if residual is None else residual + y


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                     lens: torch.Tensor, scale: float,
                     mass: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [B, H, D], kv_cache [S, 2, KVH, D], slots int64 [B, W] (the first lens[b] <= W of row b
    are its view; negative = padding) -> [B, H, D]. mass float32 [B, >= Lmax], if given,
    += each key's attention probability summed over the H heads."""
    b, h, d = q.shape
    kvh = kv_cache.shape[2]
    q = q.contiguous()
    assert q.dtype == kv_cache.dtype == torch.float32 and kv_cache.is_contiguous()
    assert slots.dtype == torch.int64 and slots.stride(1) == 1
    lens = lens.contiguous()
    lmax = _width(slots)                            # every lens[b] <= the views' width
    probs = torch.empty(b, h, -(-lmax // 16) * 16, dtype=torch.float32)   # rows padded to 16
    out = torch.empty(b, h, d, dtype=torch.float32)
    if mass is not None:
        assert mass.dtype == torch.float32 and mass.stride(1) == 1
    _library().vtok_decode_attention(
        q.data_ptr(), kv_cache.data_ptr(), slots.data_ptr(), slots.stride(0), lens.data_ptr(),
        b, h, kvh, d, scale, probs.data_ptr(), lmax, out.data_ptr(),
        None if mass is None else mass.data_ptr(), 0 if mass is None else mass.stride(0))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, N] float32, N % 16 == 0 -> x * rsqrt(mean(x^2) + eps) * weight."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _library().vtok_rms_norm(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps,
                             out.data_ptr())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [M, 2I] float32, I % 16 == 0 -> silu(gate) * up [M, I]."""
    gate_up = gate_up.contiguous()
    m, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(m, i, dtype=torch.float32)
    _library().vtok_silu_mul(gate_up.data_ptr(), m, i, out.data_ptr())
    return out


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  slot_mapping: torch.Tensor, kv_cache: torch.Tensor,
                  num_heads: int) -> torch.Tensor:
    """qkv [T, (H + 2 KVH) D] -> rotated q [T, H, D]; rotated k and v written to kv_cache
    [S, 2, KVH, D] at slot_mapping [T] (int64). cos, sin [T, D] at each token's position."""
    t = qkv.shape[0]
    kvh, d = kv_cache.shape[2], kv_cache.shape[3]
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    assert qkv.shape[1] == (num_heads + 2 * kvh) * d and kv_cache.is_contiguous()
    assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
    q = torch.empty(t, num_heads, d, dtype=torch.float32)
    _library().vtok_rope_write_kv(qkv.data_ptr(), t, num_heads, kvh, d, cos.data_ptr(),
                                  sin.data_ptr(), slot_mapping.data_ptr(), kv_cache.data_ptr(),
                                  q.data_ptr())
    return q


def decode_layer(layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_cache: torch.Tensor, views: torch.Tensor,
                 lens: torch.Tensor, mass: Optional[torch.Tensor],
                 scratch: torch.Tensor) -> torch.Tensor:
    """One decoder layer for M decode tokens, in place on the residual stream x [M, hidden]
    (contiguous float32): RMSNorm, QKV, rotary + K/V write at slot_mapping, attention over
    views/lens (mass += probabilities, if given), O + residual, RMSNorm, SiLU MLP + residual.
    `scratch` from decode_scratch() can be shared by every layer of a step."""
    m, width = x.shape[0], _width(views)
    assert x.is_contiguous() and x.dtype == torch.float32 and views.stride(1) == 1
    _library().vtok_decode_layer(
        ctypes.byref(layer), x.data_ptr(), m, cos.contiguous().data_ptr(),
        sin.contiguous().data_ptr(), slot_mapping.data_ptr(), kv_cache.data_ptr(),
        views.data_ptr(), views.stride(0), lens.contiguous().data_ptr(), width,
        None if mass is None else mass.data_ptr(), 0 if mass is None else mass.stride(0),
        scratch.data_ptr())
    return x


def decode_scratch(layer: LayerWeights, m: int, views: torch.Tensor) -> torch.Tensor:
    """Scratch for decode_layer over m rows and these views."""
    size = _library().vtok_decode_layer_scratch(ctypes.byref(layer), m, _width(views))
    return torch.empty(size, dtype=torch.float32)


def _width(views: torch.Tensor) -> int:
    return max(views.shape[1], 1)
