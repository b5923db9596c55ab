"""On CUDA: the relocation kernel (the checked-in prebuilt library loaded with ctypes, else the
JIT-built op: vllm/kernels/cuda_kernels.py), the Triton relocation and decode kernels, and the dispatch,
against torch references. Skipped without CUDA."""
import os
import subprocess
import sys

import pytest
import torch

from tests.kernel_refs import decode_reference, moves, paged_scene, rel_err
from vllm.kernels import ops
from vllm.kernels import cuda_kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cache(layers, slots, kvh, d, dtype, layer_pad=0):
    """[L, S, 2, KVH, D] on the GPU; layer_pad > 0 leaves a gap between layers (a strided view)."""
    full = torch.randn(layers, slots + layer_pad, 2, kvh, d, device="cuda").to(dtype)
    return full[:, :slots]


def test_prebuilt_library_loads():
    """The checked-in library loads and passes its self-test on this GPU, with no compiler here
    (else relocation silently runs the JIT build or Triton: see the warnings logged above)."""
    assert cuda_kernels.load_relocate_op(), "no CUDA relocation kernel: see the warnings above"
    assert ops._available("cuda")
    if os.environ.get("VLLM_RELOCATE_LIB", "").lower() in ("0", "none", "off", "false"):
        pytest.skip("VLLM_RELOCATE_LIB turns the prebuilt library off")
    if torch.cuda.get_device_capability() < (8, 0):
        assert cuda_kernels.backend() == "jit"                  # no sm_7x code in the library
    else:
        assert cuda_kernels.backend() == "prebuilt"


def test_jit_build_where_a_compiler_exists():
    """The fallback: with the prebuilt library off, the torch extension builds and registers the
    op (its own process: the op namespace registers once per process)."""
    from torch.utils import cpp_extension
    if cpp_extension.CUDA_HOME is None or not cpp_extension.is_ninja_available():
        pytest.skip("no nvcc or no ninja here (the prebuilt library is what runs)")
    code = ("import torch; from vllm.kernels import cuda_kernels; assert cuda_kernels.load_relocate_op()\n"
            "assert cuda_kernels.backend() == 'jit'\n"
            "kv = torch.randn(9, 64, 2, 2, 8, device='cuda'); ref = kv.clone()\n"
            "s, d = torch.tensor([1, 5]), torch.tensor([7, 60]); ref[:, d] = ref[:, s]\n"
            "cuda_kernels.relocate_kv(kv, s, d); print('equal:', torch.equal(kv, ref))\n")
    env = {**os.environ, "VLLM_RELOCATE_LIB": "none", "PYTHONPATH": ROOT}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "equal: True" in run.stdout


def test_cuda_kernel_on_a_side_stream():
    """Launched on the current stream (as RelocationExecutor's copy stream): ordered after the
    writes queued there, nothing waited on by the default stream."""
    if not ops._available("cuda"):
        pytest.skip("no CUDA relocation kernel")
    side = torch.cuda.Stream()
    kv = torch.zeros(9, 4096, 2, 8, 128, device="cuda", dtype=torch.bfloat16)
    src, dst = moves(4096, 1000, seed=11)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(10_000_000)                        # the side stream is busy a while
        kv.normal_()                                         # queued behind the sleep
        expect = kv.clone()
        expect[:, dst.cuda()] = expect[:, src.cuda()]
        ops.relocate_kv(kv, src.cuda(), dst.cuda(), backend="cuda")
    side.synchronize()
    assert torch.equal(kv.view(torch.uint8), expect.view(torch.uint8))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_kernel_on_another_device():
    kv = torch.randn(9, 256, 2, 2, 64, device="cuda:1")
    src, dst = moves(256, 40, seed=12)
    ref = kv.clone()
    ops.relocate_kv(ref, src, dst, backend="torch")
    with torch.cuda.device(0):
        ops.relocate_kv(kv, src, dst, backend="cuda")
    assert torch.equal(kv, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layers,kvh,d,layer_pad", [(4, 8, 128, 0), (32, 8, 128, 0),
                                                    (13, 2, 64, 5), (3, 2, 3, 0)])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_relocation_matches_torch(dtype, layers, kvh, d, layer_pad, backend):
    """Layer counts below, at and off the kernel's 8-layer chunk; 16-byte, 8-byte and 2-byte
    access widths (d 3 rows are 12 or 24 bytes); a strided cache (a gap between layers)."""
    if backend == "cuda" and not ops._available("cuda"):
        pytest.skip("the CUDA op did not build (test_cuda_op_builds_on_first_use fails)")
    kv = cache(layers, 2048, kvh, d, dtype, layer_pad)
    src, dst = moves(2048, 300, seed=d + layers)
    ref = kv.clone()
    ops.relocate_kv(ref, src.cuda(), dst.cuda(), backend="torch")
    ops.relocate_kv(kv, src.cuda(), dst.cuda(), backend=backend)
    assert torch.equal(kv.contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8))


def test_cuda_op_many_moves_and_host_indices():
    if not ops._available("cuda"):
        pytest.skip("the CUDA op did not build")
    kv = cache(2, 65536, 8, 128, torch.bfloat16)
    src, dst = moves(65536, 20000, seed=7)
    ref = kv.clone()
    ops.relocate_kv(ref, src, dst, backend="torch")
    ops.relocate_kv(kv, src, dst, backend="cuda")       # host indices: the binding uploads them
    assert torch.equal(kv.view(torch.uint8), ref.view(torch.uint8))


def test_debug_build_checks_index_ranges(tmp_path):
    """VLLM_RELOCATE_DEBUG=1: an out-of-range slot is a RuntimeError, not a silent write (the
    prebuilt library's wrapper checks on the host; a JIT build compiles with -DVTOKEN_DEBUG). Its
    own process: the kernel loads once per process."""
    code = ("import torch; from vllm.kernels import cuda_kernels; assert cuda_kernels.load_relocate_op()\n"
            "kv = torch.zeros(2, 64, 2, 2, 8, device='cuda')\n"
            "try:\n"
            "    cuda_kernels.relocate_kv(kv, torch.tensor([1, 64]), torch.tensor([2, 3]))\n"
            "except RuntimeError as e:\n"
            "    print('checked:', 'outside' in str(e))\n")
    env = {**os.environ, "VLLM_RELOCATE_DEBUG": "1", "PYTHONPATH": ROOT}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "checked: True" in run.stdout


def test_dispatch_prefers_the_cuda_op():
    expected = "cuda" if ops._available("cuda") else "triton"
    assert ops._pick(None, True, ("cuda", "triton", "torch")) == expected


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-2),
                                       (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("h,kvh,d", [(32, 8, 128), (4, 2, 16), (8, 1, 64)])
def test_triton_decode_on_gpu(dtype, tol, h, kvh, d):
    lens = [1, 300, 77, 1000, 16]
    kv, slots, lens_t = paged_scene(lens, kvh, d, seed=h, num_blocks=800, dtype=dtype)
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref_out, ref_mass = decode_reference(q, kv, slots, lens_t, d ** -0.5)
    mass = torch.zeros(slots.shape, device="cuda")
    out = ops.decode_attention(q.cuda(), kv.cuda(), slots.cuda(), lens_t.cuda(), d ** -0.5,
                               mass, backend="triton")
    assert rel_err(out.cpu(), ref_out) < tol
    assert rel_err(mass.cpu(), ref_mass) < max(tol, 1e-5)
