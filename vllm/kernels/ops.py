"""One dispatch point for kernels: CUDA op, Triton kernel or torch fallback.

    op                 CUDA tensors (auto)                          CPU tensors (auto)
    relocate_kv        CUDA kernel (the prebuilt library, else the    torch index_copy_
                       op built on first use: vllm/kernels/cuda_kernels.py),
                       else Triton, else torch
    write_kv           Triton (masked store: no host sync)           torch indexing
    decode_attention   Triton                                        C kernel (float32, head_dim a
                                                                    multiple of 16, when built:
                                                                    vllm/kernels/cpu_kernels.py), else
                                                                    torch gather + SDPA
    prefill_attention  xformers if installed, else torch SDPA        torch SDPA (no xformers)
    prefill_attention_ xformers (block-diagonal causal bias) if       padded torch SDPA (tests; the
      batched          installed, else one padded torch SDPA call     engine runs spans one by one)
    argmax_rows        torch max                                    C kernel (float32), else
                                                                    torch max
    moe_route,         torch (topk, argsort, index_add_)            C kernels (float32), else
      moe_combine                                                   torch

An fp8 KV cache (--kv-cache-dtype fp8*, vllm/attention/kv_quant.py) takes the same paths:
relocation copies its uint8 view (bytes, on every backend); on CUDA the Triton write_kv
quantizes and the Triton decode kernels dequantize in registers, both reading the layer's
scales from device memory; the torch paths (prefill on either device, the decode fallback)
dequantize what they gather (kv_quant.gather) with the same device scales.

Attention sinks (gpt-oss): every attention op takes sinks, float32 [H] or None, one learned
logit per query head that joins each softmax's denominator as a key without a value (so the real
keys' probabilities, and mass / colsum built from them, sum to less than one). The C and Triton
decode kernels fold it into their softmax; the torch paths attend to one more key, K = V = 0,
whose additive bias is the head's sink (`_sdpa_with_sinks`); xformers has no such key, so
prefill with sinks takes torch SDPA on CUDA too.

The attention layer (vllm/attention/backend.py) reaches every kernel through these functions.

`backend=` (per call) or the VLLM_KERNEL_BACKEND environment variable ("cuda", "triton", "cpu",
"torch") forces a path where that op has it. Triton on CPU needs TRITON_INTERPRET=1 set before
triton is imported, so it is only ever used there when asked for (tests).
"""
import contextlib
import functools
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Tuple

import numpy as np

import torch
import torch.nn.functional as F

from vllm import envs
from vllm.attention import kv_quant

_FORCED = envs.VLLM_KERNEL_BACKEND     # read once, at import: relocate_kv's CPU hot path tests it


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
    if backend == "cuda":   # the relocation kernel: prebuilt library or JIT (vllm/kernels/cuda_kernels.py)
        from vllm.kernels import cuda_kernels
        return cuda_kernels.load_relocate_op()
    if backend == "cpu":
        from vllm.kernels import cpu_kernels
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


# ---- host -> device ----------------------------------------------------------------------------
def to_device(host, device: torch.device) -> torch.Tensor:
    """A host tensor or numpy array on `device`: as is on the CPU (numpy zero-copy); elsewhere a
    non-blocking copy from pinned memory (a plain .to("cuda") waits for its copy: a host sync;
    the caching host allocator keeps the staging alive until the copy has run)."""
    t = torch.from_numpy(host) if isinstance(host, np.ndarray) else host
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


# ---- relocation ---------------------------------------------------------------------------------
def relocate_kv(kv_caches: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                backend: Optional[str] = None) -> None:
    """kv_caches [L, S, 2, KVH, D]: copy every layer's K and V rows src[i] -> dst[i] in place.

    src and dst never overlap (the planner moves live tokens into dead slots of other blocks).
    """
    if len(src) == 0:
        return
    kv_caches = kv_quant.bytes_(kv_caches)    # fp8: the same bytes as uint8 (CPU index ops)
    if backend is None and _FORCED is None and not kv_caches.is_cuda:   # the CPU hot path
        kv_caches.index_copy_(1, dst, kv_caches.index_select(1, src))
        return
    which = _pick(backend, kv_caches.is_cuda, ("cuda", "triton", "torch"))
    if which == "cuda":
        from vllm.kernels import cuda_kernels
        cuda_kernels.relocate_kv(kv_caches, src, dst)
    elif which == "triton":
        from vllm.kernels.triton_relocate import relocate_kv as triton_relocate
        triton_relocate(kv_caches, src, dst)
    else:
        dst = dst.to(kv_caches.device)
        kv_caches.index_copy_(1, dst, kv_caches.index_select(1, src.to(kv_caches.device)))


# ---- CPU decode kernels (decode attention here, the packed GEMM in the model's Linear) ----------
def cpu_kernels_enabled() -> bool:
    return _FORCED in (None, "cpu") and _available("cpu")


def cpu_rows(x: torch.Tensor, width: int = 16) -> bool:
    """Whether the C kernels take x (float32 on the CPU; their vector loops need rows of a
    multiple of 16)."""
    return x.dtype == torch.float32 and not x.is_cuda and width % 16 == 0 \
        and cpu_kernels_enabled()


# ---- norms, activations, rotary + cache write (the model library's elementwise ops) ------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] -> x * rsqrt(mean(x^2) + eps) * weight."""
    if x.dim() == 2 and cpu_rows(x, x.shape[-1]):
        from vllm.kernels import cpu_kernels
        return cpu_kernels.rms_norm(x, weight, eps)
    # one op on CUDA; bitwise equal to x * rsqrt(mean(x^2) + eps) * weight in float32
    return F.rms_norm(x, weight.shape, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [M, 2I] -> silu(gate) * up [M, I]."""
    if cpu_rows(gate_up, gate_up.shape[-1] // 2):
        from vllm.kernels import cpu_kernels
        return cpu_kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [M, 2I] -> gelu_tanh(gate) * up [M, I] (GeGLU)."""
    if cpu_rows(gate_up, gate_up.shape[-1] // 2):
        from vllm.kernels import cpu_kernels
        return cpu_kernels.gelu_tanh_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary,
                  slot_mapping: torch.Tensor, kv_cache: torch.Tensor, num_heads: int,
                  head_dim: int) -> torch.Tensor:
    """qkv [T, (H + 2 KVH) D] -> rotated q [T, H, D]; rotated k and v written to kv_cache at
    slot_mapping. An fp8 cache's keys, and the queries to match, are spread
    (kv_quant.spread). One C call on the CPU; else rotary (the model's Rotary) + write_kv."""
    t = qkv.shape[0]
    if cpu_rows(qkv):
        from vllm.kernels import cpu_kernels
        return cpu_kernels.rope_write_kv(qkv, cos, sin, slot_mapping, kv_cache, num_heads)
    q_size, kv_heads = num_heads * head_dim, (qkv.shape[1] // head_dim - num_heads) // 2
    # rotate q and k heads together: [T, H + KVH, D]
    qk = rotary(qkv[:, :q_size + kv_heads * head_dim].view(t, -1, head_dim),
                cos[:, None], sin[:, None])
    q, k = qk.split([num_heads, kv_heads], dim=1)
    if kv_quant.spreads(kv_cache):
        q, k = kv_quant.spread(q), kv_quant.spread(k)
    v = qkv[:, q_size + kv_heads * head_dim:].view(t, kv_heads, head_dim)
    write_kv(kv_cache, slot_mapping, k, v)
    return q


# ---- KV cache write -----------------------------------------------------------------------------
def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, backend: Optional[str] = None) -> None:
    """kv_cache [S, 2, KVH, D]: this step's K/V [T, KVH, D] into their slots. A slot < 0
    (padding) writes nothing; plain advanced indexing would write slot -1, the pool's last.
    An fp8 cache stores them quantized with its layer's scales: on Triton from the device
    scale row (CUDA graphs), on torch through kv_quant.write; either way the layer's first real
    write calibrates it under --calculate-kv-scales (never inside a graph capture)."""
    which = _pick(backend, kv_cache.is_cuda, ("triton", "torch"))
    if kv_quant.is_fp8(kv_cache):
        if which == "torch":
            kv_quant.write(kv_cache, slot_mapping, k, v)
            return
        kv_quant.calibrate_if_needed(kv_cache, k, v, slot_mapping)
    if which == "triton":
        from vllm.kernels.triton_write_kv import write_kv as triton_write_kv
        scales = kv_quant.scale_row(kv_cache) if kv_quant.is_fp8(kv_cache) else None
        triton_write_kv(kv_cache, slot_mapping, k, v, scales)
        return
    kv = torch.stack((k, v), dim=1)
    padded = slot_mapping < 0
    if bool(padded.any()):        # a host check: free on CPU, a sync on CUDA without Triton
        slot_mapping, kv = slot_mapping[~padded], kv[~padded]
    kv_cache[slot_mapping] = kv.to(kv_cache.dtype)      # bfloat16 cache: rounded to nearest even


# ---- decode attention ---------------------------------------------------------------------------
def decode_backend(q: torch.Tensor) -> str:
    """The path decode_attention takes for q when no backend is named."""
    if cpu_rows(q, q.shape[-1]):
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
                     torch_view: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                     sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [B, H, D], kv_cache [S, 2, KVH, D], slots [B, Lmax] (first lens[b] valid, padding -1)
    -> [B, H, D].

    mass (float32 [B, Lmax]), if given, += each key's attention probability summed over heads.
    torch_view: torch_decode_view(slots), when the caller keeps it for all layers of a step.
    sinks: float32 [H] sink logits (module docstring), or None.
    A row without keys (lens 0, CUDA-graph padding) gives zeros on Triton and the C kernel,
    NaN on torch; either way nobody reads it.
    """
    which = backend or decode_backend(q)
    if which == "cpu":
        from vllm.kernels import cpu_kernels
        return cpu_kernels.decode_attention(q, kv_cache, slots, lens, scale, mass, sinks)
    if _pick(which, q.is_cuda, ("triton", "torch")) == "triton":
        from vllm.kernels.triton_decode import decode_attention as triton_decode
        # the kernel writes out with q's strides; q is a strided view of the QKV projection
        return triton_decode(q.contiguous(), kv_cache, slots, lens, scale, mass, sinks=sinks)
    gather, bias = torch_view if torch_view is not None else torch_decode_view(slots, lens)
    return _decode_torch(q, kv_cache, gather, bias, scale, mass, sinks)


def _decode_torch(q, kv_cache, gather, bias, scale, mass, sinks=None):
    b, h, d = q.shape
    width = gather.shape[1]
    # index_select on the flat view is ~2x faster than advanced indexing on CPU
    kv = kv_quant.gather(kv_cache, gather.view(-1), q.dtype)    # fp8: dequantized
    kv = kv.view(b, width, 2, kv_cache.shape[2], d)              # [B, L, 2, KVH, D]
    k = kv[:, :, 0].transpose(1, 2)                              # [B, KVH, L, D]
    v = kv[:, :, 1].transpose(1, 2)
    if sinks is None:
        out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=bias, scale=scale,
                                             enable_gqa=True)
    else:
        out = _sdpa_with_sinks(q.unsqueeze(2), k, v, bias, scale, sinks)
    if mass is not None:        # beside the attention call, never instead of it
        kvh = k.shape[1]
        qg = q.view(b, kvh, h // kvh, d)             # query heads grouped by their KV head
        scores = torch.matmul(qg.float(), k.float().transpose(2, 3)) * scale + bias
        probs = sink_softmax(scores, None if sinks is None else sinks.view(kvh, -1, 1))
        mass[:, :width] += probs.sum(dim=(1, 2), dtype=torch.float32)
    return out.view(b, h, d)


def sink_softmax(scores: torch.Tensor, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """softmax over the last dim with exp(sink) one more term of each denominator: the real
    keys' probabilities. sinks broadcasts to scores[..., :1] (None: a plain softmax)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    col = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, col), dim=-1), dim=-1)[..., :-1]


SINK_QUERY_TILE = 256     # prefill queries per SDPA call when the layer has sinks


def _sdpa_with_sinks(q, k, v, mask, scale, sinks):
    """q [N, H, Lq, D], k/v [N, KVH, Lk, D], mask broadcasting to [N, 1, Lq, Lk] (bool, True =
    attend; or additive) -> [N, H, Lq, D]. The sinks are one more key: K = V = 0 (score 0,
    nothing added to the output) with an additive bias of sinks[h] for query head h, so each
    softmax gains exactly exp(s_h). The bias is per head, [N, H, Lq, Lk + 1] in q's dtype, its
    rows padded to 16 in storage (the alignment CUDA's memory-efficient kernel wants)."""
    n, h, lq, _ = q.shape
    lk = k.shape[2]
    bias = torch.zeros(n, h, lq, -(-(lk + 1) // 16) * 16, dtype=q.dtype,
                       device=q.device)[..., :lk + 1]
    if mask.dtype == torch.bool:
        bias[..., :lk].masked_fill_(~mask, float("-inf"))
    else:
        bias[..., :lk] = mask
    bias[..., lk] = sinks.to(q.dtype).view(h, 1)
    k, v = F.pad(k, (0, 0, 0, 1)), F.pad(v, (0, 0, 0, 1))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)



# ---- greedy sampling ----------------------------------------------------------------------------
def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] -> int64 [B]: each row's first maximal index (a NaN: the first NaN's)."""
    if not x.is_cuda and x.dtype == torch.float32 and cpu_kernels_enabled():
        from vllm.kernels import cpu_kernels
        return cpu_kernels.argmax_rows(x)
    return x.max(dim=1).indices        # the first maximal index too, faster than argmax on CPU


# ---- mixture-of-experts routing (vllm/model_executor/layers/fused_moe.py) --------------------------
MOE_ROUTINGS = ("softmax_topk", "topk_softmax")     # the C kernel's modes 0 and 1


def moe_topk(logits: torch.Tensor, top_k: int, routing: str,
             renormalize: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights float32 [T, top_k], expert ids [T, top_k]), as
    transformers' routers compute them: "softmax_topk" p = softmax(logits), its top_k (divided by
    their sum when renormalize); "topk_softmax" the top_k logits, softmax over them."""
    logits = logits.float()
    if routing == "topk_softmax":
        top, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    top, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, ids


def moe_route(logits: torch.Tensor, top_k: int, routing: str, renormalize: bool):
    """Router logits [T, E] -> the picks grouped by expert: (tokens int64 [T top_k], weights
    float32 [T top_k], offsets int64 [E + 1]); expert e's picks are offsets[e] .. offsets[e + 1],
    in token order. The C kernel routes as moe_topk does (its exp may differ from torch's in the
    last bit of a weight), else moe_topk and a stable sort."""
    if cpu_rows(logits):
        from vllm.kernels import cpu_kernels
        return cpu_kernels.moe_route(logits, top_k, MOE_ROUTINGS.index(routing), renormalize)
    return moe_group(*moe_topk(logits, top_k, routing, renormalize), logits.shape[1])


def moe_group(weights: torch.Tensor, ids: torch.Tensor, num_experts: int):
    """moe_topk's (weights, ids) [T, top_k] -> moe_route's (tokens, weights, offsets): one
    stable sort of the picks by expert."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(torch.bincount(flat, minlength=num_experts), 0, out=offsets[1:])
    return order // ids.shape[1], weights.reshape(-1)[order], offsets


def moe_combine(y: torch.Tensor, weights: torch.Tensor, tokens: torch.Tensor,
                num_tokens: int) -> torch.Tensor:
    """y [P, N] (the experts' outputs for moe_route's picks) -> [num_tokens, N]: each token's
    sum of y * weight over its picks, in pick order."""
    if cpu_rows(y):
        from vllm.kernels import cpu_kernels
        return cpu_kernels.moe_combine(y, weights, tokens, num_tokens)
    out = torch.zeros(num_tokens, y.shape[1], dtype=y.dtype, device=y.device)
    return out.index_add_(0, tokens, y * weights[:, None].to(y.dtype))


# ---- prefill attention --------------------------------------------------------------------------
def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: Optional[torch.Tensor], scale: float,
                      backend: Optional[str] = None,
                      sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [H, Lq, D], k/v [KVH, Lk, D] -> [H, Lq, D].

    mask [Lq, Lk] bool (True = attend); None = causal with the queries as the last Lq keys
    (query i sees keys 0 .. i + Lk - Lq). sinks: float32 [H] sink logits, or None.
    """
    if _pick(backend, q.is_cuda, ("xformers", "torch")) == "xformers" and sinks is None:
        return _prefill_xformers(q, k, v, mask, scale)
    lq, lk = q.shape[1], k.shape[1]
    if mask is None and (lq != lk or sinks is not None):   # SDPA's is_causal is top-left aligned
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if sinks is not None:
        # query tiles: the sink's bias is per head, [H, tile, Lk + 1], never [H, Lq, Lk + 1]
        return torch.cat([_sdpa_with_sinks(q[None, :, s:s + SINK_QUERY_TILE], k[None], v[None],
                                           mask[s:s + SINK_QUERY_TILE], scale, sinks)[0]
                          for s in range(0, lq, SINK_QUERY_TILE)], dim=1)
    # a batch dimension: the fused SDPA kernels (CUDA's, and the CPU flash kernel) take 4-d
    # inputs only; 3-d ones run the math kernel
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                          is_causal=mask is None, scale=scale,
                                          enable_gqa=True)[0]


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


# ---- batched prefill: several spans in one attention call ----------------------------------------
def prefill_backend(device: torch.device) -> str:
    """The path prefill_batch takes for spans on `device` when no backend is named."""
    return _pick(None, device.type == "cuda", ("xformers", "torch"))


@dataclass
class PrefillBatch:
    """Prefill spans as one attention call; built once per step (prefill_batch) and read by
    every layer. q_rows are the spans' rows of the step's q, span after span; the result of
    prefill_attention_batched comes back in that order.

    xformers  packed:  q [1, Tq, ...], K/V [1, Tk, ...]; bias xformers'
              BlockDiagonalCausalFromBottomRightMask from the spans' (q lengths, kv lengths);
              only spans without an explicit mask.
    torch     padded:  q [N, H, max_q, D], K/V [N, KVH, max_k, D], bias a bool mask
              [N, 1, max_q, max_k]: causal from the bottom right (or the span's own mask) and
              no padding key; a padding query row sees its span's real keys (never a NaN row).
    """
    backend: str
    q_rows: torch.Tensor          # [Tq]
    kv_slots: torch.Tensor        # cache slots to gather: [Tk] packed, [N * max_k] padded
    bias: Any
    pad: Optional[torch.Tensor] = None      # torch: [N * max_q] q rows of the padded layout
    unpad: Optional[torch.Tensor] = None    # torch: [Tq] real rows' places in the padded layout
    shape: Tuple[int, int, int] = (0, 0, 0)  # torch: (N, max_q, max_k)
    additive: dict = field(default_factory=dict, repr=False)   # torch on CUDA: dtype -> bias




def prefill_batch(bounds: Sequence[Tuple[int, int]], slots: Sequence[torch.Tensor],
                  masks: Sequence[Optional[torch.Tensor]], backend: str) -> PrefillBatch:
    """bounds: each span's (q_start, q_end) in the step (host ints); slots: its attention view
    [Lk]; masks: its [Lq, Lk] bool mask or None (causal, queries the last Lq keys). Only shapes
    and host ints are read: nothing waits for the device."""
    device = slots[0].device
    q_lens = np.array([e - s for s, e in bounds], dtype=np.int64)
    k_lens = np.array([len(t) for t in slots], dtype=np.int64)
    # [(4, 7), (0, 2)] -> q_rows [4, 5, 6, 0, 1]
    q_rows = np.concatenate([np.arange(s, e) for s, e in bounds])
    cat_slots = torch.cat(list(slots))
    if backend == "xformers":
        assert all(m is None for m in masks), "xformers batches only spans without a mask"
        from xformers.ops.fmha.attn_bias import BlockDiagonalCausalFromBottomRightMask
        bias = BlockDiagonalCausalFromBottomRightMask.from_seqlens(
            q_lens.tolist(), k_lens.tolist(), device=device)
        return PrefillBatch(backend, to_device(q_rows, device), cat_slots, bias)
    n, max_q, max_k = len(bounds), int(q_lens.max()), int(k_lens.max())
    # q_lens [3, 2], max_q 3:  real [[T, T, T], [T, T, F]],  at [[0, 1, 2], [3, 4, 0]]
    #   q_rows [4, 5, 6, 0, 1] -> pad [4, 5, 6, 0, 1, 4] (a padding row reads q_rows[0]),
    #   unpad [0, 1, 2, 3, 4] (real rows in the flat padded layout); keys alike over cat_slots
    real_q = np.arange(max_q)[None, :] < q_lens[:, None]
    q_at = np.where(real_q, (np.cumsum(q_lens) - q_lens)[:, None] + np.arange(max_q), 0)
    real_k = np.arange(max_k)[None, :] < k_lens[:, None]
    k_at = np.where(real_k, (np.cumsum(k_lens) - k_lens)[:, None] + np.arange(max_k), 0)
    host = np.concatenate([q_rows, q_rows[q_at.ravel()], np.flatnonzero(real_q), k_at.ravel(),
                           q_lens, k_lens])
    dev = torch.split(to_device(host, device), [len(q_rows), n * max_q, len(q_rows), n * max_k,
                                              n, n])
    rows, pad_t, unpad, k_src, ql, kl = dev
    i = torch.arange(max_q, device=device)[None, :, None]
    j = torch.arange(max_k, device=device)[None, None, :]
    # causal from the bottom right and no padding key; a padding row (i >= Lq) sees all keys
    mask = (j <= i + (kl - ql)[:, None, None]) & (j < kl[:, None, None])
    for b, m in enumerate(masks):
        if m is not None:
            mask[b, :m.shape[0], :m.shape[1]] = m
    return PrefillBatch(backend, rows, cat_slots.index_select(0, k_src), mask[:, None], pad_t,
                        unpad, (n, max_q, max_k))


def prefill_attention_batched(q: torch.Tensor, kv: torch.Tensor, batch: PrefillBatch,
                              scale: float, sinks: Optional[torch.Tensor] = None
                              ) -> torch.Tensor:
    """q [T, H, D] the step's queries, kv [len(batch.kv_slots), 2, KVH, D] gathered at
    batch.kv_slots -> [Tq, H, D] for the rows batch.q_rows, in that order. sinks (float32 [H]
    sink logits) only on a torch batch: xformers' packed batch has no sink key."""
    h, d = q.shape[1:]
    if batch.backend == "xformers":
        assert sinks is None, "sinks: build the batch with backend 'torch'"
        return _prefill_varlen_xformers(q.index_select(0, batch.q_rows), kv, batch.bias, scale)
    n, max_q, _ = batch.shape
    out = _prefill_padded(q, kv, batch, scale, sinks=sinks)      # [N, H, max_q, D]
    return out.transpose(1, 2).reshape(n * max_q, h, d).index_select(0, batch.unpad)


def _prefill_padded(q, kv, batch, scale, expand_kv: Optional[bool] = None, sinks=None):
    """-> [N, H, max_q, D]. expand_kv (default: on CUDA) repeats K/V per query head and passes
    the mask as an additive bias: with enable_gqa and a mask, CUDA's SDPA has no fused kernel
    and falls back to the math one (the whole score matrix in memory)."""
    n, max_q, max_k = batch.shape
    h, d = q.shape[1:]
    kvh = kv.shape[2]
    qp = q.index_select(0, batch.pad).view(n, max_q, h, d).transpose(1, 2)
    kv = kv.view(n, max_k, 2, kvh, d)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)   # [N, KVH, max_k, D]
    expand = q.is_cuda if expand_kv is None else expand_kv
    if expand:
        k, v = (t[:, :, None].expand(n, kvh, h // kvh, max_k, d).reshape(n, h, max_k, d)
                for t in (k, v))
    if sinks is not None:
        return _sdpa_with_sinks(qp, k, v, batch.bias, scale, sinks)
    if not expand:
        return F.scaled_dot_product_attention(qp, k, v, attn_mask=batch.bias, scale=scale,
                                              enable_gqa=True)
    return F.scaled_dot_product_attention(qp, k, v, attn_mask=_additive(batch, q.dtype),
                                          scale=scale)


def _additive(batch, dtype):
    """batch.bias as 0 / -inf in dtype, built once per step; rows padded to 16 keys in storage
    (the alignment CUDA's memory-efficient kernel wants; SDPA would pad it every call)."""
    if dtype not in batch.additive:
        n, max_q, max_k = batch.shape
        bias = torch.zeros(n, 1, max_q, -(-max_k // 16) * 16, dtype=dtype,
                           device=batch.bias.device)[..., :max_k]
        batch.additive[dtype] = bias.masked_fill_(~batch.bias, float("-inf"))
    return batch.additive[dtype]


def _prefill_varlen_xformers(q, kv, bias, scale):
    import xformers.ops as xops
    tq, h, d = q.shape
    tk, _, kvh, _ = kv.shape
    g = h // kvh
    # packed 5-d layout [1, tokens, KVH, G, D]; K/V broadcast over the group (stride 0)
    qx = q.view(1, tq, kvh, g, d)
    kx = kv[:, 0, :, None].expand(tk, kvh, g, d).unsqueeze(0)
    vx = kv[:, 1, :, None].expand(tk, kvh, g, d).unsqueeze(0)
    out = xops.memory_efficient_attention(qx, kx, vx, attn_bias=bias, scale=scale)
    return out.reshape(tq, h, d)
