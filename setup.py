"""pip install --no-build-isolation -e .   (builds the CUDA relocation op only with a CUDA torch)"""
import os
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


def ext_modules():
    try:
        import torch
    except ImportError:
        return [], {}
    if not torch.version.cuda or os.environ.get("VLLM_SKIP_CUDA_BUILD"):
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    ext = CUDAExtension("vllm._C", ["csrc/relocate_binding.cpp", "csrc/relocate_kv.cu"],
                        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]})
    return [ext], {"build_ext": BuildExtension}


class BuildPyWithCpuKernels(build_py):
    """Ship csrc/cpu/*.c inside the package as vllm/_csrc/: vllm/cpu_kernels.py compiles them on
    first use for the CPU it runs on (an editable install reads them from csrc/ directly)."""

    def run(self):
        super().run()
        dst = Path(self.build_lib) / "vllm" / "_csrc"
        dst.mkdir(parents=True, exist_ok=True)
        for src in Path(__file__).parent.joinpath("csrc", "cpu").glob("*.c"):
            shutil.copy(src, dst)


exts, cmdclass = ext_modules()
cmdclass = {**cmdclass, "build_py": BuildPyWithCpuKernels}
setup(
    name="vllm",
    version="0.1.0",
    description="vLLM fork with vToken: token-level virtualization of the paged KV cache",
    packages=find_packages(include=["vllm", "vllm.*"]),
    python_requires=">=3.10",
    install_requires=["torch==2.13.0", "transformers>=4.45", "safetensors", "gguf", "numpy",
                      "tqdm", "fastapi", "uvicorn", "prometheus_client", "accelerate"],
    entry_points={"console_scripts": ["vllm=vllm.entrypoints.cli:main"]},
    ext_modules=exts,
    cmdclass=cmdclass,
)
