"""Rotary position embeddings, as transformers computes them (float32 frequencies), indexed by
logical position: eviction never changes a token's position, so a table row is read as is."""
import math
from typing import Optional, Tuple

import torch
from torch import nn


def rope_parameters(config, layer_type: Optional[str] = None) -> Tuple[float, dict]:
    """(theta, scaling) from a transformers 4.x or 5.x config. Gemma-style configs key their
    rope_parameters by layer type ({"full_attention": {...}, "sliding_attention": {...}}):
    `layer_type` picks one."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        theta = 10000.0
    params.update(scaling)
    kind = params.get("rope_type", params.get("type", "default"))
    return float(theta), {**params, "rope_type": kind}


def inv_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    # float32 throughout, as transformers computes it, so greedy outputs match it bit for bit
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
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
    raise ValueError(f"--model: rope scaling type {kind!r} is not supported")


class Rotary(nn.Module):
    """cos/sin tables indexed by logical position; buffers, so they live on the model's device.
    Computed in float32 on the CPU, as transformers computes its frequencies, then moved."""

    def __init__(self, head_dim: int, max_pos: int, theta: float, scaling: dict, dtype,
                 device: torch.device = torch.device("cpu")):
        super().__init__()
        inv = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(device=device, dtype=dtype), persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
