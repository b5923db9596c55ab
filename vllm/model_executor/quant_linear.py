"""GGUF block-quantized linear layers (--quantization gguf): the GGUF's Q8_0 / Q4_0 / Q4_1
weights are kept in their 32-element blocks and multiplied natively on the CPU
(csrc/cpu/quant_kernels.c via vllm/quant_kernels.py), instead of dequantized to float32.

`load_gguf_linears` reads the block-quantized GEMM weights of a llama GGUF (q/k/v/o, gate/up/down
and the output projection, or the token embedding when tied) under their HF names; anything
else (other quantization types, float tensors) is left to the float32 path. `QuantLinear` is
Linear's counterpart: rows of blocks concatenated along the output dim (fused Q/K/V, gate/up).
"""
import logging
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch
from torch import nn

from vllm import quant_kernels

logger = logging.getLogger(__name__)


@dataclass
class QuantWeight:
    """W [n, k] in GGML blocks: blocks uint8 [n, k / 32 * block bytes] of type qtype."""
    blocks: torch.Tensor
    qtype: int
    shape: tuple            # (n, k): HF's (out, in)

    @property
    def type_name(self) -> str:
        return quant_kernels.TYPE_NAMES[self.qtype]


def load_gguf_linears(gguf_path: str, hf_config) -> Dict[str, QuantWeight]:
    """HF weight name -> QuantWeight for every Q8_0 / Q4_0 / Q4_1 GEMM weight of a llama GGUF
    (Q and K rows un-permuted as gguf_loader does for float weights); types the kernels do not
    cover are left out, with one log line."""
    import gguf

    from vllm.model_executor import gguf_loader as gl

    reader = gguf.GGUFReader(gguf_path)
    arch = gl._field(reader, "general.architecture")
    if arch != "llama":
        logger.info("--quantization gguf: architecture %r is not llama; float32 weights", arch)
        return {}
    n_head = hf_config.num_attention_heads
    n_kv_head = getattr(hf_config, "num_key_value_heads", None) or n_head
    tied = "output.weight" not in {t.name for t in reader.tensors}
    out: Dict[str, QuantWeight] = {}
    skipped: Dict[str, int] = {}
    for tensor in reader.tensors:
        m = gl._BLOCK_RE.match(tensor.name)
        if m:
            layer, base, kind = m.groups()
            if kind != "weight" or base in ("attn_norm", "ffn_norm"):
                continue
            name = f"model.layers.{layer}.{gl._LLAMA_BLOCK_NAMES[base]}.weight"
        elif tensor.name == "output.weight" or (tied and tensor.name == "token_embd.weight"):
            base, name = None, "lm_head.weight"
        else:
            continue
        qtype = int(tensor.tensor_type)
        if qtype not in quant_kernels.BLOCK_BYTES:
            skipped[tensor.tensor_type.name] = skipped.get(tensor.tensor_type.name, 0) + 1
            continue
        k, n = (int(d) for d in tensor.shape)           # GGML order: (in, out)
        blocks = np.array(tensor.data, dtype=np.uint8).reshape(n, -1)   # copy off the memmap
        assert blocks.shape[1] == k // quant_kernels.BLOCK * quant_kernels.BLOCK_BYTES[qtype]
        if base == "attn_q":
            blocks = gl._reverse_llama_permute(blocks, n_head)
        elif base == "attn_k":
            blocks = gl._reverse_llama_permute(blocks, n_kv_head)
        out[name] = QuantWeight(torch.from_numpy(np.ascontiguousarray(blocks)), qtype, (n, k))
    del reader
    if skipped:
        logger.info("--quantization gguf: %s tensors are not covered by the CPU kernels; they "
                    "run dequantized in float32", ", ".join(f"{c} {t}" for t, c in skipped.items()))
    return out


def group(quant: Optional[Dict[str, QuantWeight]], names: List[str]) -> Optional[List[QuantWeight]]:
    """The QuantWeights of one fused GEMM (weights concatenated along the output dim), or None
    when any of them is not quantized or they differ in type (then it runs in float32)."""
    if not quant or any(n not in quant for n in names):
        return None
    ws = [quant[n] for n in names]
    if len({w.qtype for w in ws}) != 1 or len({w.shape[1] for w in ws}) != 1:
        return None
    return ws


class QuantLinear(nn.Module):
    """y = x @ W^T (+ bias) (+ residual) with W in GGML blocks; the weights of a fused GEMM are
    given in output order and their rows concatenated. Linear's interface: in_features,
    out_features, bias, forward(x, residual). `packed` is None: the C decode layer, which fuses
    float32 layers, is off for a layer that has a QuantLinear."""

    packed = None

    def __init__(self, weights: List[QuantWeight], bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.qtype = weights[0].qtype
        self.in_features = weights[0].shape[1]
        self.out_features = sum(w.shape[0] for w in weights)
        blocks = torch.cat([w.blocks for w in weights]) if len(weights) > 1 \
            else weights[0].blocks.contiguous()
        self.blocks = nn.Parameter(blocks, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(),
                                                           requires_grad=False)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"type={quant_kernels.TYPE_NAMES[self.qtype]}")

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        return quant_kernels.gemm(x, self.blocks, self.qtype, self.out_features,
                                  self.in_features, self.bias, residual)
