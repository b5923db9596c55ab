"""GGUF block-quantized linear layers (--quantization gguf): the GGUF's Q8_0 / Q4_0 / Q4_1 /
Q5_0 / Q5_1 / Q4_K / Q6_K weights are kept in their blocks and multiplied natively on the CPU
(csrc/cpu/quant_kernels.c via vllm/kernels/quant_kernels.py), instead of dequantized to float32; its
BF16 weights stay in bfloat16 (BF16Linear, model_executor/bf16_linear.py), as do a bf16
checkpoint's under --dtype bfloat16 (bf16_weights).

`load_gguf_linears` reads the block-quantized GEMM weights of a llama, qwen3, gemma3, qwen3moe,
gpt-oss or Mixtral GGUF (q/k/v/o, gate/up/down, each expert's gate/up/down, and the output
projection, or the token embedding when tied, as Gemma's always is) under their HF names; anything
else (other quantization types, float tensors, the MoE router) is left to the float32 path.
`QuantLinear` is Linear's counterpart: the weights of a fused GEMM (Q/K/V, gate/up) side by side
along the output dim, each in its own type (a Q4_K_M file mixes Q4_K and Q6_K in one fused
Q/K/V).
"""
import ctypes
import functools
import logging
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

from vllm.kernels import cpu_kernel_plan, quant_kernels

logger = logging.getLogger(__name__)
# the GEMM weights of a llama checkpoint (HF names); the LM head is "lm_head.weight"
_LAYER_GEMM_RE = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]|mlp\.(experts\.\d+\.)?(gate|up|down))_proj\.weight")


@dataclass
class QuantWeight:
    """W [n, k] in GGML blocks: blocks uint8 [n, row_bytes(qtype, k)] of type qtype."""
    blocks: torch.Tensor
    qtype: int
    shape: tuple            # (n, k): HF's (out, in)

    @property
    def type_name(self) -> str:
        return quant_kernels.TYPE_NAMES[self.qtype]


def load_gguf_linears(gguf_path: str, hf_config) -> Dict[str, QuantWeight]:
    """HF weight name -> QuantWeight for every GEMM weight of a GGUF of an arch gguf_loader
    converts itself (llama, qwen3, gemma3, and the MoE archs qwen3moe, gpt-oss and llama with
    experts: gguf_loader._ARCH_BLOCK_NAMES) in a type the kernels cover (quant_kernels.BLOCK_BYTES;
    Q and K rows un-permuted as gguf_loader does for float weights, llama only); other types
    (gpt-oss's MXFP4 experts among them) are left out, with one log line. An expert tensor gives
    one QuantWeight per expert (mlp.experts.E.gate_proj.weight, ...), each a view of the tensor's
    blocks; the router stays float. "lm_head.weight" is the output projection, or the token
    embedding where the file has none (tied)."""
    from vllm.model_executor import gguf_loader as gl
    from vllm.model_executor.gguf_file import GGUFFile

    reader = GGUFFile(gguf_path)
    arch = reader.get("general.architecture")
    if arch not in gl._ARCH_BLOCK_NAMES:
        logger.info("--quantization gguf: architecture %r is not one of %s; float32 weights",
                    arch, "/".join(gl._ARCH_BLOCK_NAMES))
        return {}
    permute = arch in gl._PERMUTED_ARCHS
    n_head = hf_config.num_attention_heads
    n_kv_head = getattr(hf_config, "num_key_value_heads", None) or n_head
    tied = "output.weight" not in {t.name for t in reader.tensors}
    out: Dict[str, QuantWeight] = {}
    skipped: Dict[str, int] = {}
    for tensor in reader.tensors:
        m = gl._BLOCK_RE.match(tensor.name)
        if m:
            layer, base, kind = m.groups()
            if kind != "weight" or base not in gl._GEMM_BASES:
                continue
            name = gl._block_name(arch, layer, base, kind)
        elif tensor.name == "output.weight" or (tied and tensor.name == "token_embd.weight"):
            base, name = None, "lm_head.weight"
        else:
            continue
        qtype = int(tensor.tensor_type)
        if qtype not in quant_kernels.BLOCK_BYTES and qtype != quant_kernels.BF16:
            skipped[tensor.tensor_type.name] = skipped.get(tensor.tensor_type.name, 0) + 1
            continue
        blocks = _gguf_blocks(tensor, qtype)
        k, n = int(tensor.shape[0]), blocks.shape[-2]
        if permute and base == "attn_q":
            blocks = gl._reverse_llama_permute(blocks, n_head)
        elif permute and base == "attn_k":
            blocks = gl._reverse_llama_permute(blocks, n_kv_head)
        blocks = torch.from_numpy(np.ascontiguousarray(blocks))
        if "{expert}" in name:            # [E, n, row bytes]: expert e's rows are blocks[e]
            for e in range(blocks.shape[0]):
                out[name.format(expert=e)] = QuantWeight(blocks[e], qtype, (n, k))
        else:
            out[name] = QuantWeight(blocks, qtype, (n, k))
    del reader
    if skipped:
        logger.info("--quantization gguf: %s tensors are not covered by the CPU kernels; they "
                    "run dequantized in float32", ", ".join(f"{c} {t}" for t, c in skipped.items()))
    return out


def _gguf_blocks(tensor, qtype: int) -> np.ndarray:
    """A GGUF GEMM tensor's blocks off the reader's memmap: uint8 [n, row bytes], an expert
    tensor's [E, n, row bytes] (GGML shape (k, n[, E]))."""
    k, *rows = (int(d) for d in tensor.shape)
    blocks = np.array(np.asarray(tensor.data).view(np.uint8)).reshape(*reversed(rows), -1)
    assert blocks.shape[-1] == (2 * k if qtype == quant_kernels.BF16
                                else quant_kernels.row_bytes(qtype, k))
    return blocks


def bf16_weights(weights: Dict[str, torch.Tensor]) -> Dict[str, QuantWeight]:
    """HF weight name -> its bf16 QuantWeight for every GEMM weight of a llama state dict (rounded
    to bf16: exact where the checkpoint is bf16); the LM head is the embedding where tied."""
    def bf16(t: torch.Tensor) -> QuantWeight:
        t = t.to(torch.bfloat16).contiguous()
        return QuantWeight(t.view(torch.uint8), quant_kernels.BF16, tuple(t.shape))
    out = {name: bf16(t) for name, t in weights.items() if _LAYER_GEMM_RE.fullmatch(name)}
    out["lm_head.weight"] = bf16(weights.get("lm_head.weight",
                                             weights["model.embed_tokens.weight"]))
    return out


def group(quant: Optional[Dict[str, QuantWeight]], names: List[str]) -> Optional[List[QuantWeight]]:
    """The QuantWeights of one fused GEMM (weights side by side along the output dim, each in its
    own type; BF16 ones only with BF16), or None when any of them is not kept in blocks (then it
    runs in float32)."""
    if not quant or any(n not in quant for n in names):
        return None
    ws = [quant[n] for n in names]
    if len({w.shape[1] for w in ws}) != 1 or len(_runs(ws)) > quant_kernels.MAX_PARTS:
        return None
    if len({w.qtype == quant_kernels.BF16 for w in ws}) != 1:
        return None
    return ws


def block_linear(weights: List[QuantWeight], bias: Optional[torch.Tensor] = None, plan=None):
    """The layer for one fused GEMM of group(): BF16Linear for bf16 weights, else QuantLinear."""
    if weights[0].qtype == quant_kernels.BF16:
        from vllm.model_executor.bf16_linear import BF16Linear
        return BF16Linear(weights, bias, plan)
    return QuantLinear(weights, bias)


INT4_TYPES = (quant_kernels.Q4_0, quant_kernels.Q4_1)     # map onto torch's 4-bit GEMM


def int4_layout(weights: List[QuantWeight]) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """torch's own 4-bit GEMM layout (_weight_int4pack_mm_for_cpu: groups of 32, a scale and a
    zero per group and column, value = (q - 8) * scale + zero) of a fused GEMM whose weights are
    all Q4_0 / Q4_1, else None: a Q4_1 value d * q + m is (q - 8) * d + (m + 8d), a Q4_0 one
    d * (q - 8) has zero 0. Scales and zeros in bf16, as the op takes them with bf16
    activations. -> (packed weight, scales_and_zeros [K / 32, N, 2])."""
    if any(w.qtype not in INT4_TYPES for w in weights):
        return None
    qs, scales, zeros = [], [], []
    for w in weights:
        n, k = w.shape
        b = w.blocks.numpy().reshape(n, k // 32, quant_kernels.BLOCK_BYTES[w.qtype])
        d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        q4_1 = w.qtype == quant_kernels.Q4_1
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if q4_1 else 0.0
        nibbles = b[..., 4 if q4_1 else 2:]           # element j in byte j % 16: low, then high
        qs.append(np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(n, k))
        scales.append(d)
        zeros.append(m + 8 * d if q4_1 else np.zeros_like(d))
    q = torch.from_numpy(np.concatenate(qs).astype(np.int32))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = np.stack([np.concatenate(scales).T, np.concatenate(zeros).T], axis=-1)
    return packed, torch.from_numpy(sz).to(torch.bfloat16).contiguous()


def _runs(weights: List[QuantWeight]) -> List[List[QuantWeight]]:
    """Consecutive weights of one type together: [Q4_K, Q4_K, Q6_K] -> [[Q4_K, Q4_K], [Q6_K]]."""
    runs: List[List[QuantWeight]] = []
    for w in weights:
        if runs and runs[-1][0].qtype == w.qtype:
            runs[-1].append(w)
        else:
            runs.append([w])
    return runs


def _part(run: List[QuantWeight]):
    """(blocks, C type, rows) of one run: its rows concatenated, repacked (16 columns
    interleaved, type | PACKED) where this CPU's kernels take the type that way."""
    blocks = torch.cat([w.blocks for w in run]) if len(run) > 1 else run[0].blocks.contiguous()
    qtype, n = run[0].qtype, sum(w.shape[0] for w in run)
    if quant_kernels.packs(qtype):
        return quant_kernels.repack(blocks, qtype), qtype | quant_kernels.PACKED, n
    return blocks, qtype, n


class QuantLinear(nn.Module):
    """y = x @ W^T (+ bias) (+ residual) with W in GGML blocks; the weights of a fused GEMM are
    given in output order, consecutive ones of one type as one part (their rows concatenated,
    Q4_0 / Q4_1 / Q8_0 repacked on x86, Q5_0 / Q4_K / Q6_K too on avx2), parts of different types
    multiplied in one call (quant_kernels.gemm_parts). Linear's interface: in_features,
    out_features, bias, forward(x, residual); `packed` is None, and the C decode layer
    multiplies `block_weight` instead."""

    packed = None
    int4 = None             # int4_layout(), in the bands (cpu_kernel_plan.band) int4_bands
    int4_bands: Tuple[int, ...] = ()

    def __init__(self, weights: List[QuantWeight], bias: Optional[torch.Tensor] = None):
        super().__init__()
        # for cpu_kernel_plan.choose_int4, which drops it
        self.int4_source = weights if all(w.qtype in INT4_TYPES for w in weights) else None
        self.in_features = weights[0].shape[1]
        self.out_features = sum(w.shape[0] for w in weights)
        runs = _runs(weights)
        self.qtypes = tuple(run[0].qtype for run in runs)
        parts = [_part(run) for run in runs]
        self.blocks = nn.ParameterList(nn.Parameter(b, requires_grad=False) for b, _, _ in parts)
        self._parts = quant_kernels.Parts(
            [(b, t, n) for b, (_, t, n) in zip(self.blocks, parts)], self.in_features)
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(),
                                                           requires_grad=False)

    @functools.cached_property
    def block_weight(self):
        """The weights for the C decode layer (cpu_kernels.BlockWeight), with the address of
        the active quant library's vq_gemm_parts."""
        from vllm.kernels import cpu_kernels
        lib = quant_kernels.library(quant_kernels.active_isa())
        gemm = ctypes.cast(lib.vq_gemm_parts, ctypes.c_void_p).value
        return cpu_kernels.BlockWeight(gemm, self._parts.count, ctypes.addressof(self._parts.types),
                                       ctypes.addressof(self._parts.ptrs),
                                       ctypes.addressof(self._parts.ns))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"type={'+'.join(quant_kernels.TYPE_NAMES[t] for t in self.qtypes)}")

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.int4 is not None and cpu_kernel_plan.band(x.shape[0]) in self.int4_bands:
            return self.int4_gemm(x, residual)
        return self.blocks_gemm(x, residual)

    def int4_gemm(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """torch's 4-bit GEMM on bf16 activations, float32 out."""
        packed, scales_and_zeros = self.int4
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, 32,
                                                       scales_and_zeros).float()
        if self.bias is not None:
            y += self.bias
        if residual is not None:
            y += residual
        return y

    def blocks_gemm(self, x: torch.Tensor,
                    residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        if len(self.qtypes) == 1:
            return quant_kernels.gemm(x, self._parts.tensors[0], self._parts.types[0],
                                      self.out_features, self.in_features, self.bias, residual)
        return quant_kernels.gemm_parts(x, self._parts, self.bias, residual)
