"""Gated MLP activations over a fused [gate | up] GEMM output: act(gate) * up."""
import torch

from vllm.kernels import ops

# a config's hidden_act -> the gated activation this library runs for it
GATED = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
         "gelu_tanh": "gelu_tanh"}


def gated_activation(name: str) -> str:
    if name not in GATED:
        raise ValueError(f"--model: activation {name!r} is not supported; "
                         f"supported: {sorted(GATED)}")
    return GATED[name]


def act_mul(gate_up: torch.Tensor, kind: str) -> torch.Tensor:
    """gate_up [M, 2I] -> act(gate) * up [M, I]; kind "silu" or "gelu_tanh"."""
    return ops.silu_mul(gate_up) if kind == "silu" else ops.gelu_tanh_mul(gate_up)
