"""Environment: where the fork keeps what it builds once and reuses (converted GGUF models,
compiled CPU kernels)."""
import os
from pathlib import Path


def cache_root() -> Path:
    """$VLLM_CACHE_ROOT, or ~/.cache/vllm."""
    return Path(os.environ.get("VLLM_CACHE_ROOT") or "~/.cache/vllm").expanduser()
