"""The CUDA relocation op (csrc/relocate_kv.cu + csrc/relocate_binding.cpp), built on first use.

Nothing CUDA is built at install: the first `load_relocate_op()` on a machine where
torch.cuda.is_available() compiles the sources with torch.utils.cpp_extension.load (nvcc and
ninja, for this GPU's architecture or TORCH_CUDA_ARCH_LIST) into
<cache root>/cuda_kernels/relocate-<key>/, keyed by the sources, torch, CUDA, the architectures
and the debug flag, and loads it as a plain shared library, which registers
torch.ops.vtoken.relocate_kv. Later processes reuse the build (cpp_extension locks the folder
against concurrent builders). A failed build (no nvcc, a mismatched toolkit) logs one warning
and returns False: relocation then runs the Triton kernel, or torch (vllm/_custom_ops.py).

VLLM_RELOCATE_DEBUG=1 builds with -DVTOKEN_DEBUG: slot indices are range-checked (TORCH_CHECK
on the host, a trap in the kernel).
"""
import functools
import hashlib
import logging
import os
from pathlib import Path
from typing import List, Optional

import torch

from vllm import envs

logger = logging.getLogger(__name__)

# an installed wheel carries the sources as vllm/_csrc/ (setup.py); a checkout has them in csrc/
_HERE = Path(__file__).resolve().parent
_NAMES = ("relocate_binding.cpp", "relocate_kv.cu", "relocate_kv.cuh")


def source_dir() -> Optional[Path]:
    return next((d for d in (_HERE / "_csrc", _HERE.parent / "csrc")
                 if all((d / n).exists() for n in _NAMES)), None)


def debug_build() -> bool:
    return os.environ.get("VLLM_RELOCATE_DEBUG", "0") not in ("", "0")


def _arch_list() -> str:
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"


def build_key(src: Path, arch: str, debug: bool) -> str:
    """Names one build: the sources, torch and CUDA versions, the architectures, the flags."""
    h = hashlib.sha256()
    for name in _NAMES:
        h.update((src / name).read_bytes())
    h.update(f"{torch.__version__}|{torch.version.cuda}|{arch}|{debug}".encode())
    return h.hexdigest()[:16]


def compile_flags(debug: bool) -> List[str]:
    return ["-O3", "-DVTOKEN_DEBUG"] if debug else ["-O3"]


@functools.lru_cache(maxsize=None)
def load_relocate_op() -> bool:
    """Build (once per key) and load the op; True when torch.ops.vtoken.relocate_kv exists."""
    if _registered():
        return True
    src = source_dir()
    if src is None or not torch.cuda.is_available() or not torch.version.cuda:
        return False
    try:
        from torch.utils.cpp_extension import load
        arch, debug = _arch_list(), debug_build()
        key = build_key(src, arch, debug)
        build_dir = envs.cache_root() / "cuda_kernels" / f"relocate-{key}"
        build_dir.mkdir(parents=True, exist_ok=True)
        saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch
        try:
            load(name=f"vtoken_relocate_{key}",
                 sources=[str(src / "relocate_binding.cpp"), str(src / "relocate_kv.cu")],
                 extra_cflags=compile_flags(debug), extra_cuda_cflags=compile_flags(debug),
                 extra_include_paths=[str(src)], build_directory=str(build_dir),
                 is_python_module=False, verbose=False)
        finally:
            if saved is None:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = saved
    except Exception as e:   # noqa: BLE001  (any build or load failure means: fall back)
        last = (str(e).strip().splitlines() or [""])[-1]
        logger.warning("CUDA relocation op unavailable (%s: %s); relocation uses Triton",
                       type(e).__name__, last)
        logger.debug("CUDA relocation op build log:\n%s", e)
        return False
    return _registered()


def _registered() -> bool:
    try:
        return hasattr(torch.ops.vtoken, "relocate_kv")
    except (AttributeError, RuntimeError):
        return False
