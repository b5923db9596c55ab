"""MXFP4 expert weights (gpt-oss checkpoints), dequantized once at load to the tensors an
unquantized checkpoint holds, under its names and in its layout (transformers' dequantize=True):

    on disk (P = model.layers.N.mlp.experts)            after dequantize_checkpoint
    P.gate_up_proj_blocks  uint8 [E, 2I, H/32, 16]  ->  P.gate_up_proj [E, H, 2I]
                                                        (gate, up interleaved: g0 u0 g1 u1 ..)
    P.gate_up_proj_scales  uint8 [E, 2I, H/32]
    P.down_proj_blocks     uint8 [E, H, I/32, 16]   ->  P.down_proj    [E, I, H]
    P.down_proj_scales     uint8 [E, H, I/32]

A block is 32 consecutive inputs of one output row: 16 bytes of FP4 (e2m1) codes, two a byte,
low nibble first, and one scale byte, an exponent biased by 127 (e8m0): value = code * 2^(s - 127).
The disk layout is [out, in]; the unquantized one [in, out] (x @ w), hence the transpose."""
import logging
from typing import Dict

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# e2m1 code -> value: bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS, SCALES = "_blocks", "_scales"


def check_config(hf_config) -> None:
    """ValueError for a quantization_config the engine cannot run (any method but mxfp4)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    if method != "mxfp4":
        raise ValueError(f"--model: quantization_config quant_method {method!r} is not "
                         f"supported; supported: ['mxfp4']")


def is_quantized_part(name: str) -> bool:
    """A packed tensor (uint8 blocks or scales) that a loader must not cast to a float dtype."""
    return name.endswith(BLOCKS) or name.endswith(SCALES)


def _byte_table(dtype, device) -> torch.Tensor:
    """[256 * 256, 2]: row (scale << 8) | byte holds the byte's two inputs, low nibble first,
    times 2^(scale - 127): e2m1 values in dtype through ldexp, cast back to dtype, the rounding
    transformers' dequantization has (every scale's overflow and subnormals included)."""
    lut = torch.tensor(E2M1, dtype=dtype, device=device)
    exponents = torch.arange(256, dtype=torch.int32, device=device) - 127
    grid = torch.ldexp(lut.expand(256, 16), exponents[:, None].expand(256, 16)).to(dtype)
    byte = torch.arange(256, device=device)
    return torch.stack((grid[:, byte & 0x0F], grid[:, byte >> 4]), dim=-1).reshape(256 * 256, 2)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in dtype."""
    assert blocks.dtype == scales.dtype == torch.uint8, (blocks.dtype, scales.dtype)
    assert blocks.shape[-1] == 16 and blocks.shape[:-1] == scales.shape, \
        (blocks.shape, scales.shape)
    # one lookup a byte, 3x faster than a lookup a nibble then ldexp: [.., G, 16] -> [.., G, 16, 2]
    rows = (scales.int()[..., None] << 8) | blocks.int()
    return F.embedding(rows, _byte_table(dtype, blocks.device)).flatten(-3)


def dequantize_experts(blocks: torch.Tensor, scales: torch.Tensor, dtype) -> torch.Tensor:
    """[E, R, G, 16] + [E, R, G] -> [E, G * 32, R] contiguous; one expert at a time, so the
    temporaries are an expert's, not the whole tensor's."""
    assert blocks.dim() == 4, blocks.shape
    e, r, g, _ = blocks.shape
    out = torch.empty(e, g * 32, r, dtype=dtype, device=blocks.device)
    for i in range(e):
        out[i] = dequantize(blocks[i], scales[i], dtype).t()
    return out


def dequantize_checkpoint(weights: Dict[str, torch.Tensor], dtype) -> Dict[str, torch.Tensor]:
    """The checkpoint with each X_blocks / X_scales pair replaced by X, dequantized (in the
    blocks' place in the order); every other tensor is passed through as is."""
    out: Dict[str, torch.Tensor] = {}
    packed = size = count = 0
    for name, tensor in weights.items():
        if name.endswith(SCALES):
            if name[:-len(SCALES)] + BLOCKS not in weights:
                raise ValueError(f"--model: checkpoint has {name} but no {BLOCKS} beside it")
            continue
        if not name.endswith(BLOCKS):
            out[name] = tensor
            continue
        base = name[:-len(BLOCKS)]
        scales = weights.get(base + SCALES)
        if scales is None:
            raise ValueError(f"--model: checkpoint has {name} but no {SCALES} beside it")
        out[base] = dequantize_experts(tensor, scales, dtype)
        packed += tensor.nbytes + scales.nbytes
        size += out[base].nbytes
        count += 1
    if count:
        logger.info("mxfp4: %d expert tensors dequantized to %s: %.2f GiB (%.2f GiB packed)",
                    count, str(dtype).replace("torch.", ""), size / 2**30, packed / 2**30)
    return out
