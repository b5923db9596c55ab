"""The KV cache's storage format (--kv-cache-dtype) and its scales.

    auto       the model's own precision (resolve()): on CPU bfloat16 for a model whose weights
               are 16-bit or smaller (a GGUF model, a bf16 checkpoint, --dtype bfloat16), as
               upstream runs those in bf16; float32 for a float32 model (--quantization none,
               --dtype float32); on CUDA the model's dtype
    float32    torch.float32 on CPU (stored as computed; a float32 model's own cache on CUDA)
    bfloat16   torch.bfloat16: half float32's bytes, rounded to nearest even (the CPU kernels
               widen it exactly as they read; on CUDA it is the bf16 model's own cache)
    fp8        = fp8_e4m3
    fp8_e4m3   torch.float8_e4m3fn (max finite 448, 3 mantissa bits)
    fp8_e5m2   torch.float8_e5m2   (max finite 57344, 2 mantissa bits)

An fp8 pool stores x / scale, rounded to nearest even and saturated to the format's largest
finite value; readers dequantize (stored * scale). Each layer has one scale for K and one for V
(per-tensor, upstream's k_scale / v_scale). They are 1.0 (upstream's default) unless
--calculate-kv-scales: then each layer's scales come from the first write to that layer (the
engine's first prefill batch): scale = amax / (max finite / 2), headroom for later tokens up to
twice the first batch's largest magnitude (larger ones saturate).

An fp8 pool stores keys spread (spread()): after the rotary embedding each key head, and each
query head that attention scores against it, becomes H S x, with S fixed sign flips and H the
Walsh-Hadamard matrix / sqrt(B) over blocks of B = D & -D channels (the largest power of two
dividing the head dim). H S is orthogonal, so q.k, key norms and cosines between keys (what
attention and every policy's statistics read) are unchanged, while the few channels where a
post-RoPE key is large spread over all B: an fp8 element's error is relative to its own
magnitude, and spreading spares the small channels the large ones' error on the scores. On the
default model (essay windows of 2,048 tokens), e4m3 at scale 1 costs +1.10% perplexity over
float32 KV with keys stored as computed (KL 0.012), +0.53% spread (KL 0.005); e5m2 +2.1%
spread, +5.1% not. Values are stored as computed (spreading them too changed nothing measurable:
V's share of the error is small).

The scales travel with the cache tensor: register() files them under the cache's storage, and
any view of that cache (one layer's [S, 2, KVH, D], the whole [L, S, 2, KVH, D]) finds its
layers' scales with layer_scales() / scales_of(). An fp8 tensor nobody registered (tests) reads
with scale 1.0. torch on CPU has no fp8 index_put / index_copy: writes and copies go through the
uint8 view of the same bytes (bytes()).

Each layer's scales live twice: host floats (the C kernels' arguments, never a device sync) and
a row of a float32 table on the cache's device that the Triton kernels read through a pointer
(scale_row()):

    table [L, 4]   layer i: (k_scale, v_scale, 1 / k_scale, 1 / v_scale)   16 bytes a row

The table is allocated once by register() and only ever written in place (calibrate(),
set_scales()), so CUDA graphs captured at start-up read the scales that --calculate-kv-scales
sets at the first prefill, after capture. A write with no real token (slot < 0 only: a graph's
warm-up) does not calibrate, and nothing calibrates while a graph is being captured.
"""
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}
# the C kernels' format codes (csrc/cpu/decode_kernels.c KV_F32 / KV_E4M3 / KV_E5M2 / KV_BF16)
FORMAT_CODES = {torch.float32: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2,
                torch.bfloat16: 3}


def is_fp8(t: torch.Tensor) -> bool:
    return is_fp8_dtype(t.dtype)


def is_fp8_dtype(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def resolve(kv_cache_dtype: str, device: str, model_dtype: str, low_bit_weights: bool) -> str:
    """--kv-cache-dtype auto -> the name it stands for; any other name as given.
    low_bit_weights: the model's weights are GGUF blocks or bf16 (a CPU model that computes in
    float32 on weights of 16 bits or fewer)."""
    if kv_cache_dtype != "auto" or device != "cpu":
        return kv_cache_dtype
    if low_bit_weights:
        return "bfloat16"
    return model_dtype if model_dtype in FLOAT_DTYPES else "auto"


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in FLOAT_DTYPES:
        return FLOAT_DTYPES[kv_cache_dtype]
    return FP8_DTYPES[kv_cache_dtype]


def check_device(kv_cache_dtype: str, device: torch.device,
                 model_dtype: torch.dtype = torch.bfloat16) -> None:
    """A clear ValueError, naming the flag, where `device` cannot run this cache format: fp8
    runs on CPU (the C kernels, torch) and on CUDA from sm_80 (Triton; torch without it), but
    Triton has no e4m3fn before sm_89 (Ada, Hopper), so fp8 / fp8_e4m3 there is refused.
    float32 and bfloat16 run on CPU under any model dtype, on CUDA as the model's own cache
    only."""
    if kv_cache_dtype == "auto" or device.type == "cpu":
        return
    flag = f"--kv-cache-dtype {kv_cache_dtype}"
    if kv_cache_dtype in FLOAT_DTYPES:
        if model_dtype != FLOAT_DTYPES[kv_cache_dtype]:
            raise ValueError(f"{flag}: on {device.type} the KV cache is {kv_cache_dtype} only "
                             f"under --dtype {kv_cache_dtype}, not {model_dtype}; use "
                             f"--kv-cache-dtype auto")
        return
    if device.type != "cuda":
        raise ValueError(f"{flag}: an fp8 KV cache runs on cpu and cuda, not {device.type}; "
                         f"use --kv-cache-dtype auto")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        raise ValueError(f"{flag}: sm_{major}{minor} GPU; the fp8 KV cache's kernels need sm_80 "
                         f"or newer; use --kv-cache-dtype auto")
    if FP8_DTYPES[kv_cache_dtype] == torch.float8_e4m3fn and (major, minor) < (8, 9):
        raise ValueError(f"{flag}: sm_{major}{minor} GPU; e4m3 needs sm_89 or newer (Triton has no "
                         f"e4m3fn before Ada); use --kv-cache-dtype fp8_e5m2 or auto")


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def bytes_(t: torch.Tensor) -> torch.Tensor:
    """The uint8 view of an fp8 tensor (the same bytes; index ops work on it), else t."""
    return t.view(torch.uint8) if is_fp8(t) else t


def inverse(scale: float) -> float:
    """The float32 reciprocal writers multiply by (the C kernels compute the same one)."""
    return float(np.float32(1.0 / scale))


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x * (1 / scale), saturated to dtype's finite range, rounded to nearest even (torch's
    cast of the clamped value)."""
    m = fp8_max(dtype)
    y = x.float()
    if scale != 1.0:
        y = y * inverse(scale)
    return y.clamp(-m, m).to(dtype)


def spreads(kv_cache: torch.Tensor) -> bool:
    """Whether this cache holds spread keys (queries against it are spread too)."""
    return is_fp8(kv_cache)


_FLIPS: Dict[Tuple[int, str], torch.Tensor] = {}


def _flips(d: int, device: torch.device) -> torch.Tensor:
    """float32 [d] of +-1: -1 where the low bit of murmur3's 32-bit finalizer of i + 1 is set
    (csrc spread_flips). Device-side integer ops: no host copy, so a CUDA graph may capture the
    first call."""
    key = (d, str(device))
    if key not in _FLIPS:
        m = 0xFFFFFFFF
        x = torch.arange(1, d + 1, dtype=torch.int64, device=device)
        x = x ^ (x >> 16)
        x = (x * 0x85EBCA6B) & m
        x = x ^ (x >> 13)
        x = (x * 0xC2B2AE35) & m
        x = x ^ (x >> 16)
        _FLIPS[key] = 1.0 - 2.0 * (x & 1).to(torch.float32)
    return _FLIPS[key]


_SPREAD_MATRICES: Dict[Tuple[int, str], torch.Tensor] = {}


def spread(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> H S x per head (module docstring), computed in float32 and returned in x's
    dtype. On CPU the butterflies run in csrc spread_head's order, so the C and torch paths
    store the same floats; on CUDA (no C writer) one float32 GEMM against the same map's matrix
    (the butterflies' ~20 small kernels would cost more than the GEMM in an eager step)."""
    if x.is_cuda:
        key = (x.shape[-1], str(x.device))
        if key not in _SPREAD_MATRICES:       # row i = spread(e_i), so x @ M = spread(x)
            eye = torch.eye(x.shape[-1], dtype=torch.float32, device=x.device)
            _SPREAD_MATRICES[key] = spread_butterflies(eye)
        return (x.float() @ _SPREAD_MATRICES[key]).to(x.dtype)
    return spread_butterflies(x)


def spread_butterflies(x: torch.Tensor) -> torch.Tensor:
    """spread() by butterflies, in float32. B = 4, x = [1, 2, 3, 4], no flips: stage 1 pairs
    (0, 1), (2, 3) -> [3, -1, 7, -1]; stage 2 pairs (0, 2), (1, 3) -> [10, -2, -4, 0]; / 2 ->
    [5, -1, -2, 0]."""
    d = x.shape[-1]
    b = d & -d
    y = x.float() * _flips(d, x.device)
    rows = y.numel() // b
    y = y.reshape(rows, b)
    length = 1
    while length < b:
        pairs = y.view(rows, b // (2 * length), 2, length)
        lo, hi = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((lo + hi, lo - hi), dim=2).view(rows, b)
        length *= 2
    norm = float(np.float32(1.0 / np.sqrt(b)))
    return (y * norm).view(x.shape).to(x.dtype)


def dequantize(x: torch.Tensor, scale) -> torch.Tensor:
    """fp8 -> float32 * scale (a float, or a tensor that broadcasts)."""
    y = x.to(torch.float32)
    return y if isinstance(scale, float) and scale == 1.0 else y * scale


@dataclass
class _Scales:
    k: List[float]
    v: List[float]
    calculate: bool
    table: torch.Tensor                   # [L, 4] on the cache's device (module docstring)
    calibrated: List[bool] = field(default_factory=list)
    base: int = 0                         # layer 0's offset in the storage (elements)

    def set(self, i: int, k: float, v: float) -> None:
        """Layer i's scales, as float32 values, on the host and in the device table (in place:
        the pointers graphs captured stay valid)."""
        self.k[i], self.v[i] = float(np.float32(k)), float(np.float32(v))
        row = [self.k[i], self.v[i], inverse(self.k[i]), inverse(self.v[i])]
        self.table[i].copy_(torch.tensor(row, dtype=torch.float32))


_REGISTRY: Dict[int, _Scales] = {}


def gather(kv_cache: torch.Tensor, slots: torch.Tensor,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """kv_cache [S, 2, KVH, D] rows at slots; an fp8 cache's dequantized into dtype (the
    queries' dtype): fp8 -> dtype is exact, then one rounding of x * scale computed in float32
    (dtype's tensor times the float32 scales), with the layer's device scales (no host sync)."""
    if not is_fp8(kv_cache):
        return kv_cache.index_select(0, slots).to(dtype)     # bfloat16 under float32: exact
    kv = bytes_(kv_cache).index_select(0, slots).view(kv_cache.dtype).to(dtype)
    return kv.mul_(scale_row(kv_cache)[:2].view(1, 2, 1, 1))


def write(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
          v: torch.Tensor) -> None:
    """The torch write of this step's K/V [T, KVH, D] into an fp8 cache [S, 2, KVH, D] (slots
    < 0 skipped), through the uint8 view (CPU torch has no fp8 index_put)."""
    calibrate_if_needed(kv_cache, k, v, slot_mapping)
    ks, vs = layer_scales(kv_cache)
    kv = torch.stack((quantize(k, ks, kv_cache.dtype), quantize(v, vs, kv_cache.dtype)), dim=1)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, kv = slot_mapping[keep], kv[keep]
    bytes_(kv_cache)[slot_mapping] = kv.view(torch.uint8)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def register(kv_caches: torch.Tensor, calculate: bool = False) -> None:
    """kv_caches [L, S, 2, KVH, D] (fp8): scales 1.0 per layer; calculate: set each layer's on
    its first write of a real token (calibrate())."""
    layers = kv_caches.shape[0]
    key = _key(kv_caches)
    table = torch.ones(layers, 4, dtype=torch.float32, device=kv_caches.device)
    _REGISTRY[key] = _Scales([1.0] * layers, [1.0] * layers, calculate, table,
                             [not calculate] * layers, kv_caches.storage_offset())
    weakref.finalize(kv_caches, _REGISTRY.pop, key, None)


def _layer_of(kv_cache: torch.Tensor, s: _Scales) -> int:
    """Which layer a [..., S, 2, KVH, D] view starts at, from its offset in the storage past the
    registered cache's own (a pool on huge pages starts part way into its mapping)."""
    per_layer = kv_cache.shape[-4] * kv_cache.shape[-3] * kv_cache.shape[-2] * kv_cache.shape[-1]
    return (kv_cache.storage_offset() - s.base) // max(per_layer, 1)


def layer_scales(kv_cache: torch.Tensor) -> Tuple[float, float]:
    """(k_scale, v_scale) of one layer's cache view [S, 2, KVH, D]; (1, 1) for float caches."""
    if not is_fp8(kv_cache):
        return 1.0, 1.0
    s = _REGISTRY.get(_key(kv_cache))
    if s is None:
        return 1.0, 1.0
    i = _layer_of(kv_cache, s)
    return s.k[i], s.v[i]


def scale_row(kv_cache: torch.Tensor) -> torch.Tensor:
    """The device row (k, v, 1/k, 1/v) float32 [4] of one layer's fp8 cache view: what the
    Triton kernels read through a pointer. The registered table's own row (a stable address);
    an unregistered fp8 tensor (tests) gets a fresh row of ones."""
    assert is_fp8(kv_cache), "scale_row: a float cache has no scales"
    s = _REGISTRY.get(_key(kv_cache))
    if s is None:
        return torch.ones(4, dtype=torch.float32, device=kv_cache.device)
    return s.table[_layer_of(kv_cache, s)]


def scales_of(kv_caches: torch.Tensor) -> torch.Tensor:
    """float32 [L, 2] (k, v) for a stacked cache view [L, S, 2, KVH, D] (on the host)."""
    n = kv_caches.shape[0]
    s = _REGISTRY.get(_key(kv_caches)) if is_fp8(kv_caches) else None
    if s is None:
        return torch.ones(n, 2)
    i = _layer_of(kv_caches, s)
    return torch.tensor([s.k[i:i + n], s.v[i:i + n]], dtype=torch.float32).t().contiguous()


def needs_calibration(kv_cache: torch.Tensor) -> bool:
    if not is_fp8(kv_cache):
        return False
    s = _REGISTRY.get(_key(kv_cache))
    return s is not None and not s.calibrated[_layer_of(kv_cache, s)]


def calibrate_if_needed(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        slot_mapping: Optional[torch.Tensor] = None) -> None:
    """calibrate() on a layer's first write, except while a CUDA graph is being captured (its
    host reads would break the capture, and a graph's tokens are placeholders)."""
    if needs_calibration(kv_cache) and not (kv_cache.is_cuda and
                                            torch.cuda.is_current_stream_capturing()):
        calibrate(kv_cache, k, v, slot_mapping)


def calibrate(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: Optional[torch.Tensor] = None) -> None:
    """--calculate-kv-scales: the layer's scales from this first write's K and V (the tokens
    actually written: slot >= 0). A write without such a token leaves the layer uncalibrated.
    Reads amax on the host: a device sync, once per layer (the first prefill, eager)."""
    s = _REGISTRY[_key(kv_cache)]
    if slot_mapping is not None:
        keep = slot_mapping >= 0
        k, v = k[keep], v[keep]
    if k.numel() == 0:
        return
    half = fp8_max(kv_cache.dtype) / 2
    scales = []
    for x in (k, v):
        amax = float(x.abs().max())
        scales.append(amax / half if 0 < amax < float("inf") else 1.0)
    i = _layer_of(kv_cache, s)
    s.set(i, *scales)
    s.calibrated[i] = True


def set_scales(kv_caches: torch.Tensor, k: List[float], v: List[float]) -> None:
    """Fixed per-layer scales for a registered stacked cache (tests, a checkpoint's scales)."""
    s = _REGISTRY[_key(kv_caches)]
    for i, (ks, vs) in enumerate(zip(k, v)):
        s.set(i, ks, vs)
    s.calibrated = [True] * len(s.k)
