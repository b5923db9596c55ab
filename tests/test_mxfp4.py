"""MXFP4 expert weights: dequantized exactly as transformers' convert_moe_packed_tensors (its
[E, in, out] transpose included) and back to a known float checkpoint in its unquantized names."""
import logging

import pytest
import torch
import transformers
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from vllm.model_executor.layers import mxfp4

P = "model.layers.0.mlp.experts."


def _packed(shape, seed, scale_lo=0, scale_hi=256):
    """Random blocks [*shape, 16] and scales [*shape] (all 256 bytes by default: e8m0 255 and
    the smallest exponents included, where a float32 ldexp overflows or is subnormal)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(scale_lo, scale_hi, shape, dtype=torch.uint8, generator=g)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 24, 2), (2, 16, 3)])    # [E, out, in / 32]
def test_random_blocks_equal_transformers(dtype, shape):
    blocks, scales = _packed(shape, seed=sum(shape))
    ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    got = mxfp4.dequantize_experts(blocks, scales, dtype)
    assert got.shape == ref.shape == (shape[0], shape[2] * 32, shape[1])
    assert got.dtype == dtype and got.is_contiguous()
    # bit for bit: -0.0 and the overflow of the largest scales included
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits), ref.view(bits))
    assert got.isinf().any() and (got == 0).logical_and(got.signbit()).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_scale_and_byte_equals_transformers(dtype):
    # row s holds scale s in every block; its 16 blocks hold the 256 bytes
    blocks = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16).expand(1, 256, 16, 16)
    scales = torch.arange(256, dtype=torch.uint8).reshape(1, 256, 1).expand(1, 256, 16)
    ref = convert_moe_packed_tensors(blocks.contiguous(), scales.contiguous(), dtype=dtype)
    got = mxfp4.dequantize_experts(blocks, scales, dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits), ref.view(bits))


def test_checkpoint_pairs_are_replaced_in_the_unquantized_layout():
    e, inter, hidden = 2, 64, 96
    gate_up = _packed((e, 2 * inter, hidden // 32), seed=1, scale_lo=120, scale_hi=134)
    down = _packed((e, hidden, inter // 32), seed=2, scale_lo=120, scale_hi=134)
    bias = torch.randn(e, 2 * inter, dtype=torch.bfloat16)
    router = torch.randn(e, hidden)
    weights = {P + "gate_up_proj_blocks": gate_up[0], P + "gate_up_proj_scales": gate_up[1],
               P + "gate_up_proj_bias": bias, P + "down_proj_blocks": down[0],
               P + "down_proj_scales": down[1], "model.layers.0.mlp.router.weight": router}
    out = mxfp4.dequantize_checkpoint(weights, torch.float32)
    assert list(out) == [P + "gate_up_proj", P + "gate_up_proj_bias", P + "down_proj",
                         "model.layers.0.mlp.router.weight"]
    assert out[P + "gate_up_proj"].shape == (e, hidden, 2 * inter)     # GptOssExperts' [E, H, 2I]
    assert out[P + "down_proj"].shape == (e, inter, hidden)            # and [E, I, H]
    assert torch.equal(out[P + "gate_up_proj"], convert_moe_packed_tensors(*gate_up,
                                                                           dtype=torch.float32))
    assert torch.equal(out[P + "down_proj"], convert_moe_packed_tensors(*down,
                                                                        dtype=torch.float32))
    assert out[P + "gate_up_proj_bias"] is bias
    assert out["model.layers.0.mlp.router.weight"] is router
    assert len(weights) == 6                                           # the input is untouched


def _quantize(w: torch.Tensor):
    """Reference quantizer for w [E, in, out] whose every value is an e2m1 value times its
    block's power of two: -> the disk's blocks [E, out, in/32, 16] and scales [E, out, in/32]."""
    rows = w.transpose(1, 2)                                           # [E, out, in]
    e, r, k = rows.shape
    rows = rows.reshape(e, r, k // 32, 32)
    exponent = torch.floor(torch.log2(rows.abs().amax(-1) / 6.0)).to(torch.int32)
    mant = rows / torch.exp2(exponent.float())[..., None]              # in the e2m1 range
    table = torch.tensor(mxfp4.E2M1)
    codes = (mant[..., None] == table).float().argmax(-1).to(torch.uint8)  # -0.0 == 0.0: code 0
    assert torch.equal(table[codes.long()], mant), "not a representable tensor"
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)                # low nibble first
    return blocks, (exponent + 127).to(torch.uint8)


def test_round_trip_of_representable_values():
    e, inter, hidden = 2, 32, 64
    g = torch.Generator().manual_seed(5)
    table = torch.tensor(mxfp4.E2M1)

    def weight(inputs, outputs):
        codes = torch.randint(0, 16, (e, outputs, inputs // 32, 32), generator=g)
        codes[..., 0] = 7                                              # 6.0: the block's max
        exps = torch.randint(-10, 4, (e, outputs, inputs // 32, 1), generator=g)
        rows = table[codes] * torch.exp2(exps.float())
        return rows.reshape(e, outputs, inputs).transpose(1, 2).contiguous()

    gate_up, down = weight(hidden, 2 * inter), weight(inter, hidden)   # [E, H, 2I], [E, I, H]
    weights = {}
    for name, w in (("gate_up_proj", gate_up), ("down_proj", down)):
        weights[P + name + "_blocks"], weights[P + name + "_scales"] = _quantize(w)
    assert weights[P + "gate_up_proj_blocks"].shape == (e, 2 * inter, hidden // 32, 16)
    out = mxfp4.dequantize_checkpoint(weights, torch.float32)
    assert torch.equal(out[P + "gate_up_proj"], gate_up) and torch.equal(out[P + "down_proj"], down)
    bf16 = mxfp4.dequantize_checkpoint(weights, torch.bfloat16)
    assert torch.equal(bf16[P + "down_proj"], down.bfloat16())


def test_nibble_order_and_scale_bias():
    # byte 0x21: input 0 is code 1 (0.5), input 1 code 2 (1.0); scale 128 -> x2
    blocks = torch.zeros(2, 16, dtype=torch.uint8)                     # one row, two blocks
    blocks[0, 0], blocks[1, 0] = 0x21, 0x9F                  # -6.0, -0.5; scale 126: x0.5
    got = mxfp4.dequantize(blocks, torch.tensor([128, 126], dtype=torch.uint8))
    assert got.shape == (64,)
    assert got[:3].tolist() == [1.0, 2.0, 0.0] and got[32:34].tolist() == [-3.0, -0.25]


def test_unpaired_parts_raise():
    blocks, scales = _packed((1, 8, 1), seed=3)
    with pytest.raises(ValueError, match="--model"):
        mxfp4.dequantize_checkpoint({P + "down_proj_blocks": blocks}, torch.float32)
    with pytest.raises(ValueError, match="--model"):
        mxfp4.dequantize_checkpoint({P + "down_proj_scales": scales}, torch.float32)


def test_is_quantized_part():
    assert mxfp4.is_quantized_part(P + "gate_up_proj_blocks")
    assert mxfp4.is_quantized_part(P + "down_proj_scales")
    for name in (P + "gate_up_proj", P + "gate_up_proj_bias", "model.layers.0.self_attn.sinks",
                 "model.layers.0.self_attn.k_proj.weight_scale"):
        assert not mxfp4.is_quantized_part(name)


def test_check_config():
    mxfp4.check_config(transformers.GptOssConfig())                    # no quantization_config
    mxfp4.check_config(transformers.GptOssConfig(quantization_config={
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}))
    mxfp4.check_config(transformers.GptOssConfig(quantization_config=transformers.Mxfp4Config()))
    for method in ("fp8", "awq", None):
        config = transformers.GptOssConfig(quantization_config={"quant_method": method})
        with pytest.raises(ValueError, match="quant_method"):
            mxfp4.check_config(config)


def test_logs_the_bytes_once(caplog):
    blocks, scales = _packed((2, 8, 4), seed=4)
    with caplog.at_level(logging.INFO, logger="vllm.model_executor.layers.mxfp4"):
        mxfp4.dequantize_checkpoint({P + "down_proj_blocks": blocks,
                                     P + "down_proj_scales": scales}, torch.float32)
    lines = [r.getMessage() for r in caplog.records if "mxfp4" in r.getMessage()]
    assert len(lines) == 1 and "float32" in lines[0]
    with caplog.at_level(logging.INFO, logger="vllm.model_executor.layers.mxfp4"):
        caplog.clear()
        mxfp4.dequantize_checkpoint({"model.norm.weight": torch.ones(4)}, torch.float32)
    assert not caplog.records                                          # nothing dequantized
