"""The CUDA relocation kernel's loading (vllm/kernels/cuda_kernels.py), on CPU with the CUDA side faked
where needed. The prebuilt library (csrc/prebuilt/libvtoken_relocate.so): its manifest matches
the sources and its bytes, it exports exactly the C ABI, holds sm_80 and sm_90 code and compute_90
PTX, needs no libcudart, loads and answers with ctypes on a machine without a GPU, rebuilds with
nvcc here (skipped without nvcc), and the loader prefers it, skips a stale one, and falls back to
the JIT build. The JIT build: where it builds, with which flags, that a failed build warns once
and relocation falls back to Triton. Install ships the sources and compiles nothing. The kernels
themselves: tests/gpu/test_gpu_kernels.py (benchmarks/gpu_check.sh)."""
import ctypes
import json
import logging
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm.kernels import ops
from vllm.kernels import cuda_kernels

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_cuda(monkeypatch, tmp_path):
    """torch believes a Hopper GPU and CUDA 13.0 are present; caches cleared around the test."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("VLLM_RELOCATE_LIB", "none")        # the JIT tests; prebuilt ones unset it
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.delenv("VLLM_RELOCATE_DEBUG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    cuda_kernels.load_relocate_op.cache_clear()
    ops._available.cache_clear()
    yield tmp_path
    cuda_kernels.load_relocate_op.cache_clear()
    ops._available.cache_clear()


def fake_load(calls, error=None):
    import os

    def load(**kwargs):
        calls.append({**kwargs, "arch": os.environ.get("TORCH_CUDA_ARCH_LIST")})
        if error is not None:
            raise error
    return load


def test_sources_are_found_and_keyed():
    src = cuda_kernels.source_dir()
    assert src == ROOT / "csrc"
    key = cuda_kernels.build_key(src, "9.0", False)
    assert key == cuda_kernels.build_key(src, "9.0", False)
    assert len({key, cuda_kernels.build_key(src, "8.0", False),
                cuda_kernels.build_key(src, "9.0", True)}) == 3


def test_no_cuda_means_no_build(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a real GPU: tests/gpu covers the build")

    def must_not_load(*a, **k):
        raise AssertionError("nothing is loaded without CUDA")
    monkeypatch.setattr(cuda_kernels, "PrebuiltLibrary", must_not_load)
    cuda_kernels.load_relocate_op.cache_clear()
    ops._available.cache_clear()
    try:
        assert cuda_kernels.load_relocate_op() is False and ops._available("cuda") is False
        assert cuda_kernels.backend() is None
        with pytest.raises(RuntimeError, match="not loaded"):
            cuda_kernels.relocate_kv(torch.zeros(1, 2, 2, 1, 1), torch.tensor([0]),
                                     torch.tensor([1]))
    finally:
        cuda_kernels.load_relocate_op.cache_clear()
        ops._available.cache_clear()


@pytest.mark.parametrize("debug", [False, True])
def test_builds_into_the_cache_folder_for_this_gpu(fake_cuda, monkeypatch, debug):
    import torch.utils.cpp_extension as cpp
    calls = []
    monkeypatch.setattr(cpp, "load", fake_load(calls))
    if debug:
        monkeypatch.setenv("VLLM_RELOCATE_DEBUG", "1")
    assert cuda_kernels.load_relocate_op() is False       # the fake registers no op
    (call,) = calls
    key = cuda_kernels.build_key(ROOT / "csrc", "9.0", debug)
    assert call["build_directory"] == str(fake_cuda / "cuda_kernels" / f"relocate-{key}")
    assert Path(call["build_directory"]).is_dir()
    assert call["is_python_module"] is False and call["arch"] == "9.0"
    assert [Path(s).name for s in call["sources"]] == ["relocate_binding.cpp", "relocate_kv.cu"]
    assert ("-DVTOKEN_DEBUG" in call["extra_cuda_cflags"]) == debug
    assert ("-DVTOKEN_DEBUG" in call["extra_cflags"]) == debug
    import os
    assert "TORCH_CUDA_ARCH_LIST" not in os.environ       # restored after the build


def test_failed_build_warns_once_and_relocation_falls_back_to_triton(fake_cuda, monkeypatch,
                                                                       caplog):
    import torch.utils.cpp_extension as cpp
    calls = []
    monkeypatch.setattr(cpp, "load", fake_load(calls, RuntimeError("nvcc: not found")))
    with caplog.at_level(logging.WARNING, logger="vllm.kernels.cuda_kernels"):
        assert ops._pick(None, True, ("cuda", "triton", "torch")) == "triton"
        assert ops._pick(None, True, ("cuda", "triton", "torch")) == "triton"
        assert cuda_kernels.load_relocate_op() is False
    warnings = [r for r in caplog.records if r.name == "vllm.kernels.cuda_kernels"]
    assert len(calls) == 1 and len(warnings) == 1
    assert "nvcc: not found" in warnings[0].getMessage() and "Triton" in warnings[0].getMessage()


def test_install_compiles_nothing_and_ships_the_sources(tmp_path):
    """setup.py builds no extension (no nvcc at install) and packs every kernel source."""
    out = tmp_path / "lib"
    run = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(out)],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    shipped = sorted(p.name for p in (out / "vllm" / "_csrc").iterdir())
    assert shipped == ["decode_kernels.c", "quant_kernels.c", "relocate_binding.cpp",
                       "relocate_kv.cu", "relocate_kv.cuh"]
    # every package of the source tree is in the build (a folder without __init__.py is not)
    sources = {p.parent.relative_to(ROOT) for p in (ROOT / "vllm").rglob("*.py")}
    missing = [str(d) for d in sources if not (out / d).is_dir()]
    assert not missing, f"not installed: {missing}"
    text = (ROOT / "setup.py").read_text()
    assert "ext_modules" not in text and "CUDAExtension" not in text


# ---- the prebuilt library -----------------------------------------------------------------------
LIB = ROOT / "csrc" / "prebuilt" / cuda_kernels.LIB_NAME
# what the library may need at load time: the C and C++ runtimes, never libcudart
ALLOWED_NEEDED = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
                  "libstdc++.so.6", "libgcc_s.so.1", "ld-linux-x86-64.so.2"}


def elf_section(data: bytes, name: str) -> bytes:
    """One section of a 64-bit little-endian ELF file, by name."""
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "a 64-bit LE ELF"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i):       # name, type, flags, addr, offset, size
        return struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
    strtab = header(shstrndx)[4]
    for i in range(shnum):
        nm, _, _, _, off, size = header(i)
        if data[strtab + nm:data.index(b"\0", strtab + nm)].decode() == name:
            return data[off:off + size]
    raise AssertionError(f"no {name} section")


def fatbin_targets(data: bytes) -> set:
    """{("sm", 80), ("ptx", 90), ...}: the entries of the CUDA fat binaries in .nv_fatbin (what
    `cuobjdump --list-elf/--list-ptx` lists; cuobjdump is not installed everywhere)."""
    sec, pos, found = elf_section(data, ".nv_fatbin"), 0, set()
    while pos + 16 <= len(sec):
        magic, _, header_size, body_size = struct.unpack_from("<IHHQ", sec, pos)
        if magic != 0xBA55ED50:                     # padding between fat binaries
            pos += 8
            continue
        entry, end = pos + header_size, pos + header_size + body_size
        while entry < end:
            kind, _, entry_header, size = struct.unpack_from("<HHIQ", sec, entry)
            arch, = struct.unpack_from("<I", sec, entry + 28)
            found.add(({1: "ptx", 2: "sm"}.get(kind, str(kind)), arch))
            entry += entry_header + size
        pos = end
    return found


def check_library(path: Path) -> None:
    """The checked-in and a fresh build alike: sm_80 + sm_90 code and compute_90 PTX; exports
    exactly the C ABI; needs no libcudart; loads on glibc 2.34 (Ubuntu 22.04, RHEL 9) or newer."""
    targets = fatbin_targets(path.read_bytes())
    assert {("sm", 80), ("sm", 90), ("ptx", 90)} <= targets, targets
    if shutil.which("cuobjdump"):
        elf = subprocess.run(["cuobjdump", "--list-elf", str(path)], capture_output=True,
                             text=True).stdout
        assert "sm_80" in elf and "sm_90" in elf
    if shutil.which("nm"):
        nm = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True,
                            text=True, check=True).stdout.split("\n")
        exported = sorted(line.split()[2] for line in nm if line.split()[1:2] == ["T"])
        assert exported == sorted(cuda_kernels.LIB_EXPORTS), exported
        undefined = subprocess.run(["nm", "-D", "--undefined-only", str(path)],
                                   capture_output=True, text=True, check=True).stdout
        assert "cudaLaunch" not in undefined and "cudaGetLastError" not in undefined
    if shutil.which("readelf"):
        dyn = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True,
                             check=True).stdout
        needed = {line.split("[")[1].rstrip("]") for line in dyn.splitlines() if "NEEDED" in line}
        assert needed <= ALLOWED_NEEDED, needed - ALLOWED_NEEDED
    if shutil.which("objdump"):
        syms = subprocess.run(["objdump", "-T", str(path)], capture_output=True, text=True,
                              check=True).stdout
        versions = {tuple(int(x) for x in v.split("_")[1].split("."))
                    for v in set(re.findall(r"GLIBC_[0-9.]+", syms))}
        assert max(versions) <= (2, 34), max(versions)


def test_prebuilt_library_is_current_and_small():
    """Checked in next to its manifest, built from today's sources (else: make relocate-lib)."""
    assert cuda_kernels.check_prebuilt(LIB) is None, cuda_kernels.check_prebuilt(LIB)
    meta = json.loads(LIB.with_suffix(".json").read_text())
    assert meta["bytes"] == LIB.stat().st_size < 1 << 20
    assert meta["exports"] == list(cuda_kernels.LIB_EXPORTS)
    assert meta["sources"] == list(cuda_kernels.LIB_SOURCES)
    assert "code=sm_80" in meta["gencode"] and "code=sm_90" in meta["gencode"]
    assert "code=compute_90" in meta["gencode"]


def test_prebuilt_library_contents():
    check_library(LIB)


def test_prebuilt_library_is_not_git_ignored():
    """It travels with the working tree to the GPU machine (no carry needed) and is committed."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("no git checkout")
    for path in (LIB, LIB.with_suffix(".json"), ROOT / "csrc" / "build_relocate_lib.sh"):
        run = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT)
        assert run.returncode == 1, f"{path} is git-ignored"


def test_prebuilt_loads_and_answers_without_a_gpu():
    """ctypes loads it on this CPU-only machine (the static CUDA runtime opens the driver only at
    the first launch); its host entry points answer; a launch without a driver is an error code."""
    lib = cuda_kernels.PrebuiltLibrary(LIB)
    assert lib.vector_bytes(1 << 20, 1 << 16, 4096) == 16
    assert lib.vector_bytes((1 << 20) + 8, 1 << 16, 4096) == 8
    assert lib.vector_bytes(1 << 20, 1 << 16, 12) == 4        # a 12-byte row
    assert lib.vector_bytes(1 << 20, 1 << 16, 6) == 2
    assert lib.vector_bytes(1 << 20, 3, 4096) == 1
    assert lib.error_string(209).startswith("cudaErrorNoKernelImageForDevice: ")
    lib.launch(0, 2, 8, 1024, 64, 0, 0, 0, 0)                  # no moves: returns at once
    if torch.cuda.is_available() or Path("/dev/nvidiactl").exists():
        return                                                  # never launch on bogus pointers
    with pytest.raises(RuntimeError, match=r"vtoken_relocate_kv: cudaError\w+"):
        lib.launch(1 << 20, 2, 8, 1024, 64, 1 << 20, 1 << 20, 1, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer_pad", [0, 3])
def test_launch_arguments_describe_the_cache(dtype, layer_pad):
    """The byte layout handed to the C entry point, replayed on the CPU as the kernel reads it
    (for every move and layer: bytes at kv + l * layer_stride + slot * row), equals torch's
    relocation; a strided cache (a gap between layers) included."""
    full = torch.randn(3, 16 + layer_pad, 2, 2, 4).to(dtype)
    kv = full[:, :16]
    src, dst = torch.tensor([1, 7, 3]), torch.tensor([12, 0, 9])
    assert cuda_kernels.check_layout(kv, require_cuda=False) == 16
    ptr, layers, slots, layer_stride, row, sp, dp, n, stream = cuda_kernels.launch_args(
        kv, src, dst, 1234)
    assert (layers, slots, n, stream, sp, dp) == (3, 16, 3, 1234, src.data_ptr(), dst.data_ptr())
    ref = kv.clone()
    ops.relocate_kv(ref, src, dst, backend="torch")
    mem = full.view(-1).view(torch.uint8)                       # the bytes the kernel sees
    base = ptr - full.data_ptr()
    for s, d in zip(src.tolist(), dst.tolist()):
        for layer in range(layers):
            at = base + layer * layer_stride
            mem[at + d * row:at + (d + 1) * row] = mem[at + s * row:at + (s + 1) * row].clone()
    assert torch.equal(kv.view(torch.uint8), ref.view(torch.uint8))


def test_layout_checks():
    with pytest.raises(ValueError, match="5-d CUDA"):
        cuda_kernels.check_layout(torch.zeros(2, 4, 2, 1, 8))               # a CPU tensor
    with pytest.raises(ValueError, match="contiguous"):
        cuda_kernels.check_layout(torch.zeros(2, 4, 2, 8, 2).transpose(3, 4), require_cuda=False)
    with pytest.raises(ValueError, match="contiguous"):
        cuda_kernels.check_layout(torch.zeros(2, 8, 2, 1, 8)[:, ::2], require_cuda=False)


@pytest.fixture
def with_prebuilt(fake_cuda, monkeypatch):
    """fake_cuda with the prebuilt step on; the self-test (it needs a GPU) recorded, not run."""
    monkeypatch.delenv("VLLM_RELOCATE_LIB", raising=False)
    tested = []
    monkeypatch.setattr(cuda_kernels, "self_test", tested.append)
    return tested


def test_loader_prefers_the_prebuilt_library(with_prebuilt, monkeypatch):
    import torch.utils.cpp_extension as cpp
    calls = []
    monkeypatch.setattr(cpp, "load", fake_load(calls))
    assert cuda_kernels.load_relocate_op() is True and cuda_kernels.backend() == "prebuilt"
    assert calls == []                                         # no JIT build attempted
    (impl,) = with_prebuilt
    assert isinstance(impl, cuda_kernels.PrebuiltLibrary) and impl.path == LIB
    assert not impl.debug
    assert ops._pick(None, True, ("cuda", "triton", "torch")) == "cuda"


def test_debug_flag_reaches_the_prebuilt_wrapper(with_prebuilt, monkeypatch):
    monkeypatch.setenv("VLLM_RELOCATE_DEBUG", "1")
    assert cuda_kernels.load_relocate_op() and with_prebuilt[0].debug


def test_failed_self_test_falls_back_to_the_jit_build(fake_cuda, monkeypatch, caplog):
    import torch.utils.cpp_extension as cpp
    monkeypatch.delenv("VLLM_RELOCATE_LIB", raising=False)

    def broken(impl):
        raise RuntimeError("vtoken_relocate_kv: cudaErrorInsufficientDriver")
    monkeypatch.setattr(cuda_kernels, "self_test", broken)
    calls = []
    monkeypatch.setattr(cpp, "load", fake_load(calls, RuntimeError("nvcc: not found")))
    with caplog.at_level(logging.WARNING, logger="vllm.kernels.cuda_kernels"):
        assert ops._pick(None, True, ("cuda", "triton", "torch")) == "triton"
    messages = [r.getMessage() for r in caplog.records if r.name == "vllm.kernels.cuda_kernels"]
    assert len(messages) == 2 and len(calls) == 1
    assert "unusable" in messages[0] and "cudaErrorInsufficientDriver" in messages[0]
    assert "nvcc: not found" in messages[1]


def test_pre_ampere_gpu_skips_the_prebuilt_library(fake_cuda, monkeypatch, caplog):
    import torch.utils.cpp_extension as cpp
    monkeypatch.delenv("VLLM_RELOCATE_LIB", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    monkeypatch.setattr(cuda_kernels, "self_test", lambda impl: None)
    calls = []
    monkeypatch.setattr(cpp, "load", fake_load(calls))
    with caplog.at_level(logging.WARNING, logger="vllm.kernels.cuda_kernels"):
        assert cuda_kernels.load_relocate_op() is False
    assert "sm_75" in caplog.records[0].getMessage()
    assert [c["arch"] for c in calls] == ["7.5"]                 # the JIT build for this GPU


def copy_csrc(dst: Path) -> Path:
    """csrc/'s relocation files and prebuilt/ under dst/csrc; the copied library's path."""
    src = ROOT / "csrc"
    (dst / "csrc" / "prebuilt").mkdir(parents=True)
    for name in cuda_kernels.LIB_SOURCES + ("relocate_binding.cpp",):
        shutil.copy(src / name, dst / "csrc" / name)
    for f in (LIB, LIB.with_suffix(".json")):
        shutil.copy(f, dst / "csrc" / "prebuilt" / f.name)
    return dst / "csrc" / "prebuilt" / LIB.name


def test_a_stale_or_altered_library_is_not_loaded(fake_cuda, monkeypatch, caplog):
    lib = copy_csrc(fake_cuda / "checkout")
    assert cuda_kernels.check_prebuilt(lib) is None
    cu = lib.parent.parent / "relocate_kv.cu"
    cu.write_text(cu.read_text() + "// a change\n")
    assert "stale" in cuda_kernels.check_prebuilt(lib)
    shutil.copy(ROOT / "csrc" / "relocate_kv.cu", cu)
    lib.write_bytes(lib.read_bytes() + b"\0")                   # not the bytes it was built as
    assert "sha256 differs" in cuda_kernels.check_prebuilt(lib)
    lib.with_suffix(".json").unlink()
    assert "manifest" in cuda_kernels.check_prebuilt(lib)
    assert "missing" in cuda_kernels.check_prebuilt(lib.with_name("libnothing.so"))

    import torch.utils.cpp_extension as cpp
    monkeypatch.delenv("VLLM_RELOCATE_LIB", raising=False)
    cu.write_text(cu.read_text() + "// a change\n")
    shutil.copy(LIB, lib)
    shutil.copy(LIB.with_suffix(".json"), lib.with_suffix(".json"))
    monkeypatch.setattr(cuda_kernels, "prebuilt_path", lambda: lib)

    def must_not_load(*a, **k):
        raise AssertionError("a stale library is never loaded")
    monkeypatch.setattr(cuda_kernels, "PrebuiltLibrary", must_not_load)
    calls = []
    monkeypatch.setattr(cpp, "load", fake_load(calls))
    with caplog.at_level(logging.WARNING, logger="vllm.kernels.cuda_kernels"):
        assert cuda_kernels.load_relocate_op() is False
    assert "stale" in caplog.records[0].getMessage() and len(calls) == 1


def test_library_path_from_the_environment(fake_cuda, monkeypatch, tmp_path, caplog):
    """VLLM_RELOCATE_LIB=<path>: that library, no manifest needed; =none: the step is skipped
    without a warning."""
    own = tmp_path / "mine" / "librelocate.so"
    own.parent.mkdir()
    shutil.copy(LIB, own)
    monkeypatch.setenv("VLLM_RELOCATE_LIB", str(own))
    monkeypatch.setattr(cuda_kernels, "self_test", lambda impl: None)
    assert cuda_kernels.prebuilt_path() == own
    assert cuda_kernels.load_relocate_op() and cuda_kernels.backend() == "prebuilt"
    assert cuda_kernels._impl.path == own
    monkeypatch.setenv("VLLM_RELOCATE_LIB", "none")
    assert cuda_kernels.prebuilt_path() is None
    monkeypatch.delenv("VLLM_RELOCATE_LIB")
    assert cuda_kernels.prebuilt_path() == LIB


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_library_builds_with_nvcc(tmp_path):
    """csrc/build_relocate_lib.sh (make relocate-lib) builds it here from today's sources: the
    same properties as the checked-in one, the same sources hash in its manifest."""
    run = subprocess.run(["bash", str(ROOT / "csrc" / "build_relocate_lib.sh"), str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    built = tmp_path / LIB.name
    check_library(built)
    meta = json.loads(built.with_suffix(".json").read_text())
    shipped = json.loads(LIB.with_suffix(".json").read_text())
    assert meta["sources_sha256"] == shipped["sources_sha256"]
    assert cuda_kernels.PrebuiltLibrary(built).vector_bytes(1 << 20, 1 << 16, 4096) == 16
    assert ctypes.CDLL(str(built)).vtoken_relocate_kv                # the symbol resolves
