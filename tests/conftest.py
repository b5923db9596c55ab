"""Shared fixtures: tiny random checkpoints (Llama, Mistral, Qwen2; Qwen3, Gemma 3 and a Mistral
with a 12-token window) built with transformers."""
import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels on CPU run interpreted; the flag is read when a kernel module is imported, so it
# is set here, before any test module (tests/gpu's import them at the top) is collected
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))

from vllm.kernels import cpu_kernels  # noqa: E402  (after TRITON_INTERPRET)

VOCAB = 512


@pytest.fixture(params=cpu_kernels.ISAS)
def isa(request, monkeypatch):
    """Each C kernel instruction-set variant this CPU can run (generic always), active for the
    test."""
    if request.param not in cpu_kernels.runnable_isas():
        pytest.skip(f"this CPU cannot run {request.param}")
    monkeypatch.setenv("VLLM_CPU_ISA", request.param)
    cpu_kernels.active_isa.cache_clear()
    yield request.param
    cpu_kernels.active_isa.cache_clear()


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def _byte_tokenizer():
    """A byte-level BPE with no merges: every text encodes (one token per byte), so grammars
    over JSON, regexes and tool calls can be followed by a tiny random model."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):   # a set: its order varies by run
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def build_tiny_model(path: str, arch: str = "llama", seed: int = 0, tokenizer: str = "words",
                     **overrides) -> str:
    """tokenizer: "words" (w3 .. w511, one token per word) or "bytes" (byte-level, any text)."""
    import transformers
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                                        "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 64,
                                                        "rope_theta": 50000.0}, **overrides)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=None, tie_word_embeddings=False,
                                         **overrides)
        model = transformers.MistralForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True, **overrides)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    model.save_pretrained(path)
    (_byte_tokenizer() if tokenizer == "bytes" else _tokenizer()).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: build_tiny_model(str(root / arch), arch) for arch in ("llama", "mistral", "qwen2")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def tiny_llama_bytes(tmp_path_factory):
    """A tiny random Llama with the byte-level tokenizer (structured outputs, tool calls)."""
    return build_tiny_model(str(tmp_path_factory.mktemp("models") / "llama-bytes"), "llama",
                            tokenizer="bytes")


def random_prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (L,), generator=g).tolist() for L in lens]


def prompt_kls(ref, got):
    """Per prompt position after the first, KL(ref || got) of the next-token distributions two
    runs' prompt logprobs give (their common top-k ids, renormalised)."""
    kls = []
    for r, g in zip(ref[1:], got[1:]):
        ids = sorted(set(r) & set(g))
        p = torch.tensor([r[i].logprob for i in ids]).softmax(0)
        q = torch.tensor([g[i].logprob for i in ids]).softmax(0)
        kls.append(float((p * (p.log() - q.log())).sum()))
    return kls


def greedy_checked(model_dir: str, prompts, max_tokens: int, params=None, **kwargs):
    """The engine's greedy tokens for token-id prompts, batched (params: other sampling), then
    its invariants and an empty pool checked. -> (token ids per prompt, the LLM)."""
    from vllm import LLM, SamplingParams
    llm = LLM(model_dir, **kwargs)
    params = params or SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.check_invariants()
    assert llm.llm_engine.kv.bm.num_free_blocks == llm.llm_engine.kv.bm.num_blocks
    return [o.outputs[0].token_ids for o in outs], llm


def hf_greedy(model_dir: str, prompts, max_new_tokens: int):
    """Reference: transformers generate, float32, one prompt at a time (no padding)."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                               min_new_tokens=max_new_tokens, pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
    return outs


# ---- families beyond the Llama layer (tests/test_model_families.py) ----------------------------
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _randomize_norms(model, around: float) -> None:
    """Every norm weight drawn around `around` (1 for x * w norms, 0 for Gemma's x * (1 + w))."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(around + 0.3 * torch.randn(p.shape, generator=g))


def build_family_model(path: str, family: str) -> str:
    import transformers
    torch.manual_seed(3)
    if family == "qwen3":            # head_dim 32 != hidden / heads (16)
        cfg = transformers.Qwen3Config(**COMMON, num_hidden_layers=2, head_dim=32,
                                       tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default",
                                                        "rope_theta": 20000.0})
        model = transformers.Qwen3ForCausalLM(cfg)
        _randomize_norms(model, 1.0)
    elif family == "gemma3":         # two full layers among six, window 8, distinct RoPEs
        cfg = transformers.Gemma3TextConfig(
            **COMMON, num_hidden_layers=6, head_dim=32, sliding_window=8,
            query_pre_attn_scalar=24, rms_norm_eps=1e-6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention",
                         "sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                "rope_theta": 100000.0},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 10000.0}})
        model = transformers.Gemma3ForCausalLM(cfg)
        _randomize_norms(model, 0.0)
        with torch.no_grad():        # tied and scaled by sqrt(hidden): keep it small
            model.model.embed_tokens.weight.mul_(0.1)
    elif family == "mistral-w12":
        cfg = transformers.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=12,
                                         tie_word_embeddings=False)
        model = transformers.MistralForCausalLM(cfg)
        _randomize_norms(model, 1.0)
    else:
        raise ValueError(family)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


FAMILIES = ["qwen3", "gemma3", "mistral-w12"]

# ---- mixture-of-experts families (tests/test_moe_models.py) --------------------------------------
MOE_COMMON = dict(COMMON, intermediate_size=64)


def _randomize_biases(model, std: float = 0.5) -> None:
    """Every bias and attention sink drawn N(0, std): a bias or sink left out fails."""
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.copy_(std * torch.randn(p.shape, generator=g))


def build_moe_model(path: str, family: str) -> str:
    """Tiny random MoE checkpoints: routers drawn with the other weights (N(0, 0.2): no top-k
    ties), norms, biases and sinks randomized; experts of 32 (the C activation's width)."""
    import transformers
    torch.manual_seed(4)
    if family == "qwen3-moe":        # layer 1 dense (mlp_only_layers), 8 experts, top-2 renormed
        cfg = transformers.Qwen3MoeConfig(
            **MOE_COMMON, num_hidden_layers=3, head_dim=32, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
            mlp_only_layers=[1], tie_word_embeddings=False)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif family == "mixtral":        # 4 experts, top-2
        cfg = transformers.MixtralConfig(**dict(MOE_COMMON, intermediate_size=32),
                                         num_hidden_layers=2, num_local_experts=4,
                                         num_experts_per_tok=2, tie_word_embeddings=False)
        model = transformers.MixtralForCausalLM(cfg)
    elif family == "gpt-oss":        # sliding 16 / full, sinks, YaRN, biased router, clamped GLU
        cfg = transformers.GptOssConfig(
            **dict(MOE_COMMON, intermediate_size=32), num_hidden_layers=2, head_dim=16,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
            tie_word_embeddings=False, swiglu_limit=1.0)
        model = transformers.GptOssForCausalLM(cfg)
        with torch.no_grad():        # transformers draws these 0 / N(0, std) in _init_weights
            for name, p in model.named_parameters():
                if "experts" in name and not name.endswith("bias"):
                    p.normal_(0, 0.2)
        _randomize_biases(model)
    else:
        raise ValueError(family)
    _randomize_norms(model, 1.0)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


MOE_FAMILIES = ["qwen3-moe", "mixtral", "gpt-oss"]


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {f: build_moe_model(str(root / f), f) for f in MOE_FAMILIES}


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: build_family_model(str(root / f), f) for f in FAMILIES}
