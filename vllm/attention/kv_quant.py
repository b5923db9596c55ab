"""The KV cache's storage format (--kv-cache-dtype) and its scales.

    auto       the model's dtype (float32 on CPU): stored as computed
    fp8        = fp8_e4m3
    fp8_e4m3   torch.float8_e4m3fn (max finite 448, 3 mantissa bits)
    fp8_e5m2   torch.float8_e5m2   (max finite 57344, 2 mantissa bits)

An fp8 pool stores x / scale, rounded to nearest even and saturated to the format's largest
finite value; readers dequantize (stored * scale). Each layer has one scale for K and one for V
(per-tensor, upstream's k_scale / v_scale). They are 1.0 (upstream's default) unless
--calculate-kv-scales: then each layer's scales come from the first write to that layer (the
engine's first prefill batch): scale = amax / (max finite / 2), headroom for later tokens up to
twice the first batch's largest magnitude (larger ones saturate).

The scales travel with the cache tensor: register() files them under the cache's storage, and
any view of that cache (one layer's [S, 2, KVH, D], the whole [L, S, 2, KVH, D]) finds its
layers' scales with layer_scales() / scales_of(). An fp8 tensor nobody registered (tests) reads
with scale 1.0. torch on CPU has no fp8 index_put / index_copy: writes and copies go through the
uint8 view of the same bytes (bytes()).
"""
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}
# the C kernels' format codes (csrc/cpu/decode_kernels.c KV_F32 / KV_E4M3 / KV_E5M2)
FORMAT_CODES = {torch.float32: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return model_dtype
    return FP8_DTYPES[kv_cache_dtype]


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


def dequantize(x: torch.Tensor, scale) -> torch.Tensor:
    """fp8 -> float32 * scale (a float, or a tensor that broadcasts)."""
    y = x.to(torch.float32)
    return y if isinstance(scale, float) and scale == 1.0 else y * scale


@dataclass
class _Scales:
    k: List[float]
    v: List[float]
    calculate: bool
    calibrated: List[bool] = field(default_factory=list)


_REGISTRY: Dict[int, _Scales] = {}


def gather(kv_cache: torch.Tensor, slots: torch.Tensor,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """kv_cache [S, 2, KVH, D] rows at slots; an fp8 cache's dequantized (float32, then dtype:
    the queries' dtype)."""
    kv = kv_cache.index_select(0, slots)
    if not is_fp8(kv_cache):
        return kv
    ks, vs = layer_scales(kv_cache)
    kv = kv.to(torch.float32)
    if ks != 1.0 or vs != 1.0:
        kv *= torch.tensor([ks, vs], dtype=torch.float32).view(1, 2, 1, 1)
    return kv.to(dtype)


def write(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
          v: torch.Tensor) -> None:
    """The torch write of this step's K/V [T, KVH, D] into an fp8 cache [S, 2, KVH, D] (slots
    < 0 skipped), through the uint8 view (CPU torch has no fp8 index_put)."""
    if needs_calibration(kv_cache):
        calibrate(kv_cache, k, v, slot_mapping)
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
    its first write (calibrate())."""
    layers = kv_caches.shape[0]
    key = _key(kv_caches)
    _REGISTRY[key] = _Scales([1.0] * layers, [1.0] * layers, calculate,
                             [not calculate] * layers)
    weakref.finalize(kv_caches, _REGISTRY.pop, key, None)


def _layer_of(kv_cache: torch.Tensor) -> int:
    """Which layer a [..., S, 2, KVH, D] view starts at, from its offset in the storage."""
    per_layer = kv_cache.shape[-4] * kv_cache.shape[-3] * kv_cache.shape[-2] * kv_cache.shape[-1]
    return kv_cache.storage_offset() // max(per_layer, 1)


def layer_scales(kv_cache: torch.Tensor) -> Tuple[float, float]:
    """(k_scale, v_scale) of one layer's cache view [S, 2, KVH, D]; (1, 1) for float caches."""
    if not is_fp8(kv_cache):
        return 1.0, 1.0
    s = _REGISTRY.get(_key(kv_cache))
    if s is None:
        return 1.0, 1.0
    i = _layer_of(kv_cache)
    return s.k[i], s.v[i]


def scales_of(kv_caches: torch.Tensor) -> torch.Tensor:
    """float32 [L, 2] (k, v) for a stacked cache view [L, S, 2, KVH, D]."""
    n = kv_caches.shape[0]
    s = _REGISTRY.get(_key(kv_caches)) if is_fp8(kv_caches) else None
    if s is None:
        return torch.ones(n, 2)
    i = _layer_of(kv_caches)
    return torch.tensor([s.k[i:i + n], s.v[i:i + n]], dtype=torch.float32).t().contiguous()


def needs_calibration(kv_cache: torch.Tensor) -> bool:
    if not is_fp8(kv_cache):
        return False
    s = _REGISTRY.get(_key(kv_cache))
    return s is not None and not s.calibrated[_layer_of(kv_cache)]


def calibrate(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: Optional[torch.Tensor] = None) -> None:
    """--calculate-kv-scales: the layer's scales from this first write's K and V (the tokens
    actually written: slot >= 0)."""
    s = _REGISTRY[_key(kv_cache)]
    i = _layer_of(kv_cache)
    if slot_mapping is not None:
        keep = slot_mapping >= 0
        k, v = k[keep], v[keep]
    half = fp8_max(kv_cache.dtype) / 2
    for which, x in (("k", k), ("v", v)):
        amax = float(x.abs().max()) if x.numel() else 0.0
        scale = amax / half if 0 < amax < float("inf") else 1.0
        getattr(s, which)[i] = float(np.float32(scale))      # a float32 value, as C reads it
    s.calibrated[i] = True


def set_scales(kv_caches: torch.Tensor, k: List[float], v: List[float]) -> None:
    """Fixed per-layer scales for a registered stacked cache (tests, a checkpoint's scales)."""
    s = _REGISTRY[_key(kv_caches)]
    s.k = [float(np.float32(x)) for x in k]
    s.v = [float(np.float32(x)) for x in v]
    s.calibrated = [True] * len(s.k)
