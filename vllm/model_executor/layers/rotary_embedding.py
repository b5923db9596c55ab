"""Rotary position embeddings, as transformers computes them (float32 frequencies), indexed by
logical position: eviction never changes a token's position, so a table row is read as is."""
import math
from typing import Optional, Tuple

import torch
from torch import nn


def rope_parameters(config, layer_type: Optional[str] = None) -> Tuple[float, dict]:
    """(theta, scaling) from a transformers 4.x or 5.x config. Gemma-style configs key their
    rope_parameters by layer type ({"full_attention": {...}, "sliding_attention": {...}}):
    `layer_type` picks one. A yarn scaling also carries what transformers reads from the config
    itself: max_position_embeddings, the original length's fallback and `truncate`."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    nested = layer_type is not None and isinstance(params.get(layer_type), dict)
    if nested:
        top, params = params, dict(params[layer_type])
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        theta = 10000.0
    params.update(scaling)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "yarn":
        max_len = getattr(config, "max_position_embeddings", None)
        params["max_position_embeddings"] = max_len
        params.setdefault("original_max_position_embeddings",
                          getattr(config, "original_max_position_embeddings", max_len))
        if nested:  # transformers reads truncate from the top-level dict, not the layer's
            params["truncate"] = top.get("truncate", True)
    return float(theta), {**params, "rope_type": kind}


def inv_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    # float32 throughout, as transformers computes it, so greedy outputs match it bit for bit
    partial = scaling.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"--model: partial_rotary_factor {partial} is not supported")
    pos = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv = 1.0 / pos
    kind = scaling["rope_type"]
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    if kind == "yarn":
        return _yarn_inv_frequencies(head_dim, theta, pos, scaling)
    raise ValueError(f"--model: rope scaling type {kind!r} is not supported")


def _yarn_factor(scaling: dict) -> float:
    factor = scaling.get("factor")
    if factor is None:  # DeepSeek-V3 style: the ratio of the extended to the original length
        factor = scaling["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    return factor


def _yarn_inv_frequencies(head_dim: int, theta: float, pos: torch.Tensor,
                          scaling: dict) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): high frequencies (many turns over the original length) kept,
    low ones divided by factor, a linear ramp between. The operations are transformers' own,
    in its order ((1 - (1 - ramp)) is not folded), so the float32 result is bit for bit."""
    factor = _yarn_factor(scaling)
    old_len = scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(turns):  # the dimension that turns `turns` times over old_len
        return head_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)
    ramp = torch.clamp(ramp, 0, 1)
    keep = 1 - ramp  # weight of the unscaled (extrapolated) frequency
    return (1.0 / (factor * pos)) * (1 - keep) + (1.0 / pos) * keep


def attention_factor(scaling: dict) -> float:
    """What transformers multiplies the cos/sin tables by (its attention_scaling): 1.0 but for
    yarn, where it is attention_factor, else 0.1 ln(factor) + 1 (a DeepSeek-style ratio when
    both mscale and mscale_all_dim are given)."""
    if scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor = _yarn_factor(scaling)

    def mscale(m=1):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(m) / mscale(m_all)) if m and m_all else mscale()


class Rotary(nn.Module):
    """cos/sin tables indexed by logical position; buffers, so they live on the model's device.
    Computed in float32 on the CPU, as transformers computes its frequencies, then moved."""

    def __init__(self, head_dim: int, max_pos: int, theta: float, scaling: dict, dtype,
                 device: torch.device = torch.device("cpu")):
        super().__init__()
        inv = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = attention_factor(scaling)  # x 1.0 leaves a table bit for bit
        self.register_buffer("cos", (emb.cos() * scale).to(device=device, dtype=dtype),
                             persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).to(device=device, dtype=dtype),
                             persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
