"""benchmarks/gpu_check.sh is ready to run in one call on the GPU machine: its shell parses, and
every Python entry point it runs imports on a machine without fastapi/uvicorn/xformers (that
image has none) and without CUDA. The flow itself: GPU_CHECK_CPU_DRY_RUN=1 (about a minute)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY_POINTS = ["benchmarks/benchmark_gpu_decode.py", "benchmarks/benchmark_relocation.py"]
TEST_MODULES = ["tests.gpu.test_gpu_kernels", "tests.gpu.test_gpu_executor",
                "tests.gpu.test_gpu_graphs", "tests.gpu.test_gpu_engine", "tests.test_kernels"]


def test_script_parses_and_names_existing_files():
    run = subprocess.run(["bash", "-n", "benchmarks/gpu_check.sh"], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    script = open(os.path.join(ROOT, "benchmarks", "gpu_check.sh")).read()
    for path in ENTRY_POINTS + ["tests/gpu/test_gpu_kernels.py", "tests/gpu/test_gpu_graphs.py",
                                "tests/gpu/test_gpu_executor.py", "tests/test_kernels.py"]:
        assert path in script and os.path.exists(os.path.join(ROOT, path)), path
    assert "pip install" not in script and "setup.py" not in script     # nothing installed


def test_entry_points_import_without_server_packages():
    code = (
        "import runpy, sys, importlib\n"
        "for name in ('fastapi', 'uvicorn', 'xformers'):\n"
        "    sys.modules[name] = None          # as on the GPU image: importing them fails\n"
        f"for path in {ENTRY_POINTS!r}:\n"
        "    runpy.run_path(path, run_name='not_main')\n"
        f"for mod in {TEST_MODULES!r}:\n"
        "    importlib.import_module(mod)\n"
        "import vllm.cuda_kernels, vllm.worker.cuda_graph_runner\n"
        "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
