"""RMSNorm on the C kernel where it takes the rows (float32 CPU, width a multiple of 16), else
torch. Gemma's (1 + w) form is folded into w at load (`gemma_weight`), so one kernel serves it."""
import torch

from vllm.kernels import ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] -> x * rsqrt(mean(x^2) + eps) * weight."""
    return ops.rms_norm(x, weight, eps)


def gemma_weight(w: torch.Tensor) -> torch.Tensor:
    """Gemma's norm multiplies by (1 + w), computed in float32 (transformers' Gemma3RMSNorm)."""
    return 1.0 + w.float()
