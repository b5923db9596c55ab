"""Linear: y = x @ W (+ bias) (+ residual) on the path a KernelPlan picks per batch band (C on
packed panels, MKL packed, or x @ Wt). Weights are kept pre-transposed ([in, out], contiguous)
because `x @ Wt` is up to 2x faster than `F.linear(x, W)` for decode-shaped GEMMs on CPU. The
GGUF block and bf16 forms are QuantLinear / BF16Linear (model_executor/quant_linear.py,
bf16_linear.py), built by block_linear."""
import math
from typing import List, Optional, Tuple

import torch
from torch import nn

from vllm.kernels import cpu_kernel_plan, cpu_kernels
from vllm.kernels.cpu_kernel_plan import KernelPlan, band
from vllm.weight_arena import WeightArena


class Linear(nn.Module):
    """y = x @ W (+ bias) (+ residual) on the path `plan` picks for x's rows: "c" (W as the C
    GEMM's panels, cpu_kernels), "mkl" (W packed by MKL for the band's largest row count) or
    "torch" (W as [in, out]). W is kept only in the layouts its paths use; no plan: "torch"."""

    def __init__(self, wt: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 plan: Optional[KernelPlan] = None, arena: Optional[WeightArena] = None):
        super().__init__()
        self.in_features, self.out_features = wt.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.paths = self.paths_for(wt.shape, plan)
        self.plan = plan            # its prefetch choice is made after the model is built
        self.wt = self.packed = None
        if "c" in self.paths:
            out = arena.take(cpu_kernels.packed_shape(*wt.shape)) if arena else None
            self.packed = nn.Parameter(cpu_kernels.pack_weight(wt, out), requires_grad=False)
        if "torch" in self.paths:
            wt = arena.take(wt.shape).copy_(wt) if arena else wt.contiguous()
            self.wt = nn.Parameter(wt, requires_grad=False)
        self.mkl = {rows: cpu_kernel_plan._mkl_pack(wt, rows)      # rows -> MKL's packing
                    for rows, path in zip(cpu_kernel_plan.TIMED_ROWS, self.paths) if path == "mkl"}

    @staticmethod
    def paths_for(shape: Tuple[int, int], plan: Optional[KernelPlan]) -> List[str]:
        return plan.gemm[cpu_kernel_plan.shape_name(*shape)] if plan else ["torch"]

    @classmethod
    def arena_floats(cls, shape: Tuple[int, int], plan: Optional[KernelPlan]) -> int:
        """Floats a weight of this shape takes in a WeightArena (its c and torch layouts)."""
        paths = cls.paths_for(shape, plan)
        return (math.prod(cpu_kernels.packed_shape(*shape)) if "c" in paths else 0) + \
            (math.prod(shape) if "torch" in paths else 0)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        m = x.shape[0]
        path = self.paths[band(m)] if len(self.paths) > 1 else self.paths[0]
        if path == "c":
            return cpu_kernels.packed_gemm(x, self.packed, self.out_features, self.bias, residual,
                                           self.plan.prefetch_next(m))
        if path == "mkl":
            rows = cpu_kernel_plan.TIMED_ROWS[band(m)]
            y = cpu_kernel_plan.mkl_gemm(x, self.mkl[rows], rows, self.out_features,
                                         self.in_features)
            y = y if self.bias is None else y + self.bias
        else:
            y = x @ self.wt if self.bias is None else torch.addmm(self.bias, x, self.wt)
        return y if residual is None else residual + y
