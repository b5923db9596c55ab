"""One dispatch point for kernels: CUDA op, Triton kernel or torch fallback.

    op                 CUDA tensors (auto)                          CPU tensors (auto)
    relocate_kv        CUDA op (built on first use), else Triton,    torch index_copy_
                       else torch
    write_kv           Triton (masked store: no host sync)           torch indexing
    decode_attention   Triton                                        C kernel (float32, head_dim a
                                                                    multiple of 16, when built:
                                                                    vllm/cpu_kernels.py), else
                                                                    torch gather + SDPA
    prefill_attention  xformers if installed, else torch SDPA        torch SDPA (no xformers)

The attention layer (vllm/attention/backend.py) reaches every kernel through these functions.

`backend=` (per call) or the VLLM_KERNEL_BACKEND environment variable ("cuda", "triton", "cpu",
"torch") forces a path where that op has it. Triton on CPU needs TRITON_INTERPRET=1 set before
triton is imported, so it is only ever used there when asked for (tests).
"""
import contextlib
import functools
import importlib.util
import os
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

_FORCED = os.environ.get("VLLM_KERNEL_BACKEND") or None


@contextlib.contextmanager
def forced_backend(backend: Optional[str]):
    """As VLLM_KERNEL_BACKEND, for engines built and run inside the block (benchmarks, tests):
    a model decides at construction whether it packs its weights for the C kernels."""
    global _FORCED
    saved, _FORCED = _FORCED, backend
    try:
        yield
    finally:
        _FORCED = saved


@functools.lru_cache(maxsize=None)
def _available(backend: str) -> bool:
    if backend == "cuda":   # the relocation op, JIT-built on first use (vllm/cuda_kernels.py)
        from vllm import cuda_kernels
        return cuda_kernels.load_relocate_op()
    if backend == "cpu":
        from vllm import cpu_kernels
        return cpu_kernels.available()
    if backend in ("triton", "xformers"):
        return importlib.util.find_spec(backend) is not None
    return backend == "torch"


def _pick(backend: Optional[str], on_cuda: bool, auto: tuple) -> str:
    """auto: this op's CUDA preference order, ending in "torch"."""
    if backend is not None:
        assert backend in auto, f"backend {backend!r} not one of {auto}"
        return backend
    if _FORCED in auto:
        return _FORCED
    if not on_cuda:
        return "torch"
    return next(b for b in auto if _available(b))


# ---- relocation ---------------------------------------------------------------------------------
def relocate_kv(kv_caches: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                backend: Optional[str] = None) -> None:
    """kv_caches [L, S, 2, KVH, D]: copy every layer's K and V rows src[i] -> dst[i] in place.

    src and dst never overlap (the planner moves live tokens into dead slots of other blocks).
    """
    if len(src) == 0:
        return
    if backend is None and _FORCED is None and not kv_caches.is_cuda:   # the CPU hot path
        kv_caches.index_copy_(1, dst, kv_caches.index_select(1, src))
        return
    which = _pick(backend, kv_caches.is_cuda, ("cuda", "triton", "torch"))
    if which == "cuda":
        torch.ops.vtoken.relocate_kv(kv_caches, src, dst)
    elif which == "triton":
        from vllm.attention.triton_relocate import relocate_kv as triton_relocate
        triton_relocate(kv_caches, src, dst)
    else:
        dst = dst.to(kv_caches.device)
        kv_caches.index_copy_(1, dst, kv_caches.index_select(1, src.to(kv_caches.device)))


# ---- CPU decode kernels (decode attention here, the packed GEMM in the model's Linear) ----------
def cpu_kernels_enabled() -> bool:
    return _FORCED in (None, "cpu") and _available("cpu")


# ---- KV cache write -----------------------------------------------------------------------------
def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, backend: Optional[str] = None) -> None:
    """kv_cache [S, 2, KVH, D]: this step's K/V [T, KVH, D] into their slots. A slot < 0
    (padding) writes nothing; plain advanced indexing would write slot -1, the pool's last."""
    if _pick(backend, kv_cache.is_cuda, ("triton", "torch")) == "triton":
        from vllm.attention.triton_write_kv import write_kv as triton_write_kv
        triton_write_kv(kv_cache, slot_mapping, k, v)
        return
    kv = torch.stack((k, v), dim=1)
    padded = slot_mapping < 0
    if bool(padded.any()):        # a host check: free on CPU, a sync on CUDA without Triton
        slot_mapping, kv = slot_mapping[~padded], kv[~padded]
    kv_cache[slot_mapping] = kv


# ---- decode attention ---------------------------------------------------------------------------
def decode_backend(q: torch.Tensor) -> str:
    """The path decode_attention takes for q when no backend is named."""
    if not q.is_cuda and q.dtype == torch.float32 and q.shape[-1] % 16 == 0 \
            and cpu_kernels_enabled():
        return "cpu"
    return _pick(None, q.is_cuda, ("triton", "torch"))


def torch_decode_view(slots: torch.Tensor, lens: Optional[torch.Tensor] = None
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The torch path's form of padded views: (gather slots, additive bias [B, 1, 1, Lmax]);
    padding is a negative slot or, where lens is given, an entry past lens[b].

        [[5, 9], [7, -1]] -> gather [[5, 9], [7, 0]], bias [[0, 0], [0, -inf]]
    """
    b, width = slots.shape
    padding = slots < 0
    if lens is not None:
        padding |= torch.arange(width, device=slots.device)[None, :] >= lens[:, None]
    bias = torch.zeros(b, 1, 1, width, device=slots.device)
    return slots.clamp(min=0), bias.masked_fill_(padding[:, None, None, :], float("-inf"))


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                     lens: torch.Tensor, scale: float, mass: Optional[torch.Tensor] = None,
                     backend: Optional[str] = None,
                     torch_view: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
                     ) -> torch.Tensor:
    """q [B, H, D], kv_cache [S, 2, KVH, D], slots [B, Lmax] (first lens[b] valid, padding -1)
    -> [B, H, D].

    mass (float32 [B, Lmax]), if given, += each key's attention probability summed over heads.
    torch_view: torch_decode_view(slots), when the caller keeps it for all layers of a step.
    A row without keys (lens 0, CUDA-graph padding) gives zeros on Triton and the C kernel,
    NaN on torch; either way nobody reads it.
    """
    which = backend or decode_backend(q)
    if which == "cpu":
        from vllm import cpu_kernels
        return cpu_kernels.decode_attention(q, kv_cache, slots, lens, scale, mass)
    if _pick(which, q.is_cuda, ("triton", "torch")) == "triton":
        from vllm.attention.triton_decode import decode_attention as triton_decode
        # the kernel writes out with q's strides; q is a strided view of the QKV projection
        return triton_decode(q.contiguous(), kv_cache, slots, lens, scale, mass)
    gather, bias = torch_view if torch_view is not None else torch_decode_view(slots, lens)
    return _decode_torch(q, kv_cache, gather, bias, scale, mass)


def _decode_torch(q, kv_cache, gather, bias, scale, mass):
    b, h, d = q.shape
    width = gather.shape[1]
    # index_select on the flat view is ~2x faster than advanced indexing on CPU
    kv = kv_cache.index_select(0, gather.view(-1))
    kv = kv.view(b, width, 2, kv_cache.shape[2], d)              # [B, L, 2, KVH, D]
    k = kv[:, :, 0].transpose(1, 2)                              # [B, KVH, L, D]
    v = kv[:, :, 1].transpose(1, 2)
    if mass is None:
        out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=bias, scale=scale,
                                             enable_gqa=True)
        return out.view(b, h, d)
    kvh = k.shape[1]
    qg = q.view(b, kvh, h // kvh, d)                 # query heads grouped by their KV head
    scores = torch.matmul(qg, k.transpose(2, 3)) * scale + bias    # float32, as the bias
    probs = torch.softmax(scores, dim=-1)            # [B, KVH, G, L]
    mass[:, :width] += probs.sum(dim=(1, 2), dtype=torch.float32)
    return torch.matmul(probs.to(v.dtype), v).reshape(b, h, d)


# ---- prefill attention --------------------------------------------------------------------------
def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: Optional[torch.Tensor], scale: float,
                      backend: Optional[str] = None) -> torch.Tensor:
    """q [H, Lq, D], k/v [KVH, Lk, D] -> [H, Lq, D].

    mask [Lq, Lk] bool (True = attend); None = causal with the queries as the last Lq keys
    (query i sees keys 0 .. i + Lk - Lq).
    """
    if _pick(backend, q.is_cuda, ("xformers", "torch")) == "xformers":
        return _prefill_xformers(q, k, v, mask, scale)
    lq, lk = q.shape[1], k.shape[1]
    if mask is None and lq != lk:          # SDPA's is_causal is top-left aligned
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if q.is_cuda:   # a batch dimension: CUDA's fused SDPA kernels take 4-d inputs only
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                              is_causal=mask is None, scale=scale,
                                              enable_gqa=True)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          scale=scale, enable_gqa=True)


def _prefill_xformers(q, k, v, mask, scale):
    import xformers.ops as xops
    from xformers.ops.fmha.attn_bias import LowerTriangularFromBottomRightMask
    h, lq, d = q.shape
    kvh, lk, _ = k.shape
    g = h // kvh
    # grouped-query attention as xformers' 5-d layout [batch, seq, kv_heads, group, dim]:
    # q [H, Lq, D] -> [1, Lq, KVH, G, D];  k [KVH, Lk, D] -> [1, Lk, KVH, G (stride 0), D]
    qx = q.view(kvh, g, lq, d).permute(2, 0, 1, 3).unsqueeze(0)
    kx = k.permute(1, 0, 2)[:, :, None].expand(lk, kvh, g, d).unsqueeze(0)
    vx = v.permute(1, 0, 2)[:, :, None].expand(lk, kvh, g, d).unsqueeze(0)
    if mask is None:
        bias = LowerTriangularFromBottomRightMask()
    else:   # additive bias; its storage is padded to a multiple of 8 keys, as xformers asks
        padded = torch.zeros(lq, -(-lk // 8) * 8, dtype=q.dtype, device=q.device)[:, :lk]
        bias = padded.masked_fill_(~mask, float("-inf")).expand(1, kvh, g, lq, lk)
    out = xops.memory_efficient_attention(qx, kx, vx, attn_bias=bias, scale=scale)
    return out[0].permute(1, 2, 0, 3).reshape(h, lq, d)
