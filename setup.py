"""pip install --no-build-isolation -e .   (pure Python: nothing is compiled at install)

Kernels are compiled on first use, for the machine that runs them, into the cache folder
($VLLM_CACHE_ROOT, default ~/.cache/vllm): the CPU decode kernels by vllm/kernels/cpu_kernels.py (a C
compiler), the CUDA relocation op by vllm/kernels/cuda_kernels.py (nvcc, only where torch sees a GPU).
A machine without a compiler still installs and runs (torch / Triton paths).
"""
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

# the kernel sources the package compiles at first use
KERNEL_SOURCES = ["csrc/cpu/decode_kernels.c", "csrc/cpu/quant_kernels.c", "csrc/relocate_kv.cu",
                  "csrc/relocate_kv.cuh", "csrc/relocate_binding.cpp"]


class BuildPyWithKernelSources(build_py):
    """Ship the kernel sources inside the package as vllm/_csrc/ (an editable install reads
    them from csrc/ directly)."""

    def run(self):
        super().run()
        dst = Path(self.build_lib) / "vllm" / "_csrc"
        dst.mkdir(parents=True, exist_ok=True)
        for src in KERNEL_SOURCES:
            shutil.copy(Path(__file__).parent / src, dst)


setup(
    name="vllm",
    version="0.1.0",
    description="vLLM fork with vToken: token-level virtualization of the paged KV cache",
    packages=find_packages(include=["vllm", "vllm.*"]),
    python_requires=">=3.10",
    install_requires=["torch==2.13.0", "transformers>=4.45", "safetensors", "gguf", "numpy",
                      "tqdm", "fastapi", "uvicorn", "prometheus_client", "accelerate"],
    # --distributed-executor-backend ray; requirements-ray.txt pins the version tested
    extras_require={"ray": ["ray>=2.60,<3"]},
    entry_points={"console_scripts": ["vllm=vllm.entrypoints.cli:main"]},
    cmdclass={"build_py": BuildPyWithKernelSources},
)
