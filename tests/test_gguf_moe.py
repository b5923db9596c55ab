"""Mixture-of-experts GGUFs (archs qwen3moe, gpt-oss, and llama with experts = Mixtral): their
conversion into HF directories with one tensor per expert (gguf_loader) and their expert GEMMs
kept in blocks, one QuantWeight per expert (quant_linear.load_gguf_linears).

Tiny random transformers checkpoints (norms, routers, biases and sinks randomized) are written to
GGUF by llama.cpp's own convert_hf_to_gguf.py, run with this venv's python (it puts the gguf-py
beside it on sys.path itself), all float32 ("f32": the conversion must give the checkpoint back
exactly, under the canonical names the engine's MoE models take). With no llama-quantize binary
here, the "quant" variant rewrites that file with gguf-py's quantizer: experts Q8_0 / Q4_0 by
layer, attention Q4_0 / Q8_0 / F16, the LM head Q8_0, the router float32 (as llama.cpp keeps it).
gpt-oss's own MXFP4 checkpoint format goes through the converter too (it repacks the experts as
GGML MXFP4), which must convert to what transformers' convert_moe_packed_tensors makes of it.
The vocabulary is SmolLM2's (the default model's tokenizer), a BPE whose pre-tokenizer the
converter recognises; it refuses tokenizers it does not know. Where the engine runs the family
(models/registry.py), vllm.LLM runs the files too: float32 against the checkpoint, the blocks
against their float32.
"""

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm.model_executor import gguf_loader
from vllm.model_executor.gguf_file import GGUFFile
from vllm.model_executor.gguf_loader import convert_gguf

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

# llama.cpp's converter: `make install` unpacks it into the venv (Makefile, LLAMA_CPP_VERSION)
LLAMA_CPP = Path(os.environ.get("LLAMA_CPP_SRC", Path(sys.prefix) / "llama.cpp"))
CONVERT = LLAMA_CPP / "convert_hf_to_gguf.py"
ARCHS = ["qwen3moe", "mixtral", "gpt-oss"]
HF_ARCH = {"qwen3moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
           "gpt-oss": "GptOssForCausalLM"}
EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                  "ffn_down_exps": "down_proj"}

pytestmark = pytest.mark.skipif(
    not CONVERT.is_file(), reason=f"llama.cpp's converter is not at {CONVERT} (set LLAMA_CPP_SRC "
                                  "to a llama.cpp source tree)")


def _config(arch, vocab):
    import transformers
    common = dict(vocab_size=vocab, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=2.0 ** -20, initializer_range=0.2,
                  tie_word_embeddings=False)
    if arch == "qwen3moe":           # head_dim 32 != hidden / heads; 8 experts, top-2 renormed
        return transformers.Qwen3MoeConfig(
            **common, num_hidden_layers=2, head_dim=32, intermediate_size=96, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
            rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    if arch == "mixtral":            # llama's Q/K permute applies
        return transformers.MixtralConfig(
            **common, num_hidden_layers=2, head_dim=16, intermediate_size=32,
            num_local_experts=4, num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 20000.0})
    # gpt-oss: 4 layers alternating sliding (window 8) / full, YaRN not the default's
    return transformers.GptOssConfig(
        **common, num_hidden_layers=4, head_dim=16, intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "beta_fast": 16.0,
                         "beta_slow": 2.0, "truncate": False})


def _build_checkpoint(path: Path, arch: str, tokenizer_dir: Path, vocab: int) -> None:
    """A random checkpoint saved by transformers, with the SmolLM2 tokenizer files."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(_config(arch, vocab)).float()
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(("bias", "sinks")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "experts" in name or "router" in name:   # gpt-oss draws some of these as 0
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)


def _llama_cpp_convert(hf_dir: Path, out: Path) -> str:
    """convert_hf_to_gguf.py --outtype f32. Its llama path imports sentencepiece before it looks
    for a tokenizer.model (which these directories lack); without the package a stub stands in
    (never called)."""
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)               # the gguf-py beside the converter
    import importlib.util
    if importlib.util.find_spec("sentencepiece") is None:
        stub = out.parent / "sentencepiece-stub"
        stub.mkdir(exist_ok=True)
        (stub / "sentencepiece.py").write_text("class SentencePieceProcessor:\n    pass\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(stub), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, str(CONVERT), "--outtype", "f32", "--outfile",
                          str(out), str(hf_dir)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return str(out)


def _quant_type(name: str):
    """The "quant" variant's type of a GGUF tensor (None: as written, float32)."""
    if name == "output.weight":
        return T.Q8_0
    if name == "token_embd.weight":
        return T.F16
    parts = name.split(".")
    if parts[0] != "blk" or parts[-1] != "weight":
        return None
    layer, base = int(parts[1]), parts[2]
    if base in EXPERT_TENSORS:
        return (T.Q8_0, T.Q4_0)[layer % 2]
    if base in ("attn_q", "attn_k", "attn_v"):
        return (T.Q4_0, T.Q8_0)[layer % 2]
    if base == "attn_output":
        return (T.Q8_0, T.F16)[layer % 2]
    return None


def _requantize(src: str, dst: str) -> str:
    """src (all float32) rewritten by gguf-py with _quant_type's types, its metadata copied."""
    reader = GGUFFile(src)
    writer = gguf.GGUFWriter(dst, reader.get("general.architecture"))
    for key in reader.keys():
        if key != "general.architecture":
            writer.add_key_value(key, reader.get(key), *reader.value_type(key))
    for t in reader.tensors:
        assert t.tensor_type == T.F32, t.name
        data = np.array(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        qtype = _quant_type(t.name)
        if qtype is None:
            writer.add_tensor(t.name, data)
        elif qtype == T.F16:
            writer.add_tensor(t.name, data.astype(np.float16))
        else:
            writer.add_tensor(t.name, quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module")
def tokenizer_dir():
    try:
        return Path(convert_gguf(gguf_loader.find_default_model_gguf()))
    except FileNotFoundError as e:
        pytest.skip(f"the SmolLM2 tokenizer comes from the default model: {e}")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("moe-gguf")


@pytest.fixture(scope="module")
def moe(root, tokenizer_dir):
    """arch -> dict(config, hf (the checkpoint dir), f32 / quant: dict(gguf, dir)); the files
    converted under root / "cache"."""
    from transformers import AutoTokenizer
    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    cache = str(root / "cache")
    out = {}
    for arch in ARCHS:
        hf = root / arch
        _build_checkpoint(hf, arch, tokenizer_dir, vocab)
        f32 = _llama_cpp_convert(hf, root / f"{arch}-f32.gguf")
        quant = _requantize(f32, str(root / f"{arch}-quant.gguf"))
        out[arch] = {"config": _config(arch, vocab), "hf": hf,
                     "f32": {"gguf": f32, "dir": Path(convert_gguf(f32, cache_dir=cache))},
                     "quant": {"gguf": quant, "dir": Path(convert_gguf(quant, cache_dir=cache))}}
    return out


def _weights(directory):
    from safetensors.torch import load_file
    return load_file(str(Path(directory) / "model.safetensors"))


def _canonical(saved, arch):
    """A transformers checkpoint's tensors under the names the engine's MoE models take
    (model.layers.N.mlp.gate, mlp.experts.E.{gate,up,down}_proj [n, k], self_attn.sinks)."""
    out = {}
    for name, t in saved.items():
        if arch == "mixtral" and ".block_sparse_moe." in name:     # w1 gate, w3 up, w2 down
            name = name.replace(".block_sparse_moe.", ".mlp.")
            for w, proj in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                name = name.replace(f".{w}.weight", f".{proj}.weight")
        elif arch == "gpt-oss" and ".mlp.router." in name:
            name = name.replace(".mlp.router.", ".mlp.gate.")
        elif arch == "gpt-oss" and ".mlp.experts." in name:
            # [E, H, 2I] gate/up interleaved by column (x @ W), [E, I, H] down; biases [E, n]
            p = name.split(".mlp.experts.")[0] + ".mlp.experts"
            kind = name.rsplit(".", 1)[1]
            for e in range(t.shape[0]):
                if kind == "gate_up_proj":
                    out[f"{p}.{e}.gate_proj.weight"] = t[e][:, ::2].T.contiguous()
                    out[f"{p}.{e}.up_proj.weight"] = t[e][:, 1::2].T.contiguous()
                elif kind == "gate_up_proj_bias":
                    out[f"{p}.{e}.gate_proj.bias"] = t[e][::2].contiguous()
                    out[f"{p}.{e}.up_proj.bias"] = t[e][1::2].contiguous()
                elif kind == "down_proj":
                    out[f"{p}.{e}.down_proj.weight"] = t[e].T.contiguous()
                else:
                    assert kind == "down_proj_bias", name
                    out[f"{p}.{e}.down_proj.bias"] = t[e].clone()
            continue
        out[name] = t
    return out


def _expert_slices(path):
    """(HF name of expert e's weight, gguf-py's dequantization of slice e of the 3-D tensor,
    GGML type) for every expert tensor of the GGUF at path."""
    for t in GGUFFile(path).tensors:
        layer, base, kind = t.name.split(".")[1:] if t.name.startswith("blk.") else (0, "", "")
        if base not in EXPERT_TENSORS or kind != "weight":
            continue
        full = dequantize(t.data, t.tensor_type).astype(np.float32)
        assert full.ndim == 3
        for e in range(full.shape[0]):
            name = f"model.layers.{layer}.mlp.experts.{e}.{EXPERT_TENSORS[base]}.weight"
            yield name, torch.from_numpy(full[e].copy()), t.tensor_type


# --------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_config_is_the_family_config(moe, arch):
    """Every field of the checkpoint's own config comes back (experts, top-k, expert sizes,
    head_dim, rope and gpt-oss's YaRN, window and layer types), but the token ids (the
    tokenizer's) and the initializer range."""
    from transformers import AutoConfig
    f = moe[arch]
    orig = f["config"].to_dict()
    cfg = json.loads((f["quant"]["dir"] / "config.json").read_text())
    assert cfg["architectures"] == [HF_ARCH[arch]]
    assert "quantization_config" not in cfg and cfg["dtype"] == "float32"
    loaded = AutoConfig.from_pretrained(str(f["quant"]["dir"])).to_dict()
    skip = {"architectures", "dtype", "transformers_version", "bos_token_id", "eos_token_id",
            "pad_token_id", "_name_or_path", "initializer_range"}   # the last draws weights
    for key, value in orig.items():
        if key not in skip:
            assert loaded.get(key) == value, key
    if arch == "qwen3moe":
        assert (cfg["norm_topk_prob"], cfg["decoder_sparse_step"], cfg["mlp_only_layers"]) == \
            (True, 1, [])
        assert (cfg["moe_intermediate_size"], cfg["head_dim"]) == (32, 32)
    elif arch == "gpt-oss":
        assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
        assert cfg["sliding_window"] == 8 and cfg["swiglu_limit"] == 7.0
        assert cfg["experts_per_token"] == cfg["num_experts_per_tok"] == 2
        assert cfg["rope_parameters"]["rope_type"] == "yarn"
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)       # SmolLM2's


def test_moe_config_reads_what_llama_cpp_reads():
    """Keys the converter's files lack: a per-layer sliding pattern, per-layer (equal) expert
    sizes, qwen3moe YaRN; llama without experts is no MoE."""
    from types import SimpleNamespace

    def reader(arch, **keys):
        """A GGUFFile's surface: get(key, default) and tensors"""
        fields = {f"{arch}.{k.replace('__', '.')}": v for k, v in {
            "block_count": 3, "embedding_length": 64, "attention__head_count": 4,
            "attention__layer_norm_rms_epsilon": 1e-5, "context_length": 256,
            "expert_count": 4, "expert_used_count": 2, "feed_forward_length": 96,
            **keys}.items()}
        embd = SimpleNamespace(name="token_embd.weight", shape=(64, 300))
        return SimpleNamespace(get=fields.get, tensors=[embd])

    r = reader("gpt-oss", attention__sliding_window=16, expert_feed_forward_length=[32, 32, 32],
               attention__sliding_window_pattern=[False, True, True])
    c = gguf_loader._moe_config(r, "gpt-oss", {"token_embd.weight"})
    assert c.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert (c.intermediate_size, c.head_dim, c.vocab_size, c.num_key_value_heads) == \
        (32, 16, 300, 4)
    assert c.tie_word_embeddings is True
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0, "truncate": False}

    r = reader("qwen3moe", rope__scaling__type="yarn", rope__scaling__factor=4.0,
               rope__scaling__original_context_length=64, attention__key_length=24)
    c = gguf_loader._moe_config(r, "qwen3moe", {"token_embd.weight", "output.weight"})
    assert c.rope_parameters == {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 64}
    assert (c.head_dim, c.moe_intermediate_size, c.intermediate_size) == (24, 96, 96)
    assert gguf_loader._is_moe(r, "qwen3moe")
    assert not gguf_loader._is_moe(reader("llama", expert_count=0), "llama")
    with pytest.raises(ValueError, match="per-layer"):
        gguf_loader._moe_config(reader("llama", expert_feed_forward_length=[32, 64, 32]),
                                "llama", set())


# --------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_weights_are_the_checkpoint(moe, arch):
    """llama.cpp's float32 file converts back to the checkpoint bit for bit, under the canonical
    names: routers (gpt-oss's bias too), one tensor per expert (gpt-oss's fused, interleaved
    gate/up split as llama.cpp splits it), sinks, attention biases, Mixtral's Q/K un-permuted."""
    f = moe[arch]
    want = _canonical(_weights(f["hf"]), arch)
    got = _weights(f["f32"]["dir"])
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], w), name
    n = f["config"].num_local_experts
    assert sum(".mlp.experts." in k for k in got) == \
        f["config"].num_hidden_layers * n * (6 if arch == "gpt-oss" else 3)


@pytest.mark.parametrize("arch", ARCHS)
def test_quant_weights_are_gguf_py_dequantization(moe, arch):
    """The quantized file: every expert equals gguf-py's dequantization of its slice of the 3-D
    tensor; every tensor is near the checkpoint by its type (float32 ones, the router among
    them, equal)."""
    f = moe[arch]
    got = _weights(f["quant"]["dir"])
    want = _canonical(_weights(f["hf"]), arch)
    assert got.keys() == want.keys()
    seen = set()
    for name, ref, qtype in _expert_slices(f["quant"]["gguf"]):
        assert torch.equal(got[name], ref), name
        seen.add(qtype.name)
    assert seen == {"Q8_0", "Q4_0"}
    for name, w in want.items():
        err = float((got[name] - w).abs().max() / w.abs().max())
        if ".mlp.gate." in name or w.dim() == 1:
            assert err == 0, name
        else:
            assert err < 0.2, (name, err)


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_linears_keep_each_expert_in_blocks(moe, arch):
    """load_gguf_linears on the quantized file: one QuantWeight per expert (a view of the 3-D
    tensor's blocks: one storage per tensor), its dequantization gguf-py's of the slice and the
    converted float weight; the quantized attention weights and the LM head too; the router,
    F16 and float32 tensors left to the float path."""
    from transformers import AutoConfig

    from vllm.model_executor.quant_linear import load_gguf_linears

    f = moe[arch]
    config = AutoConfig.from_pretrained(str(f["quant"]["dir"]))
    quant = load_gguf_linears(f["quant"]["gguf"], config)
    got = _weights(f["quant"]["dir"])
    experts = {name: (ref, int(qtype)) for name, ref, qtype in _expert_slices(f["quant"]["gguf"])}
    attn = {name for name in got if "self_attn" in name and name.endswith("proj.weight")
            and not (name.endswith("o_proj.weight") and int(name.split(".")[2]) % 2)}
    assert set(quant) == set(experts) | attn | {"lm_head.weight"}
    storages = {}
    for name, w in quant.items():
        blocks = w.blocks.numpy()
        deq = torch.from_numpy(dequantize(blocks, T(w.qtype)).astype(np.float32))
        assert w.shape == tuple(got[name].shape) and torch.equal(deq, got[name]), name
        if name in experts:
            ref, qtype = experts[name]
            assert w.qtype == qtype and torch.equal(deq, ref), name
            tensor = (name.split(".mlp.experts.")[0], name.rsplit(".", 2)[1])  # layer, proj
            storages.setdefault(tensor, set()).add(w.blocks.untyped_storage().data_ptr())
    n_tensors = f["config"].num_hidden_layers * 3
    assert len(storages) == n_tensors and all(len(s) == 1 for s in storages.values())


def test_gpt_oss_mxfp4_experts_dequantized(moe, tmp_path, caplog):
    """gpt-oss's MXFP4 checkpoint format (expert blocks and E8M0 scales, random here) through
    llama.cpp's converter (repacked as GGML MXFP4): the converted experts equal what
    transformers' convert_moe_packed_tensors makes of the checkpoint (split as the float
    checkpoint's), with one log line; load_gguf_linears leaves MXFP4 to the float path."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from vllm.model_executor.quant_linear import load_gguf_linears

    hf = tmp_path / "gpt-oss-mxfp4"
    shutil.copytree(moe["gpt-oss"]["hf"], hf)
    saved = load_file(str(hf / "model.safetensors"))
    g = torch.Generator().manual_seed(9)
    for name in [k for k in saved if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, n = saved.pop(name).shape                      # [E, in, out]
        saved[name + "_blocks"] = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8,
                                                generator=g)
        saved[name + "_scales"] = torch.randint(120, 128, (e, n, k // 32), dtype=torch.uint8,
                                                generator=g)
    save_file(saved, str(hf / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((hf / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (hf / "config.json").write_text(json.dumps(cfg))

    path = _llama_cpp_convert(hf, tmp_path / "gpt-oss-mxfp4.gguf")
    with caplog.at_level(logging.INFO, logger="vllm.model_executor.gguf_loader"):
        out = Path(convert_gguf(path, cache_dir=str(tmp_path / "cache")))
    assert "12 MXFP4 expert tensors dequantized to float32" in caplog.text    # 4 layers x 3
    for name in [k for k in saved if k.endswith("_blocks")]:
        p = name[:-len("_blocks")]
        saved[p] = convert_moe_packed_tensors(saved.pop(name), saved.pop(p + "_scales"),
                                              dtype=torch.float32)
    want = _canonical(saved, "gpt-oss")
    got = _weights(out)
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert torch.equal(got[name], w), name
    assert {t.tensor_type.name for t in GGUFFile(path).tensors
            if t.name.endswith("_exps.weight")} == {"MXFP4"}
    quant = load_gguf_linears(path, AutoConfig.from_pretrained(str(out)))
    assert not any(".mlp.experts." in name for name in quant)


# --------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_cache(root, moe):
    """$VLLM_CACHE_ROOT at the fixture's cache, so LLM(<.gguf>) finds the conversions made there
    (not a copy per run in the user's cache); the compiled CPU kernels are the usual ones."""
    from vllm import envs
    kernels = envs.VLLM_CACHE_ROOT / "cpu_kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (root / "cache" / "cpu_kernels").symlink_to(kernels)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CACHE_ROOT", str(root / "cache"))
        yield


def _engine(model, **kwargs):
    from vllm import LLM
    return LLM(str(model), num_gpu_blocks_override=64, max_model_len=256, **kwargs)


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_runs_the_gguf(moe, engine_cache, arch):
    """vllm.LLM on the GGUFs: the float32 file (quantization="none") gives the checkpoint's
    greedy tokens (the same weights under the canonical names, the same config); the quantized
    file with quantization="gguf" runs its experts in blocks (a QuantLinear per expert GEMM),
    within KL 2e-3 per prompt position (top 20 renormalised) of the same file in float32 (they
    differ by int8 activations and the bf16 KV cache "gguf" brings), and within 0.5 of the
    checkpoint (mostly the Q4_0 rounding of random weights of std 0.2)."""
    from tests.conftest import prompt_kls
    from vllm import SamplingParams
    from vllm.model_executor.quant_linear import QuantLinear

    from vllm.model_executor.models import registry
    try:
        registry.resolve([HF_ARCH[arch]])
    except (ImportError, ValueError) as e:
        pytest.skip(f"the engine does not run {HF_ARCH[arch]} yet: {e}")
    f = moe[arch]
    g = torch.Generator().manual_seed(10)
    prompts = [{"prompt_token_ids": torch.randint(3, f["config"].vocab_size, (n,),
                                                  generator=g).tolist()} for n in (21, 30)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20)

    def run(model, params, **kwargs):
        outs = _engine(model, **kwargs).generate(prompts, params, use_tqdm=False)
        if params is greedy:
            return [o.outputs[0].token_ids for o in outs]
        return outs[0].prompt_logprobs

    assert run(f["f32"]["gguf"], greedy, quantization="none") == run(f["hf"], greedy)
    blocks = _engine(f["quant"]["gguf"], quantization="gguf")
    model = blocks.llm_engine.model_executor.driver_worker.model
    n_quant = sum(isinstance(m, QuantLinear) for m in model.modules())
    assert n_quant >= 2 * f["config"].num_hidden_layers * f["config"].num_local_experts
    got = blocks.generate(prompts, scored, use_tqdm=False)[0].prompt_logprobs
    del blocks, model
    kls = prompt_kls(run(f["quant"]["gguf"], scored, quantization="none"), got)
    assert max(kls) < 2e-3, kls                  # 4e-5 .. 2.3e-4 seen
    kls = prompt_kls(run(f["hf"], scored), got)
    assert max(kls) < 0.5, kls                   # 0.11 .. 0.33 seen
