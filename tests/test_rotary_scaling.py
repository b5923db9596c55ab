"""RoPE scaling against transformers on real configs: the inverse frequencies, the attention
factor and the cos/sin tables are equal to transformers' in float32, exactly (yarn as gpt-oss
and Qwen3 long-context configs use it; llama3 / linear / default unchanged)."""
import copy
import logging

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from vllm.model_executor.layers.rotary_embedding import (Rotary, attention_factor,
                                                         inv_frequencies, rope_parameters)

POSITIONS = 4096
QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
              "rope_theta": 1000000.0}


@pytest.fixture(autouse=True)
def _quiet_transformers():
    # transformers warns when factor != max_position_embeddings / original (the configs' own)
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _qwen3(**rope):
    return transformers.Qwen3Config(max_position_embeddings=131072,
                                    rope_scaling={**QWEN3_YARN, **rope})


YARN_CONFIGS = {
    "gpt-oss": lambda: transformers.GptOssConfig(),           # truncate False, beta 32 / 1
    "qwen3": lambda: _qwen3(),                                # truncate default (True)
    "qwen3-no-truncate": lambda: _qwen3(truncate=False),
    "qwen3-mscale": lambda: _qwen3(mscale=1.0, mscale_all_dim=0.5),
    "qwen3-mscale-equal": lambda: _qwen3(mscale=0.707, mscale_all_dim=0.707),
    "qwen3-attention-factor": lambda: _qwen3(attention_factor=0.8),
    "qwen3-betas": lambda: _qwen3(beta_fast=16.0, beta_slow=2.0, truncate=False),
    "qwen3-factor-none": lambda: _qwen3(factor=None),         # max_position / original
    "qwen3-head-64": lambda: transformers.Qwen3Config(
        head_dim=64, rope_scaling={**QWEN3_YARN, "factor": 2.0, "rope_theta": 10000.0}),
}


def _transformers(config, kind, layer_type=None):
    # transformers standardizes (mutates) the config: ask it on a copy
    inv, scale = ROPE_INIT_FUNCTIONS[kind](copy.deepcopy(config), None, layer_type=layer_type)
    return inv, scale


def _ours(config, layer_type=None):
    theta, scaling = rope_parameters(config, layer_type)
    return inv_frequencies(config.head_dim, theta, scaling), attention_factor(scaling), \
        theta, scaling


def _positions():
    return torch.arange(POSITIONS)[None]


@pytest.mark.parametrize("name", sorted(YARN_CONFIGS))
def test_yarn_inv_frequencies_and_attention_factor_match_transformers(name):
    config = YARN_CONFIGS[name]()
    ref_inv, ref_scale = _transformers(config, "yarn")
    inv, scale, _, scaling = _ours(config)
    assert scaling["rope_type"] == "yarn"
    assert inv.dtype == ref_inv.dtype == torch.float32
    assert torch.equal(inv, ref_inv)
    assert scale == ref_scale
    if name != "qwen3-mscale-equal":
        assert scale != 1.0                                   # the tables are really scaled


def test_gpt_oss_rope_parameters_as_its_config_carries_them():
    theta, scaling = rope_parameters(transformers.GptOssConfig())
    assert theta == 150000.0
    assert {k: scaling[k] for k in ("rope_type", "factor", "beta_fast", "beta_slow",
                                    "original_max_position_embeddings", "truncate")} == {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096, "truncate": False}


@pytest.mark.parametrize("name", ["qwen3", "qwen3-no-truncate", "qwen3-mscale",
                                  "qwen3-factor-none"])
def test_yarn_tables_match_qwen3_rotary_embedding(name):
    config = YARN_CONFIGS[name]()
    _, _, theta, scaling = _ours(config)
    rotary = Rotary(config.head_dim, POSITIONS, theta, scaling, torch.float32)
    ref = Qwen3RotaryEmbedding(copy.deepcopy(config))
    cos, sin = ref(torch.zeros(1, dtype=torch.float32), _positions())
    assert torch.equal(rotary.cos, cos[0]) and torch.equal(rotary.sin, sin[0])


def test_yarn_tables_match_gpt_oss_rotary_embedding():
    # gpt-oss's table is one half ([T, D/2], rotated half against half): ours repeats it
    config = transformers.GptOssConfig()
    _, _, theta, scaling = _ours(config)
    rotary = Rotary(config.head_dim, POSITIONS, theta, scaling, torch.float32)
    cos, sin = GptOssRotaryEmbedding(copy.deepcopy(config))(torch.zeros(1), _positions())
    half = config.head_dim // 2
    for ours, ref in ((rotary.cos, cos[0]), (rotary.sin, sin[0])):
        assert torch.equal(ours[:, :half], ref) and torch.equal(ours[:, half:], ref)


def test_yarn_tables_in_bfloat16_are_the_float32_tables_cast():
    config = transformers.GptOssConfig()
    _, _, theta, scaling = _ours(config)
    f32 = Rotary(config.head_dim, 64, theta, scaling, torch.float32)
    bf16 = Rotary(config.head_dim, 64, theta, scaling, torch.bfloat16)
    assert torch.equal(bf16.cos, f32.cos.bfloat16()) and torch.equal(bf16.sin, f32.sin.bfloat16())


def test_yarn_without_original_length_falls_back_to_max_position_embeddings():
    # a config whose rope_parameters were set after init (as the GGUF reader does) is not
    # standardized: rope_parameters() fills the original length as transformers would
    config = transformers.Qwen3Config(max_position_embeddings=40960)
    config.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000000.0}
    _, scaling = rope_parameters(config)
    assert scaling["original_max_position_embeddings"] == 40960
    ref_inv, ref_scale = _transformers(config, "yarn")
    inv, scale, _, _ = _ours(config)
    assert torch.equal(inv, ref_inv) and scale == ref_scale


def test_yarn_per_layer_type_reads_truncate_from_the_top_level_dict():
    # transformers' quirk, matched: the layer's own truncate False is not read
    config = transformers.Gemma3TextConfig(rope_parameters={
        "full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6,
                           "truncate": False, "original_max_position_embeddings": 4096},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    ref_inv, ref_scale = _transformers(config, "yarn", "full_attention")
    inv, scale, _, scaling = _ours(config, "full_attention")
    assert scaling["truncate"] is True
    assert torch.equal(inv, ref_inv) and scale == ref_scale
    _, local = rope_parameters(config, "sliding_attention")
    assert local["rope_type"] == "default" and attention_factor(local) == 1.0


UNSCALED_CONFIGS = {
    "llama3": lambda: transformers.LlamaConfig(head_dim=64, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 500000.0}),
    "linear": lambda: transformers.LlamaConfig(head_dim=64, rope_parameters={
        "rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    "default": lambda: transformers.LlamaConfig(head_dim=64, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0}),
}


@pytest.mark.parametrize("name", sorted(UNSCALED_CONFIGS))
def test_llama3_linear_default_unchanged(name):
    config = UNSCALED_CONFIGS[name]()
    inv, scale, theta, scaling = _ours(config)
    assert scale == 1.0
    if name != "default":
        ref_inv, ref_scale = _transformers(config, name)
        assert torch.equal(inv, ref_inv) and ref_scale == 1.0
    rotary = Rotary(config.head_dim, POSITIONS, theta, scaling, torch.float32)
    cos, sin = LlamaRotaryEmbedding(copy.deepcopy(config))(torch.zeros(1), _positions())
    assert torch.equal(rotary.cos, cos[0]) and torch.equal(rotary.sin, sin[0])
    assert "max_position_embeddings" not in scaling           # only yarn carries it


@pytest.mark.parametrize("rope", [
    {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32,
     "original_max_position_embeddings": 4096},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "default", "partial_rotary_factor": 0.5},
])
def test_rope_the_engine_cannot_run_raises(rope):
    with pytest.raises(ValueError, match="--model"):
        Rotary(64, 16, 10000.0, rope, torch.float32)
