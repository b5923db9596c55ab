"""Test material for the GGUF K-quant kernels: random block bytes with valid fp16 scales, and a
tiny llama GGUF written with gguf's own writer whose GEMM weights are such blocks."""
import numpy as np

from vllm.kernels.quant_kernels import BF16, BLOCK_BYTES, BLOCK_ELEMS, Q4_K, Q5_0, Q5_1, Q6_K

# fp16 scale fields of the random-byte types: (byte offset, magnitude range) giving weights of
# std ~0.05 (Q4_K: d * sc * q has std ~218 d; dmin ~7.5 d centres it)
_SCALES = {Q5_0: [(0, (1e-3, 1e-2))],
           Q5_1: [(0, (1e-3, 1e-2)), (2, (1e-2, 1e-1))],
           Q4_K: [(0, (1e-4, 3e-4)), (2, (8e-4, 2e-3))],
           Q6_K: [(208, (6e-5, 1.2e-4))]}


def random_blocks(rng, n: int, k: int, qtype: int) -> np.ndarray:
    """W [n, k] as uint8 [n, row bytes] of random block bytes whose fp16 scales are finite
    (a quarter of them negative, the first block's zero). Q6_K's int8 sub-block scales are kept
    within +-40. BF16: normal weights of std 0.05 rounded to bf16, as uint8 [n, 2 k]."""
    if qtype == BF16:
        import torch
        w = torch.from_numpy(rng.normal(0.0, 0.05, (n, k)).astype(np.float32))
        return w.bfloat16().view(torch.uint8).numpy()
    nblk = k // BLOCK_ELEMS[qtype]
    b = rng.integers(0, 256, (n, nblk, BLOCK_BYTES[qtype]), dtype=np.uint8)
    for offset, (lo, hi) in _SCALES[qtype]:
        v = rng.uniform(lo, hi, (n, nblk)) * rng.choice([1, 1, 1, -1], (n, nblk))
        v[0, 0] = 0.0
        b[..., offset:offset + 2] = v.astype(np.float16)[..., None].view(np.uint8)
    if qtype == Q6_K:
        b[..., 192:208] = rng.integers(-40, 41, (n, nblk, 16)).astype(np.int8).view(np.uint8)
    return b.reshape(n, -1)


# GEMM weight types of the tiny GGUF per layer, as a Q4_K_M file mixes them (fused Q/K/V and
# gate/up of two types; Q5_0 and Q5_1 as the fallbacks)
LAYER_TYPES = [
    {"attn_q": Q4_K, "attn_k": Q4_K, "attn_v": Q6_K, "attn_output": Q5_0,
     "ffn_gate": Q4_K, "ffn_up": Q5_0, "ffn_down": Q6_K},
    {"attn_q": Q5_0, "attn_k": Q5_1, "attn_v": Q5_0, "attn_output": Q6_K,
     "ffn_gate": Q6_K, "ffn_up": Q4_K, "ffn_down": Q4_K},
]
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 300


def write_llama_gguf(path: str, seed: int = 0, layer_types=LAYER_TYPES, embd: int = Q4_K,
                     output: int = Q6_K) -> str:
    """A 2-layer llama GGUF (hidden 256, 4 heads / 2 KV heads, intermediate 512) with a
    byte-level vocabulary of 300: GEMM weights random blocks of `layer_types`, the token
    embedding `embd`, the output `output`, the norms float32."""
    import gguf
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(1024)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(len(layer_types))
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    _byte_level_vocab(w, VOCAB)

    def quant(name, n, k, qtype):
        w.add_tensor(name, random_blocks(rng, n, k, qtype),
                     raw_dtype=gguf.GGMLQuantizationType(qtype))
    quant("token_embd.weight", VOCAB, HIDDEN, embd)
    quant("output.weight", VOCAB, HIDDEN, output)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    kv = KV_HEADS * HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTERMEDIATE, HIDDEN),
              "ffn_up": (INTERMEDIATE, HIDDEN), "ffn_down": (HIDDEN, INTERMEDIATE)}
    for layer, types in enumerate(layer_types):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(HIDDEN, np.float32))
        for name, (n, k) in shapes.items():
            quant(f"blk.{layer}.{name}.weight", n, k, types[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --------------------------------------------------------------------------
# qwen3 / gemma3: a transformers checkpoint written as llama.cpp's converter writes it
# --------------------------------------------------------------------------

F32, F16 = 0, 1          # GGML's float types (gguf.GGMLQuantizationType)


def _byte_level_vocab(w, vocab: int) -> None:
    """The test GGUFs' byte-level vocabulary (<unk> <s> </s>, the 256 bytes, two merges,
    placeholders up to `vocab`)."""
    from tokenizers import pre_tokenizers
    tokens = ["<unk>", "<s>", "</s>"] + list(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he"]
    tokens += [f"<extra{i}>" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def write_family_gguf(path: str, arch: str, config, state_dict, types=None, seed: int = 0) -> str:
    """A transformers Qwen3 / Gemma 3 (text) checkpoint as a GGUF of `arch` ("qwen3" or
    "gemma3"), with the metadata keys and tensor names llama.cpp's convert_hf_to_gguf.py writes
    (names from gguf's own TensorNameMap; Q/K rows as they are: llama.cpp permutes only llama's;
    every Gemma norm stored as 1 + w). `types`: HF weight name -> GGML type; F32 where not given
    (norms always). F16 / BF16 / Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 are the weight quantized with
    gguf.quants; Q4_K / Q6_K (which gguf cannot quantize) are random blocks of random_blocks(),
    not the weight. The vocabulary is write_llama_gguf's, of config.vocab_size tokens."""
    import gguf
    from gguf.quants import quantize
    rng = np.random.default_rng(seed)
    types = types or {}
    names = gguf.get_tensor_name_map(
        {"qwen3": gguf.MODEL_ARCH.QWEN3, "gemma3": gguf.MODEL_ARCH.GEMMA3}[arch],
        config.num_hidden_layers)
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "gemma3":
        w.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
        w.add_sliding_window(config.sliding_window)
    else:
        w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    _byte_level_vocab(w, config.vocab_size)

    for hf_name, tensor in state_dict.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, _, kind = hf_name.rpartition(".")
        name = f"{names.get_name(base)}.{kind}"
        data = tensor.detach().float().numpy()
        if base.endswith("norm"):
            if arch == "gemma3":
                data = data + np.float32(1.0)
            w.add_tensor(name, np.ascontiguousarray(data, np.float32))
            continue
        qtype = types.get(hf_name, F32)
        if qtype == F32:
            w.add_tensor(name, np.ascontiguousarray(data, np.float32))
        elif qtype == F16:
            w.add_tensor(name, data.astype(np.float16))
        elif qtype in (Q4_K, Q6_K):
            w.add_tensor(name, random_blocks(rng, *data.shape, qtype),
                         raw_dtype=gguf.GGMLQuantizationType(qtype))
        else:
            qt = gguf.GGMLQuantizationType(qtype)
            w.add_tensor(name, quantize(data, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
