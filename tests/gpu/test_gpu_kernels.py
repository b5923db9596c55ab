"""On CUDA: the relocation op (vllm._C), the Triton relocation and decode kernels, and the
dispatch, against torch references. Skipped without CUDA."""
import pytest
import torch

from tests.kernel_refs import decode_reference, moves, paged_scene, rel_err
from vllm import _custom_ops as ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def cache(layers, slots, kvh, d, dtype, layer_pad=0):
    """[L, S, 2, KVH, D] on the GPU; layer_pad > 0 leaves a gap between layers (a strided view)."""
    full = torch.randn(layers, slots + layer_pad, 2, kvh, d, device="cuda").to(dtype)
    return full[:, :slots]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kvh,d,layer_pad", [(8, 128, 0), (2, 3, 0), (2, 64, 5)])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_relocation_matches_torch(dtype, kvh, d, layer_pad, backend):
    if backend == "cuda" and not ops._available("cuda"):
        pytest.skip("vllm._C not built (benchmarks/gpu_check.sh builds it)")
    kv = cache(4, 2048, kvh, d, dtype, layer_pad)
    src, dst = moves(2048, 300, seed=d)
    ref = kv.clone()
    ops.relocate_kv(ref, src.cuda(), dst.cuda(), backend="torch")
    ops.relocate_kv(kv, src.cuda(), dst.cuda(), backend=backend)
    assert torch.equal(kv.contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8))


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
