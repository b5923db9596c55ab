"""The CUDA relocation op's build on first use (vllm/cuda_kernels.py), on CPU with the CUDA side
faked: where it builds, with which flags, that a failed build warns once and relocation falls
back to Triton, and that install ships the sources and compiles nothing. The real build and
the kernel: tests/gpu/test_gpu_kernels.py (benchmarks/gpu_check.sh)."""
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm import _custom_ops as ops
from vllm import cuda_kernels

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_cuda(monkeypatch, tmp_path):
    """torch believes a Hopper GPU and CUDA 13.0 are present; caches cleared around the test."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
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


def test_no_cuda_means_no_build():
    if torch.cuda.is_available():
        pytest.skip("a real GPU: tests/gpu covers the build")
    assert cuda_kernels.load_relocate_op() is False and ops._available("cuda") is False


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
    with caplog.at_level(logging.WARNING, logger="vllm.cuda_kernels"):
        assert ops._pick(None, True, ("cuda", "triton", "torch")) == "triton"
        assert ops._pick(None, True, ("cuda", "triton", "torch")) == "triton"
        assert cuda_kernels.load_relocate_op() is False
    warnings = [r for r in caplog.records if r.name == "vllm.cuda_kernels"]
    assert len(calls) == 1 and len(warnings) == 1
    assert "nvcc: not found" in warnings[0].getMessage() and "Triton" in warnings[0].getMessage()


def test_install_compiles_nothing_and_ships_the_sources(tmp_path):
    """setup.py builds no extension (no nvcc at install) and packs every kernel source."""
    out = tmp_path / "lib"
    run = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(out)],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    shipped = sorted(p.name for p in (out / "vllm" / "_csrc").iterdir())
    assert shipped == ["decode_kernels.c", "relocate_binding.cpp", "relocate_kv.cu",
                       "relocate_kv.cuh"]
    text = (ROOT / "setup.py").read_text()
    assert "ext_modules" not in text and "CUDAExtension" not in text
