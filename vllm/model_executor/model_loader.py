"""Build a model from a local HF directory (safetensors or .bin weights), or with random weights
from its config alone (--load-format dummy), on the engine's device: weights are read (or drawn)
straight onto it, never staged whole in host memory. With tensor parallelism each rank reads
only its shard (TPShards: safetensors slices; a .bin file or a dummy tensor is sliced one tensor
at a time)."""
import glob
import logging
import os
from typing import Dict, Optional, Tuple

import torch
from transformers import AutoConfig

from vllm.distributed.tp_group import TPGroup
from vllm.model_executor.layers import mxfp4
from vllm.model_executor.models import registry
from vllm.model_executor.tp_shards import TPShards

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
logger = logging.getLogger(__name__)

# set on the HF config by the engine (it travels to every rank with it): the GGUF whose block
# weights --quantization gguf keeps
GGUF_QUANT_ATTR = "vllm_gguf_quantized_file"
GGUF_KEEP_FLOAT32_ATTR = "vllm_gguf_keep_float32"     # --quantization auto: float32 kept too
# CPU bf16 weights (resolve_cpu_dtype): "bfloat16" (--dtype bfloat16) or "auto" (a bf16
# checkpoint under --dtype auto, kept in float32 too and timed against it)
BF16_WEIGHTS_ATTR = "vllm_bf16_weights"


def resolve_cpu_dtype(dtype: str, device: str, hf_config, tp_size: int,
                      quantization: str) -> str:
    """The compute dtype of a model on `device`, marking hf_config where its GEMM weights stay
    in bf16 on the CPU (BF16_WEIGHTS_ATTR): --dtype bfloat16, or --dtype auto on a checkpoint
    whose own dtype is bfloat16; activations and accumulation are float32 then (the KV cache
    bfloat16: kv_quant.resolve). Tensor parallelism, or no C kernels (VLLM_KERNEL_BACKEND=torch),
    keeps torch's bf16 path (--dtype bfloat16) or float32 (auto)."""
    from vllm.kernels import ops
    own = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    mode = ("bfloat16" if dtype == "bfloat16" else
            "auto" if dtype == "auto" and str(own).removeprefix("torch.") == "bfloat16"
            else None)
    if device != "cpu" or tp_size > 1 or quantization == "gguf" or mode is None or \
            not ops.cpu_kernels_enabled():
        return dtype
    setattr(hf_config, BF16_WEIGHTS_ATTR, mode)
    return "float32"


def _no_block_kernels(dtype: str, device: torch.device, tp: TPGroup,
                      bf16: bool) -> Optional[str]:
    """Why the CPU block (bf16: the float32 GEMM's bf16) kernels cannot run this model, or
    None."""
    from vllm.kernels import ops
    from vllm.kernels import quant_kernels
    why = ("tensor parallelism" if tp.world_size > 1 else
           f"dtype {dtype}" if dtype != "float32" else
           f"device {device.type}" if device.type != "cpu" else None)
    if why is None and not (ops.cpu_kernels_enabled() if bf16 else quant_kernels.available()):
        why = "no C compiler (or VLLM_CPU_KERNELS=0)"
    return why


def _block_weights(hf_config, dtype: str, device: torch.device, tp: TPGroup,
                   load_format: str, weights: Dict[str, torch.Tensor]) -> Tuple[dict, bool]:
    """The GEMM weights to keep in GGUF blocks or in bf16 (HF name -> QuantWeight; empty:
    float32 everywhere, with one log line where they were asked for but cannot run here), and
    whether the float32 layers are kept too (timed against them: the "auto" settings; a GGUF's
    not where their GEMM weights would take more than half the available memory)."""
    from vllm.model_executor import quant_linear
    bf16 = getattr(hf_config, BF16_WEIGHTS_ATTR, None)
    path = getattr(hf_config, GGUF_QUANT_ATTR, None) if load_format != "dummy" else None
    if not bf16 and not path:
        return {}, False
    flag = f"--dtype {bf16}" if bf16 else "--quantization gguf"
    why = _no_block_kernels(dtype, device, tp, bool(bf16))
    if why is not None:
        logger.info("%s: the CPU kernels do not cover %s; the model runs in float32", flag, why)
        return {}, False
    if bf16:
        quant = quant_linear.bf16_weights(weights)
        logger.info("%s: %d GEMM weights kept in bf16", flag, len(quant))
        return quant, bf16 == "auto"
    quant = quant_linear.load_gguf_linears(path, hf_config)
    kinds = sorted({w.type_name for w in quant.values()})
    logger.info("--quantization gguf: %d GEMM weights kept in %s blocks", len(quant),
                "/".join(kinds) or "no")
    if not getattr(hf_config, GGUF_KEEP_FLOAT32_ATTR, False):
        return quant, False
    float32_bytes = sum(4 * w.shape[0] * w.shape[1] for w in quant.values())
    available = _available_bytes()
    if float32_bytes > available // 2:
        logger.info("--quantization auto: GGUF blocks at every batch size (float32 layers beside "
                    "them would take %.1f GiB, more than half of the %.1f GiB available)",
                    float32_bytes / 2**30, available / 2**30)
        return quant, False
    return quant, True


def _available_bytes() -> int:
    """The kernel's MemAvailable (free memory plus the page cache it can reclaim: the GGUF's
    own pages are cached once it has been read), else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def load_hf_config(model_dir: str):
    """The config the engine runs (a multimodal checkpoint's text config: registry)."""
    return registry.text_config(AutoConfig.from_pretrained(model_dir))


def _safetensors_index(model_dir: str) -> Optional[str]:
    """The folder's ``*.safetensors.index.json``: ``model.safetensors.index.json`` when there,
    else the first (by name) that does not index a consolidated file, else None."""
    found = sorted(glob.glob(os.path.join(model_dir, "*.safetensors.index.json")))
    preferred = os.path.join(model_dir, "model.safetensors.index.json")
    if preferred in found:
        return preferred
    plain = [f for f in found if not os.path.basename(f).startswith("consolidated")]
    return (plain or found or [None])[0]


def safetensors_files(model_dir: str) -> dict[str, Optional[list[str]]]:
    """Which tensors to read from which ``*.safetensors`` file: {path: names, or None for all
    of the file's}; empty when the folder has none. As upstream vLLM:
      - an index names exactly the files to read (each once) and the tensors each holds (its
        weight_map); files it does not name are not read;
      - without one, Mistral's ``consolidated*.safetensors`` (the same weights again, in
        Mistral's own names) are skipped when other ``*.safetensors`` files are there."""
    import json
    index = _safetensors_index(model_dir)
    if index is not None:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files: dict[str, Optional[list[str]]] = {}
        for name, file in weight_map.items():
            files.setdefault(os.path.join(model_dir, file), []).append(name)
        return dict(sorted(files.items()))
    found = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    plain = [f for f in found if not os.path.basename(f).startswith("consolidated")]
    return dict.fromkeys(plain or found)


def _read_safetensors(path: str, names: Optional[list[str]], device: torch.device, load,
                      weights: Dict[str, torch.Tensor]) -> None:
    """Add `names` (None: every tensor) of the file at `path` to `weights`; a tensor that is
    missing, or already read from another file, is an error."""
    from safetensors import safe_open
    if not os.path.isfile(path):
        raise ValueError(f"--model: the safetensors index names {path}, which is missing")
    with safe_open(path, framework="pt", device=str(device)) as fh:
        keys = set(fh.keys())
        for k in (names if names is not None else sorted(keys)):
            if k not in keys:
                raise ValueError(f"--model: the safetensors index puts {k} in {path}, "
                                 "which does not hold it")
            loaded = load(k, fh.get_slice(k))
            if loaded is None:
                continue
            name, t = loaded
            if name in weights:
                raise ValueError(f"--model: tensor {name} is in more than one file ({path})")
            weights[name] = t


def load_state_dict(model_dir: str, device: torch.device = torch.device("cpu"),
                    dtype: Optional[torch.dtype] = None,
                    shards: Optional[TPShards] = None,
                    text_only: bool = False) -> Dict[str, torch.Tensor]:
    """Every tensor (this rank's slice of it, with `shards`) is read onto `device` and cast to
    `dtype`, one at a time, from the files `safetensors_files` picks (else ``*.bin``).
    text_only: a multimodal checkpoint's text model, renamed (registry.text_weight_name); the
    other tensors are never read."""
    def load(name, tensor):
        name = name.removeprefix("_orig_mod.")
        if text_only:
            name = registry.text_weight_name(name)
            if name is None:
                return None
        if mxfp4.is_quantized_part(name):      # uint8 as it is: dequantized whole, then sliced
            return name, (tensor if isinstance(tensor, torch.Tensor) else tensor[:])
        t = shards.take(name, tensor) if shards is not None else tensor
        t = t if isinstance(t, torch.Tensor) else t[:]
        return name, (t if dtype is None else t.to(dtype))
    weights: Dict[str, torch.Tensor] = {}
    files = safetensors_files(model_dir)
    if files:
        for f, names in files.items():
            _read_safetensors(f, names, device, load, weights)
        return _dequantized(weights, dtype, shards)
    files = sorted(glob.glob(os.path.join(model_dir, "*.bin")))
    if not files:
        raise ValueError(f"--model: no *.safetensors or *.bin weights in {model_dir}")
    for f in files:   # mmap: a rank's slices are read, not the whole file
        part = torch.load(f, map_location=device, weights_only=True, mmap=True)
        weights.update(filter(None, (load(k, v) for k, v in part.items())))
    return _dequantized(weights, dtype, shards)


def _dequantized(weights: Dict[str, torch.Tensor], dtype: Optional[torch.dtype],
                 shards: Optional[TPShards]) -> Dict[str, torch.Tensor]:
    """MXFP4 blocks and scales (gpt-oss experts) as the tensors they encode, in `dtype`, this
    rank's slice of each (layers/mxfp4.py)."""
    if not any(mxfp4.is_quantized_part(name) for name in weights):
        return weights
    out = mxfp4.dequantize_checkpoint(weights, dtype or torch.float32)
    if shards is not None:
        for name in set(out) - set(weights):
            out[name] = shards.take(name, out[name])
    return out


def dummy_state_dict(hf_config, seed: int = 0, device: torch.device = torch.device("cpu"),
                     dtype: torch.dtype = torch.float32,
                     shards: Optional[TPShards] = None) -> Dict[str, torch.Tensor]:
    """Seeded random weights with the checkpoint's names and shapes (N(0, initializer_range),
    norms the identity (the family's layer_norms / head_norms / norm_identity), biases 0):
    paper-scale shapes run from a config.json alone. Drawn on `device` by a
    generator there (so a CUDA model differs from a CPU one with the same seed), in float32,
    then cast. With `shards`, every rank draws the same stream and keeps its slice of each
    tensor as it is drawn."""
    c = hf_config
    gen = torch.Generator(device).manual_seed(seed)
    std = getattr(c, "initializer_range", 0.02)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = c.num_key_value_heads * head_dim

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device=device) * std).to(dtype)

    cls = model_class(c)

    def ones(n):
        return torch.full((n,), cls.norm_identity, device=device, dtype=dtype)

    class Sharded(dict):
        def __setitem__(self, name, t):
            super().__setitem__(name, shards.take(name, t) if shards is not None else t)

    w = Sharded()
    w["model.embed_tokens.weight"] = rand(c.vocab_size, c.hidden_size)
    w["model.norm.weight"] = ones(c.hidden_size)
    if not getattr(c, "tie_word_embeddings", False):
        w["lm_head.weight"] = rand(c.vocab_size, c.hidden_size)
    bias = getattr(c, "attention_bias", False) or "Qwen2" in str(getattr(c, "architectures", ""))
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        for name, rows in (("q", c.num_attention_heads * head_dim), ("k", kv), ("v", kv)):
            w[f"{p}.self_attn.{name}_proj.weight"] = rand(rows, c.hidden_size)
            if bias:
                w[f"{p}.self_attn.{name}_proj.bias"] = torch.zeros(rows, device=device,
                                                                   dtype=dtype)
        w[f"{p}.self_attn.o_proj.weight"] = rand(c.hidden_size, c.num_attention_heads * head_dim)
        for name, shape in cls.layer_shapes(c, i).items():
            w[f"{p}.{name}"] = (torch.zeros(*shape, device=device, dtype=dtype)
                                if name.endswith("bias") else rand(*shape))
        for name in cls.layer_norms:
            w[f"{p}.{name}.weight"] = ones(c.hidden_size)
        for name in cls.head_norms:
            w[f"{p}.{name}.weight"] = ones(head_dim)
    return dict(w)


def model_class(hf_config) -> type:
    """The model class of a config's architecture (models/registry.py)."""
    return registry.resolve(getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"])


def get_model(model_dir: str, hf_config, dtype: str, max_model_len: int,
              load_format: str = "auto", seed: int = 0,
              device: torch.device = torch.device("cpu"),
              tp: Optional[TPGroup] = None) -> torch.nn.Module:
    cls = model_class(hf_config)
    mxfp4.check_config(hf_config)
    device, tp = torch.device(device), tp or TPGroup()
    shards = TPShards(hf_config, tp.rank, tp.world_size) if tp.world_size > 1 else None
    if load_format == "dummy":
        weights = dummy_state_dict(hf_config, seed, device, DTYPES[dtype], shards)
    else:
        weights = load_state_dict(model_dir, device, DTYPES[dtype], shards,
                                  getattr(hf_config, registry.TEXT_OF_MULTIMODAL_ATTR, False))
    weights = cls.canonical_weights(weights)
    quant, keep_float32 = _block_weights(hf_config, dtype, device, tp, load_format, weights)
    with torch.no_grad():
        if quant:
            model = cls(hf_config, weights, DTYPES[dtype], max_model_len, device, tp, quant=quant,
                        quant_keep_float32=keep_float32)
        else:
            model = cls(hf_config, weights, DTYPES[dtype], max_model_len, device, tp)
    return model.eval()
