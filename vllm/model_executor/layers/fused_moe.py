"""FusedMoE: a mixture-of-experts feed-forward block (Qwen3-MoE, Mixtral, gpt-oss).

A router picks top_k of E experts per token and weighs them; each expert is a gated MLP. The
tokens of a step are grouped by expert (one stable sort of the T*top_k picks) and each active
expert runs one GEMM pair over its tokens, on the same Linear / QuantLinear paths as a dense
layer (float32 panels, bf16, GGUF blocks), so the load-time plan covers the expert shapes. An
expert no token picked costs nothing.

    picks  [[2, 0], [2, 1]]  (T=2, top_k=2)  -> sorted  e0: token 0   e1: token 1
                                                         e2: tokens 0, 1
    out[t] = sum over t's picks of weight * down_e(act(gate_up_e(x[t])))

Routers (MoESpec.routing):
    "softmax_topk"   p = softmax(logits) in float32, the top_k of p; with `renormalize` they
                     are divided by their sum (Qwen3-MoE's norm_topk_prob, always in Mixtral)
    "topk_softmax"   the top_k logits (router bias included), then softmax over them (gpt-oss)
Activations (MoESpec.activation), over [gate | up]:
    "silu"           silu(gate) * up
    "swiglu_clamped" g = min(gate, limit), u = clamp(up, -limit, limit),
                     (u + 1) * g * sigmoid(alpha * g)    (gpt-oss: alpha 1.702, limit 7)

Canonical weight names (each family's canonical_weights renames its checkpoint to them), HF's
[out, in] per expert, p = "model.layers.N.mlp":
    p.gate.weight [E, H] (+ p.gate.bias [E])                              router
    p.experts.e.{gate,up}_proj.weight [I, H], p.experts.e.down_proj.weight [H, I] (+ .bias)

Experts kept in GGUF blocks (one block type per expert GEMM) run as two grouped calls a step
(quant_kernels.gemm_grouped: every active expert's gate_up over its tokens, then every down):
the activations quantized once, every expert's column chunks in one parallel loop, so a decode
step's many experts of one or two rows each pay one fork, not one per expert; the routing and
grouping (ops.moe_route) and the weighted sum (ops.moe_combine) are one C call each. Other
experts (float32, bf16, mixed block types) run one Linear pair per active expert.

Tensor parallelism splits every expert's intermediate dimension (TPShards): each rank holds
I/N of every expert's gate/up rows and down columns, computes the routing itself from the
replicated router (the same input and weights on every rank, so the same picks), and returns
its partial sum; the layer all-reduces it. A down bias is added on rank 0 only.
"""
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from vllm.kernels import ops, quant_kernels
from vllm.kernels.cpu_kernel_plan import KernelPlan
from vllm.model_executor.layers.activation import act_mul
from vllm.model_executor.layers.linear import Linear
from vllm.model_executor.quant_linear import QuantLinear, QuantWeight, block_linear, group
from vllm.weight_arena import WeightArena

ROUTINGS = ops.MOE_ROUTINGS
ACTIVATIONS = ("silu", "swiglu_clamped")


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    routing: str = "softmax_topk"
    renormalize: bool = True
    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self):
        if self.routing not in ROUTINGS or self.activation not in ACTIVATIONS:
            raise ValueError(f"--model: MoE routing {self.routing!r} / activation "
                             f"{self.activation!r}; supported: {ROUTINGS} / {ACTIVATIONS}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"--model: {self.top_k} experts per token of {self.num_experts}")


def expert_name(p: str, e: int, proj: str) -> str:
    """The canonical name of expert e's `proj` ("gate", "up", "down") weight in layer prefix p."""
    return f"{p}.mlp.experts.{e}.{proj}_proj.weight"


class FusedMoE(nn.Module):
    """One layer's router and experts (the module docstring); forward(x [T, H]) -> [T, H]."""

    def __init__(self, spec: MoESpec, w: Dict[str, torch.Tensor], p: str,
                 plan: Optional[KernelPlan], arena: Optional[WeightArena] = None,
                 rank: int = 0, quant: Optional[Dict[str, QuantWeight]] = None,
                 dense: Optional["FusedMoE"] = None):
        """p: the layer's prefix ("model.layers.N"); dense: the float32 twin of a block built
        with `quant`, whose expert GEMMs not kept in blocks are shared, not copied."""
        super().__init__()
        self.spec = spec
        self.router = nn.Parameter(w[f"{p}.mlp.gate.weight"].float(), requires_grad=False)
        bias = w.get(f"{p}.mlp.gate.bias")
        self.router_bias = None if bias is None else nn.Parameter(bias.float(),
                                                                  requires_grad=False)

        def gemm(e: int, projs: List[str], name: str, with_bias: bool):
            names = [expert_name(p, e, n) for n in projs]
            b = None
            if with_bias and names[0].removesuffix("weight") + "bias" in w:
                b = torch.cat([w[n.removesuffix("weight") + "bias"] for n in names])
            qw = group(quant, names)
            if qw is not None:
                return block_linear(qw, b, plan)
            if dense is not None:
                return getattr(dense, name)[e]
            return Linear(torch.cat([w[n] for n in names]).t(), b, plan, arena)

        experts = range(spec.num_experts)
        self.gate_up = nn.ModuleList(gemm(e, ["gate", "up"], "gate_up", True) for e in experts)
        self.down = nn.ModuleList(gemm(e, ["down"], "down", rank == 0) for e in experts)
        self.grouped = _grouped(self.gate_up), _grouped(self.down)
        if None in self.grouped:
            self.grouped = None
        else:       # no torch 4-bit twin for grouped experts: drop the blocks kept to build one
            for lin in list(self.gate_up) + list(self.down):
                lin.int4_source = None

    def gemms(self) -> List[nn.Module]:
        """The GEMM modules forward calls one by one (none where the experts run grouped)."""
        return [] if self.grouped else list(self.gate_up) + list(self.down)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.router, self.router_bias)

    def route(self, x: torch.Tensor):
        """x [T, H] -> (weights [T, top_k] in x's dtype, expert ids [T, top_k])."""
        s = self.spec
        top, ids = ops.moe_topk(self.router_logits(x), s.top_k, s.routing, s.renormalize)
        return top.to(x.dtype), ids

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        s = self.spec
        if s.activation == "silu":
            return act_mul(gate_up, "silu")
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=s.limit)
        glu = gate * torch.sigmoid(gate * s.alpha)
        return (up.clamp(-s.limit, s.limit) + 1) * glu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> this rank's sum over each token's experts [T, H]."""
        s = self.spec
        if self.grouped is not None:        # float32 activations: routing and combine in C
            tokens, picked, offsets = ops.moe_route(self.router_logits(x), s.top_k, s.routing,
                                                    s.renormalize)
            gate_up, down = self.grouped
            h = self.activation(quant_kernels.gemm_grouped(x.index_select(0, tokens), gate_up,
                                                           offsets))
            return ops.moe_combine(quant_kernels.gemm_grouped(h, down, offsets), picked, tokens,
                                   x.shape[0])
        tokens, picked, offsets = ops.moe_group(*self.route(x), s.num_experts)
        offsets = offsets.tolist()
        out = torch.zeros_like(x)
        for e in range(s.num_experts):
            start, end = offsets[e], offsets[e + 1]
            if start == end:
                continue
            rows = tokens[start:end]
            y = self.down[e](self.activation(self.gate_up[e](x.index_select(0, rows))))
            out.index_add_(0, rows, y * picked[start:end, None])
        return out


def _grouped(linears: nn.ModuleList) -> Optional[quant_kernels.Grouped]:
    """The experts' weights for gemm_grouped where every one is a QuantLinear of one block
    type on the CPU (its bias, if any, added by the kernel), else None."""
    if not all(isinstance(lin, QuantLinear) and len(lin.qtypes) == 1 for lin in linears) or \
            not quant_kernels.available():
        return None
    first = linears[0]
    return quant_kernels.Grouped(
        [(lin.blocks[0], lin._parts.types[0]) for lin in linears], first.out_features,
        first.in_features, [lin.bias for lin in linears])
