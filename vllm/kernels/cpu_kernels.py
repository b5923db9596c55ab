"""The float32 CPU kernels of csrc/cpu/decode_kernels.c: packed GEMM, paged decode attention,
RMSNorm, SiLU-and-multiply, and rotary embedding fused with the K/V cache write.

The source is built once per instruction-set variant, the one this CPU runs best:
    avx512   CPU flags avx512f (+bw, vl, dq)  -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma
                                              -mf16c
    avx2     CPU flags avx2, fma and f16c     -mavx2 -mfma -mf16c
    generic  anything else (Arm, old x86)     no -m flags: SSE2 / NEON / scalar
VLLM_CPU_ISA=avx512|avx2|generic forces one; forcing one this CPU cannot run is a ValueError.
Compiled on first use with the system C compiler (-O3 -fopenmp and the flags above; x86 variants
also -mtune=native) into <cache root>/cpu_kernels/, keyed by the source's hash, the variant and
the CPU, and loaded with ctypes. The library links the same libgomp as torch, so both share
one OpenMP pool and torch.set_num_threads() governs both. No C compiler, or VLLM_CPU_KERNELS=0
(or VLLM_KERNEL_BACKEND=torch): `available()` is False and callers keep their torch path.
"""
import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from vllm import envs
from vllm.attention import kv_quant

logger = logging.getLogger(__name__)

# an installed wheel carries the source as vllm/_csrc/ (setup.py); a checkout has it in csrc/
_HERE = Path(__file__).resolve().parent
SOURCE = next((p for p in (_HERE.parent / "_csrc" / "decode_kernels.c",
                           _HERE.parent.parent / "csrc" / "cpu" / "decode_kernels.c") if p.exists()), None)
ISAS = ("avx512", "avx2", "generic")
# the CPU flags each variant needs, and how it is compiled
_NEEDS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"},
          "avx2": {"avx2", "fma", "f16c"}, "generic": set()}
_CFLAGS = {"avx512": ["-DVTOK_ISA_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
                      "-mavx512dq", "-mavx2", "-mfma", "-mf16c", "-mtune=native"],
           "avx2": ["-DVTOK_ISA_AVX2", "-mavx2", "-mfma", "-mf16c", "-mtune=native"],
           "generic": []}

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int


class BlockWeight(ctypes.Structure):
    """vtok_qweight: a GEMM kept in GGUF blocks, as quant_kernels.gemm_parts takes it, and the
    address of the quant library's vq_gemm_parts that multiplies it."""
    _fields_ = [("gemm", _ptr), ("nparts", _i64), ("types", _ptr), ("ws", _ptr), ("ns", _ptr)]


class LayerWeights(ctypes.Structure):
    """vtok_layer: one decoder layer's shapes and weights (GEMMs packed float32, or in blocks
    where its *_q pointer is set). It holds raw pointers: the tensors must stay alive and in
    place (the engine never moves its model)."""
    _fields_ = [("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
                ("intermediate", _i64), ("eps", _f32), ("scale", _f32),
                *((name, _ptr) for name in ("ln1", "qkv", "qkv_bias", "o", "o_bias", "ln2",
                                            "gate_up", "down")),
                *((name, ctypes.POINTER(BlockWeight))
                  for name in ("qkv_q", "o_q", "gate_up_q", "down_q")),
                ("bf16", _i64),          # 1: the packed GEMMs hold bf16 (pack_weight(bf16=))
                ("q_norm", _ptr), ("k_norm", _ptr),     # per-head q/k RMSNorm (Qwen3), or None
                # Gemma's post-attention, pre- and post-feedforward norms (None: Llama's)
                ("post_attn", _ptr), ("pre_ffn", _ptr), ("post_ffn", _ptr),
                ("gelu", _i64)]          # 1: GeGLU (tanh GELU), 0: SiLU


def _cpu_model() -> str:
    """The CPU's name and instruction-set flags (a compiled variant is only reused on a match)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
        return "\n".join(l for l in lines if l.startswith(("model name", "flags", "Features")))
    except OSError:
        return platform.processor() or platform.machine()


def cpu_name() -> str:
    for line in _cpu_model().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def runnable_isas() -> List[str]:
    """The variants this CPU can execute, best first ("generic" always)."""
    flags = set()
    for line in _cpu_model().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    on_x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
    return [isa for isa in ISAS if isa == "generic" or (on_x86 and _NEEDS[isa] <= flags)]


@functools.lru_cache(maxsize=None)
def active_isa() -> str:
    """VLLM_CPU_ISA if set (it must be runnable here), else the best runnable variant."""
    forced = envs.VLLM_CPU_ISA
    runnable = runnable_isas()
    if forced is None:
        return runnable[0]
    if forced not in ISAS:
        raise ValueError(f"VLLM_CPU_ISA={forced!r}: expected one of {', '.join(ISAS)}")
    if forced not in runnable:
        raise ValueError(f"VLLM_CPU_ISA={forced!r}: this CPU ({cpu_name()}) cannot run it; "
                         f"it can run {', '.join(runnable)}")
    return forced


def build_key(isa: str, source: Optional[Path] = None) -> str:
    """Names one compiled library: the source (default SOURCE), the variant and the CPU."""
    key = Path(source or SOURCE).read_bytes() + isa.encode() + _cpu_model().encode()
    return hashlib.sha256(key).hexdigest()[:16]


def _build(isa: str, source: Optional[Path] = None) -> Path:
    source = Path(source or SOURCE)
    lib = envs.VLLM_CACHE_ROOT / "cpu_kernels" / f"{source.stem}-{isa}-{build_key(isa, source)}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, "-O3", *_CFLAGS[isa], "-fopenmp", "-fPIC", "-shared", str(source),
                        "-o", str(tmp), "-lm"], check=True, capture_output=True)
        tmp.replace(lib)            # atomic: concurrent builders never load a partial file
    return lib


@functools.lru_cache(maxsize=None)
def library(isa: str, source: Optional[Path] = None) -> Optional[ctypes.CDLL]:
    """The kernels compiled for `isa` (which the caller checked this CPU runs), or None.
    `source`: another C file built the same way (its functions left for the caller to type)."""
    if not envs.VLLM_CPU_KERNELS or (source or SOURCE) is None:
        return None
    try:
        lib = ctypes.CDLL(str(_build(isa, source)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.info("CPU decode kernels (%s) unavailable (%s %s); using torch", isa, e,
                    detail[-500:])
        return None
    if source is not None and Path(source) != SOURCE:
        return lib
    lib.vtok_panel_width.restype = ctypes.c_int
    lib.vtok_isa.restype = ctypes.c_char_p
    lib.vtok_packed_gemm.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _int]
    lib.vtok_packed_gemm.restype = None
    lib.vtok_packed_gemm_bf16.argtypes = lib.vtok_packed_gemm.argtypes
    lib.vtok_packed_gemm_bf16.restype = None
    lib.vtok_decode_attention.argtypes = [_ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64,
                                          _f32, _ptr, _i64, _ptr, _ptr, _i64, _int, _f32, _f32,
                                          _ptr]
    lib.vtok_decode_attention.restype = None
    lib.vtok_fp8_to_float.argtypes = [_ptr, _i64, _int, _ptr]
    lib.vtok_fp8_to_float.restype = None
    lib.vtok_argmax_rows.argtypes = [_ptr, _i64, _i64, _ptr]
    lib.vtok_argmax_rows.restype = None
    lib.vtok_moe_route.argtypes = [_ptr, _i64, _i64, _int, _int, _int, _ptr, _ptr, _ptr]
    lib.vtok_moe_route.restype = _int
    lib.vtok_moe_combine.argtypes = [_ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr]
    lib.vtok_moe_combine.restype = None
    lib.vtok_rms_norm.argtypes = [_ptr, _i64, _i64, _ptr, _f32, _ptr]
    lib.vtok_silu_mul.argtypes = [_ptr, _i64, _i64, _ptr]
    lib.vtok_gelu_tanh_mul.argtypes = [_ptr, _i64, _i64, _ptr]
    lib.vtok_rope_write_kv.argtypes = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr,
                                       _ptr, _int, _f32, _f32, _int]
    layer = ctypes.POINTER(LayerWeights)
    lib.vtok_decode_layer_scratch.argtypes = [layer, _i64, _i64]
    lib.vtok_decode_layer_scratch.restype = _i64
    lib.vtok_decode_layer.argtypes = [layer, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr,
                                      _i64, _ptr, _i64, _ptr, _int, _int, _f32, _f32]
    lib.vtok_decode_layer.restype = _int
    lib.vtok_decode_layers.argtypes = [layer, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64,
                                       _ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _int, _int, _ptr]
    lib.vtok_decode_layers.restype = _int
    assert lib.vtok_isa().decode() == isa
    return lib


def _library() -> Optional[ctypes.CDLL]:
    return library(active_isa())


def available() -> bool:
    return _library() is not None


def panel_width() -> int:
    """Output columns per packed panel in the active variant (one vector: 16 avx512, 8 avx2)."""
    return _panel_width(active_isa())


@functools.lru_cache(maxsize=None)
def _panel_width(isa: str) -> int:
    return library(isa).vtok_panel_width()


def packed_shape(k: int, n: int, isa: Optional[str] = None) -> Tuple[int, int, int]:
    width = _panel_width(isa or active_isa())
    return -(-n // width), k, width


def pack_weight(wt: torch.Tensor, out: Optional[torch.Tensor] = None,
                isa: Optional[str] = None, bf16: bool = False) -> torch.Tensor:
    """wt [K, N] float32 -> panels [ceil(N / PANEL), K, PANEL] (zero columns past N), PANEL =
    the panel width of `isa` (default: the active variant); written into `out` (of
    packed_shape(K, N)) if given. bf16: the panels in bfloat16 (wt rounded to nearest even;
    exact for weights that are bf16 already), multiplied by vtok_packed_gemm_bf16."""
    k, n = wt.shape
    panels, _, width = packed_shape(k, n, isa)
    padded = torch.zeros(k, panels * width, dtype=torch.bfloat16 if bf16 else torch.float32)
    padded[:, :n] = wt
    # PANEL 8: [K, P * 8] -> [K, P, 8] -> [P, K, 8]: panel p holds columns 8p .. 8p + 7
    panels_view = padded.view(k, panels, width).permute(1, 0, 2)
    if out is None:
        return panels_view.contiguous()
    assert out.shape == panels_view.shape and out.is_contiguous()
    return out.copy_(panels_view)


def packed_gemm(x: torch.Tensor, packed: torch.Tensor, n: int,
                bias: Optional[torch.Tensor] = None,
                residual: Optional[torch.Tensor] = None, prefetch: bool = True) -> torch.Tensor:
    """x [M, K] float32 @ the [K, n] weight that `packed` holds, float32 or bfloat16 (+ bias
    [n]) (+ residual [M, n]) -> [M, n]. prefetch False: no next-panel prefetch in decode passes
    (KernelPlan.prefetch says which is faster at M rows)."""
    x = x.contiguous()
    m, k = x.shape
    assert packed.shape[1] == k and packed.shape[2] == panel_width() and x.dtype == torch.float32
    if residual is not None:
        residual = residual.contiguous()
        assert residual.shape == (m, n) and residual.dtype == torch.float32
    assert packed.dtype in (torch.float32, torch.bfloat16) and packed.is_contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    gemm = (_library().vtok_packed_gemm_bf16 if packed.dtype == torch.bfloat16
            else _library().vtok_packed_gemm)
    gemm(x.data_ptr(), m, k, packed.data_ptr(), n, None if bias is None else bias.data_ptr(),
         None if residual is None else residual.data_ptr(), y.data_ptr(), prefetch)
    return y


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                     lens: torch.Tensor, scale: float,
                     mass: Optional[torch.Tensor] = None,
                     sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [B, H, D], kv_cache [S, 2, KVH, D], slots int64 [B, W] (the first lens[b] <= W of row b
    are its view; negative = padding) -> [B, H, D]. mass float32 [B, >= Lmax], if given,
    += each key's attention probability summed over the H heads. kv_cache float32, or fp8
    (e4m3fn / e5m2) read with its layer's scales (kv_quant.layer_scales). sinks float32 [H],
    if given: each head's sink logit, one more term of its softmax denominator."""
    b, h, d = q.shape
    kvh = kv_cache.shape[2]
    q = q.contiguous()
    fmt = kv_quant.FORMAT_CODES.get(kv_cache.dtype)
    k_scale, v_scale = kv_quant.layer_scales(kv_cache)
    assert q.dtype == torch.float32 and fmt is not None and kv_cache.is_contiguous()
    assert slots.dtype == torch.int64 and slots.stride(1) == 1
    lens = lens.contiguous()
    lmax = _width(slots)                            # every lens[b] <= the views' width
    probs = torch.empty(b, h, -(-lmax // 16) * 16, dtype=torch.float32)   # rows padded to 16
    out = torch.empty(b, h, d, dtype=torch.float32)
    if mass is not None:
        assert mass.dtype == torch.float32 and mass.stride(1) == 1
    if sinks is not None:
        sinks = sinks.contiguous()
        assert sinks.dtype == torch.float32 and sinks.shape == (h,) and not sinks.is_cuda
    _library().vtok_decode_attention(
        q.data_ptr(), kv_cache.data_ptr(), slots.data_ptr(), slots.stride(0), lens.data_ptr(),
        b, h, kvh, d, scale, probs.data_ptr(), lmax, out.data_ptr(),
        None if mass is None else mass.data_ptr(), 0 if mass is None else mass.stride(0),
        fmt, k_scale, v_scale, None if sinks is None else sinks.data_ptr())
    return out


def fp8_to_float(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """raw uint8 [N] holding fp8 values of `dtype` -> float32 [N], widened as the attention
    kernels widen K and V (the cache's scales not applied)."""
    assert raw.dtype == torch.uint8 and raw.dim() == 1
    n = len(raw)
    padded = torch.zeros(-(-n // 16) * 16, dtype=torch.uint8)
    padded[:n] = raw
    out = torch.empty(len(padded), dtype=torch.float32)
    _library().vtok_fp8_to_float(padded.data_ptr(), len(padded), kv_quant.FORMAT_CODES[dtype],
                                 out.data_ptr())
    return out[:n]


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, N] float32 -> int64 [M], each row's first maximal index."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _library().vtok_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out


def moe_route(logits: torch.Tensor, top_k: int, mode: int, renormalize: bool):
    """Router logits [T, E] float32 -> (tokens int64 [T top_k], weights float32 [T top_k],
    offsets int64 [E + 1]): the picks grouped by expert (vtok_moe_route; mode: the routing's
    index in ops.MOE_ROUTINGS)."""
    logits = logits.contiguous()
    t, e = logits.shape
    tokens = torch.empty(t * top_k, dtype=torch.int64)
    weights = torch.empty(t * top_k, dtype=torch.float32)
    offsets = torch.empty(e + 1, dtype=torch.int64)
    rc = _library().vtok_moe_route(logits.data_ptr(), t, e, top_k, mode,
                                   int(renormalize), tokens.data_ptr(), weights.data_ptr(),
                                   offsets.data_ptr())
    assert rc == 0, f"vtok_moe_route: top_k {top_k} of {e} experts"
    return tokens, weights, offsets


def moe_combine(y: torch.Tensor, weights: torch.Tensor, tokens: torch.Tensor,
                num_tokens: int) -> torch.Tensor:
    """y [P, N] float32, the experts' outputs in pick order -> [num_tokens, N], row t the sum
    of its picks' y * weight (vtok_moe_combine)."""
    y = y.contiguous()
    out = torch.empty(num_tokens, y.shape[1], dtype=torch.float32)
    _library().vtok_moe_combine(y.data_ptr(), weights.data_ptr(), tokens.data_ptr(), y.shape[0],
                                y.shape[1], num_tokens, out.data_ptr())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, N] float32, N % 16 == 0 -> x * rsqrt(mean(x^2) + eps) * weight."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _library().vtok_rms_norm(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps,
                             out.data_ptr())
    return out


def _gated(kernel: str, gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [M, 2I] float32, I % 16 == 0 -> act(gate) * up [M, I] by the C `kernel`."""
    gate_up = gate_up.contiguous()
    m, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(m, i, dtype=torch.float32)
    getattr(_library(), kernel)(gate_up.data_ptr(), m, i, out.data_ptr())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (SwiGLU)."""
    return _gated("vtok_silu_mul", gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up (GeGLU)."""
    return _gated("vtok_gelu_tanh_mul", gate_up)


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  slot_mapping: torch.Tensor, kv_cache: torch.Tensor,
                  num_heads: int, spread: Optional[bool] = None) -> torch.Tensor:
    """qkv [T, (H + 2 KVH) D] -> rotated q [T, H, D]; rotated k and v written to kv_cache
    [S, 2, KVH, D] at slot_mapping [T] (int64). cos, sin [T, D] at each token's position.
    An fp8 cache stores them quantized with its layer's scales (set first from this write's
    rotated K and V where --calculate-kv-scales has not calibrated the layer yet). spread
    (default: the cache is fp8, kv_quant.spreads()): q and k also through kv_quant.spread()."""
    t = qkv.shape[0]
    kvh, d = kv_cache.shape[2], kv_cache.shape[3]
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    assert qkv.shape[1] == (num_heads + 2 * kvh) * d and kv_cache.is_contiguous()
    assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
    fmt = kv_quant.FORMAT_CODES[kv_cache.dtype]
    spread = kv_quant.spreads(kv_cache) if spread is None else spread
    if kv_quant.needs_calibration(kv_cache):
        k = qkv[:, num_heads * d:(num_heads + kvh) * d].view(t, kvh, d)
        k1, k2 = k.chunk(2, dim=-1)
        k = k * cos[:, None] + torch.cat((-k2, k1), dim=-1) * sin[:, None]
        kv_quant.calibrate(kv_cache, kv_quant.spread(k) if spread else k,
                           qkv[:, (num_heads + kvh) * d:], slot_mapping)
    k_scale, v_scale = kv_quant.layer_scales(kv_cache)
    q = torch.empty(t, num_heads, d, dtype=torch.float32)
    _library().vtok_rope_write_kv(qkv.data_ptr(), t, num_heads, kvh, d, cos.data_ptr(),
                                  sin.data_ptr(), slot_mapping.data_ptr(), kv_cache.data_ptr(),
                                  q.data_ptr(), fmt, k_scale, v_scale, int(spread))
    return q


def layer_stack(layers: List[LayerWeights]) -> ctypes.Array:
    """The layers as one C array, for decode_layers (copies of the structs: same weights)."""
    return (LayerWeights * len(layers))(*layers)


def decode_layers(layers: ctypes.Array, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  slot_mapping: torch.Tensor, kv_caches: torch.Tensor, views: torch.Tensor,
                  lens: torch.Tensor, mass: Optional[torch.Tensor],
                  scratch: torch.Tensor, prefetch: bool = True) -> torch.Tensor:
    """Decoder layers for M decode tokens in one C call, in place on the residual stream
    x [M, hidden] (contiguous float32); layer i reads and writes kv_caches[i]. Each layer:
    RMSNorm, QKV, rotary + K/V write at slot_mapping, attention over views/lens (mass +=
    probabilities, if given), O + residual, RMSNorm, SiLU MLP + residual. `scratch` from
    decode_scratch(); prefetch as in packed_gemm. An fp8 kv_caches is read and written with
    each layer's scales (kv_quant.scales_of)."""
    m, width = x.shape[0], _width(views)
    assert x.is_contiguous() and x.dtype == torch.float32 and views.stride(1) == 1
    assert kv_caches.is_contiguous() and len(kv_caches) == len(layers)
    fmt = kv_quant.FORMAT_CODES[kv_caches.dtype]
    scales = kv_quant.scales_of(kv_caches) if fmt else None
    rc = _library().vtok_decode_layers(
        layers, len(layers), x.data_ptr(), m, cos.contiguous().data_ptr(),
        sin.contiguous().data_ptr(), slot_mapping.data_ptr(), kv_caches.data_ptr(),
        kv_caches.stride(0), views.data_ptr(), views.stride(0), lens.contiguous().data_ptr(),
        width, None if mass is None else mass.data_ptr(), 0 if mass is None else mass.stride(0),
        scratch.data_ptr(), prefetch, fmt, None if scales is None else scales.data_ptr())
    if rc != 0:
        raise MemoryError("decode_layers: a block GEMM had no memory for its activations")
    return x


def decode_layer(layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_cache: torch.Tensor, views: torch.Tensor,
                 lens: torch.Tensor, mass: Optional[torch.Tensor],
                 scratch: torch.Tensor, prefetch: bool = True) -> torch.Tensor:
    """decode_layers for one layer and its cache kv_cache [S, 2, KVH, D]."""
    return decode_layers(layer_stack([layer]), x, cos, sin, slot_mapping, kv_cache[None], views,
                         lens, mass, scratch, prefetch)


def decode_scratch_floats(layer: LayerWeights, m: int, views: torch.Tensor) -> int:
    """Floats of scratch decode_layer needs over m rows and these views."""
    return _library().vtok_decode_layer_scratch(ctypes.byref(layer), m, _width(views))


def decode_scratch(layer: LayerWeights, m: int, views: torch.Tensor) -> torch.Tensor:
    """Scratch for decode_layer over m rows and these views."""
    return torch.empty(decode_scratch_floats(layer, m, views), dtype=torch.float32)


def _width(views: torch.Tensor) -> int:
    return max(views.shape[1], 1)
