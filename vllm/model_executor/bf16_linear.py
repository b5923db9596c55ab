"""bf16 weights on the CPU (--dtype bfloat16, a bf16 checkpoint under --dtype auto where it is
faster, or a GGUF's BF16 tensors): the GEMM weights stay in bfloat16, packed as the float32 C
GEMM's panels with 2-byte elements (half the weight stream of a decode step), and are widened
exactly in registers; activations, accumulation and outputs stay float32, so a BF16Linear
computes x @ W for the float32 values of its bf16 weights. The C decode layer multiplies the
same panels (its layer struct's `bf16` flag)."""
from typing import List, Optional

import torch
from torch import nn

from vllm.kernels import cpu_kernels, quant_kernels
from vllm.kernels.cpu_kernel_plan import KernelPlan
from vllm.model_executor.quant_linear import QuantWeight


def as_bf16(w: QuantWeight) -> torch.Tensor:
    """A BF16 QuantWeight's bytes as the [n, k] bfloat16 weight."""
    assert w.qtype == quant_kernels.BF16 and w.blocks.shape == (w.shape[0], 2 * w.shape[1])
    return w.blocks.contiguous().view(torch.bfloat16)


class BF16Linear(nn.Module):
    """y = x @ W^T (+ bias) (+ residual), the weights of a fused GEMM (BF16 QuantWeights)
    stacked in output order; Linear's interface (`packed`: the bf16 panels)."""

    def __init__(self, weights: List[QuantWeight], bias: Optional[torch.Tensor] = None,
                 plan: Optional[KernelPlan] = None):
        super().__init__()
        self.in_features = weights[0].shape[1]
        self.out_features = sum(w.shape[0] for w in weights)
        wt = torch.cat([as_bf16(w) for w in weights]).t()            # [K, N], exact
        self.packed = nn.Parameter(cpu_kernels.pack_weight(wt, bf16=True), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(),
                                                           requires_grad=False)
        self.plan = plan

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, type=BF16"

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        prefetch = self.plan.prefetch_next(x.shape[0]) if self.plan else True
        return cpu_kernels.packed_gemm(x, self.packed, self.out_features, self.bias, residual,
                                       prefetch)
