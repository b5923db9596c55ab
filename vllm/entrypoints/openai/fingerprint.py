"""system_fingerprint: what every non-streamed completion and chat completion carries, in
upstream's default form (its --fingerprint-mode full): vllm-<version>[-tp<N>]-<hash8>, hash8
the first 8 hex digits of a SHA-256 over the engine's configuration (model, dtype,
quantization, KV cache, scheduler, parallelism, eviction). A server computes it once; any
setting that can change outputs changes it."""
import dataclasses
import hashlib
import json

import vllm

_CONFIGS = ("model_config", "cache_config", "scheduler_config", "parallel_config", "kv_config")


def system_fingerprint(engine) -> str:
    """engine: an LLMEngine."""
    parts = [f"vllm-{vllm.__version__}"]
    tp = engine.parallel_config.tensor_parallel_size
    if tp > 1:
        parts.append(f"tp{tp}")
    parts.append(config_hash(engine)[:8])
    return "-".join(parts)


def config_hash(engine) -> str:
    configs = {name: _fields(getattr(engine, name)) for name in _CONFIGS}
    text = json.dumps(configs, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _fields(config) -> dict:
    """A config's fields; the model's transformers config is named by the model path."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if f.name != "hf_config"}
