"""The CUDA relocation kernel (csrc/relocate_kv.cu), loaded the first way that works here:

  1. prebuilt  csrc/prebuilt/libvtoken_relocate.so: a plain CUDA shared library (the C ABI of
               relocate_kv.cuh over raw pointers; the CUDA runtime linked in statically, so it
               needs only the driver), built with nvcc by csrc/build_relocate_lib.sh (`make
               relocate-lib`) for sm_80 and sm_90, with compute_90 PTX for newer GPUs, and checked
               in. Loaded with ctypes: no compiler, no ninja, no torch headers needed. Used only
               when its manifest (libvtoken_relocate.json) names both its bytes and the current
               sources, the GPU is sm_80 or newer, and a tiny copy on this GPU comes out exact.
  2. jit       torch.utils.cpp_extension.load of relocate_binding.cpp + relocate_kv.cu (nvcc and
               ninja, for this GPU's architecture or TORCH_CUDA_ARCH_LIST) into
               <cache root>/cuda_kernels/relocate-<key>/, keyed by the sources, torch, CUDA, the
               architectures and the debug flag; it registers torch.ops.vtoken.relocate_kv. Later
               processes reuse the build (cpp_extension locks the folder against concurrent
               builders).
  3. neither   load_relocate_op() returns False after one warning per failed way: relocation runs
               the Triton kernel, or torch (vllm/kernels/ops.py).

Nothing is tried without CUDA. `relocate_kv()` runs whichever loaded; `backend()` names it.

VLLM_RELOCATE_LIB: the path of a library to load instead of the checked-in one (its manifest is not
checked), or 0 / none to skip step 1. VLLM_RELOCATE_DEBUG=1: slot indices are range-checked on the
host before every launch (a device sync; a RuntimeError naming the range), and the JIT build
compiles with -DVTOKEN_DEBUG (the same host check, and a trap in the kernel).
"""
import ctypes
import functools
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Callable, List, Optional

import torch

from vllm import envs

logger = logging.getLogger(__name__)

# an installed wheel carries the sources as vllm/_csrc/ (setup.py); a checkout has them in csrc/
_HERE = Path(__file__).resolve().parent
_NAMES = ("relocate_binding.cpp", "relocate_kv.cu", "relocate_kv.cuh")
LIB_NAME = "libvtoken_relocate.so"
# what the prebuilt library is built from, hashed as one concatenation (build_relocate_lib.sh)
LIB_SOURCES = ("relocate_kv.cuh", "relocate_kv.cu", "build_relocate_lib.sh")
LIB_EXPORTS = ("vtoken_relocate_error_string", "vtoken_relocate_kv",
               "vtoken_relocate_vector_bytes")

_impl: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]] = None
_backend: Optional[str] = None


def source_dir() -> Optional[Path]:
    return next((d for d in (_HERE.parent / "_csrc", _HERE.parent.parent / "csrc")
                 if all((d / n).exists() for n in _NAMES)), None)


def debug_build() -> bool:
    return envs.VLLM_RELOCATE_DEBUG


# ---- 1. the prebuilt library --------------------------------------------------------------------
def prebuilt_path() -> Optional[Path]:
    """The library step 1 loads: $VLLM_RELOCATE_LIB, else the checked-in one; None: skipped."""
    env = envs.VLLM_RELOCATE_LIB or ""
    if env.strip().lower() in ("0", "none", "off", "false"):
        return None
    if env:
        return Path(env)
    src = next((d for d in (_HERE.parent / "_csrc", _HERE.parent.parent / "csrc")
                if (d / "prebuilt" / LIB_NAME).exists()), None)
    return None if src is None else src / "prebuilt" / LIB_NAME


def lib_sources_sha256(src: Path) -> Optional[str]:
    try:
        return hashlib.sha256(b"".join((src / n).read_bytes() for n in LIB_SOURCES)).hexdigest()
    except OSError:
        return None


def check_prebuilt(lib: Path) -> Optional[str]:
    """Why `lib` (a checked-in build, next to its manifest) must not be loaded; None: it may.
    Catches a library left behind by a source change (rebuild: make relocate-lib) and one that is
    not the bytes it was built as (a Git LFS pointer, a truncated copy)."""
    if not lib.is_file():
        return f"{lib} is missing"
    manifest = lib.with_suffix(".json")
    try:
        meta = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        return f"its manifest {manifest} is unreadable ({type(e).__name__})"
    if hashlib.sha256(lib.read_bytes()).hexdigest() != meta.get("sha256"):
        return f"{lib.name} is not the library its manifest names (sha256 differs)"
    if lib_sources_sha256(lib.parent.parent) != meta.get("sources_sha256"):
        return (f"{lib.name} is stale: {', '.join(LIB_SOURCES)} changed since it was built "
                f"(rebuild: make relocate-lib)")
    return None


class PrebuiltLibrary:
    """ctypes over libvtoken_relocate.so; loading it needs no GPU (the CUDA runtime inside opens
    the driver at the first launch)."""

    def __init__(self, path: Path, debug: bool = False):
        self.path, self.debug = path, debug
        lib = ctypes.CDLL(str(path))          # RTLD_LOCAL: nothing of it is seen by others
        self._relocate = lib.vtoken_relocate_kv
        self._relocate.restype = ctypes.c_int
        self._relocate.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                   ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        self._width = lib.vtoken_relocate_vector_bytes
        self._width.restype = ctypes.c_int
        self._width.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        self._error = lib.vtoken_relocate_error_string
        self._error.restype = ctypes.c_char_p
        self._error.argtypes = [ctypes.c_int]

    def error_string(self, error: int) -> str:
        return self._error(error).decode(errors="replace")

    def vector_bytes(self, ptr: int, layer_stride_bytes: int, row_bytes: int) -> int:
        return self._width(ptr, layer_stride_bytes, row_bytes)

    def launch(self, kv_ptr: int, num_layers: int, num_slots: int, layer_stride_bytes: int,
               row_bytes: int, src_ptr: int, dst_ptr: int, num_moves: int, stream: int) -> None:
        """The C entry point as is (device pointers, byte strides, a cudaStream_t handle)."""
        err = self._relocate(kv_ptr, num_layers, num_slots, layer_stride_bytes, row_bytes,
                             src_ptr, dst_ptr, num_moves, stream)
        if err != 0:
            raise RuntimeError(f"vtoken_relocate_kv: {self.error_string(err)} (error {err})")

    def __call__(self, kv_caches: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """As torch.ops.vtoken.relocate_kv: kv_caches [L, S, 2, KVH, D] on a GPU, every slot's
        row contiguous (layers may be strided); src/dst slot indices, on the host or the GPU;
        launched on the current stream, asynchronously."""
        check_layout(kv_caches)
        if src.numel() != dst.numel():
            raise ValueError("relocate_kv: src and dst need one slot each per move")
        if src.numel() == 0:
            return
        device = kv_caches.device
        with torch.cuda.device(device):
            s = src.to(device=device, dtype=torch.int64, non_blocking=True).contiguous()
            d = dst.to(device=device, dtype=torch.int64, non_blocking=True).contiguous()
            slots = kv_caches.size(1)
            if self.debug and not (int(s.min()) >= 0 and int(s.max()) < slots
                                   and int(d.min()) >= 0 and int(d.max()) < slots):
                raise RuntimeError(f"relocate_kv: a slot index outside [0, {slots})")
            self.launch(*launch_args(kv_caches, s, d,
                                     torch.cuda.current_stream(device).cuda_stream))


def launch_args(kv_caches: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                stream: int) -> tuple:
    """vtoken_relocate_kv's arguments for a checked cache and int64 index tensors: the cache's
    base pointer, layers, slots, layer stride and row size in bytes, the index pointers, the
    number of moves and the stream."""
    elem = kv_caches.element_size()
    row = kv_caches.stride(1)                     # == 2 * KVH * D: rows are contiguous
    return (kv_caches.data_ptr(), kv_caches.size(0), kv_caches.size(1),
            kv_caches.stride(0) * elem, row * elem, src.data_ptr(), dst.data_ptr(), src.numel(),
            stream)


def check_layout(kv_caches: torch.Tensor, require_cuda: bool = True) -> int:
    """Elements per slot row; raises unless kv_caches is a 5-d GPU tensor with contiguous rows."""
    if not ((kv_caches.is_cuda or not require_cuda) and kv_caches.dim() == 5):
        raise ValueError("relocate_kv: kv_caches must be a 5-d CUDA tensor [L, S, 2, KVH, D]")
    _, _, two, kvh, d = kv_caches.shape
    row = two * kvh * d
    if not (kv_caches.stride(4) == 1 and kv_caches.stride(3) == d
            and kv_caches.stride(2) == kvh * d and kv_caches.stride(1) == row):
        raise ValueError("relocate_kv: every slot's K/V row must be contiguous")
    return row


def self_test(impl: Callable) -> None:
    """One small relocation on the current GPU against torch: 9 layers (a full 8-layer chunk of
    the kernel and a partial one), 32-byte rows, host indices. Raises on any difference."""
    kv = torch.arange(9 * 6 * 8, dtype=torch.float32, device="cuda").view(9, 6, 2, 1, 4)
    src, dst = torch.tensor([0, 2, 4]), torch.tensor([5, 3, 1])
    ref = kv.clone()
    ref[:, dst] = ref[:, src]
    impl(kv, src, dst)
    torch.cuda.synchronize()
    if not torch.equal(kv, ref):
        raise RuntimeError("the self-test's copy differs from torch's")


def _load_prebuilt() -> bool:
    global _impl, _backend
    path = prebuilt_path()
    if path is None:
        logger.debug("prebuilt relocation library skipped (VLLM_RELOCATE_LIB)")
        return False
    if not envs.VLLM_RELOCATE_LIB:          # the checked-in one: hashes first
        why = check_prebuilt(path)
        if why is not None:
            logger.warning("prebuilt CUDA relocation library not used: %s", why)
            return False
    try:
        major, minor = torch.cuda.get_device_capability()
        if major < 8:
            raise RuntimeError(f"sm_{major}{minor} GPU: the library has sm_80+ code only")
        lib = PrebuiltLibrary(path, debug=debug_build())
        self_test(lib)
    except Exception as e:   # noqa: BLE001  (a load or launch failure means: the next way)
        logger.warning("prebuilt CUDA relocation library %s unusable (%s: %s); trying the JIT "
                       "build", path, type(e).__name__, str(e).strip())
        return False
    _impl, _backend = lib, "prebuilt"
    logger.info("CUDA relocation: prebuilt library %s", path)
    return True


# ---- 2. the torch extension, built on first use -------------------------------------------------
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


def _load_jit() -> bool:
    global _impl, _backend
    src = source_dir()
    if src is None:
        return False
    if not _registered():
        try:
            from torch.utils.cpp_extension import load
            arch, debug = _arch_list(), debug_build()
            key = build_key(src, arch, debug)
            build_dir = envs.VLLM_CACHE_ROOT / "cuda_kernels" / f"relocate-{key}"
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
        if not _registered():
            return False
    _impl, _backend = (lambda kv, s, d: torch.ops.vtoken.relocate_kv(kv, s, d)), "jit"
    return True


def _registered() -> bool:
    try:
        return hasattr(torch.ops.vtoken, "relocate_kv")
    except (AttributeError, RuntimeError):
        return False


# ---- the entry points ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def load_relocate_op() -> bool:
    """Load the kernel once per process (prebuilt, else JIT); True when relocate_kv() runs it."""
    global _impl, _backend
    _impl, _backend = None, None
    if not torch.cuda.is_available() or not torch.version.cuda:
        return False
    return _load_prebuilt() or _load_jit()


def backend() -> Optional[str]:
    """"prebuilt" or "jit" once load_relocate_op() succeeded; None otherwise."""
    return _backend if load_relocate_op() else None


def relocate_kv(kv_caches: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """kv_caches[:, dst[i]] = kv_caches[:, src[i]] in every layer, by the loaded kernel."""
    if not load_relocate_op():
        raise RuntimeError("the CUDA relocation kernel is not loaded (no CUDA, or neither the "
                           "prebuilt library nor the JIT build works here)")
    _impl(kv_caches, src, dst)
