// Torch binding for the relocation kernel: registers torch.ops.vtoken.relocate_kv (CUDA).
// The kernel itself (relocate_kv.cu) sees raw pointers only. Loaded as a plain shared library
// (torch.ops.load_library; vllm/kernels/cuda_kernels.py builds it on first use), so no Python headers.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "relocate_kv.cuh"

namespace {

// kv_caches [num_layers, num_slots, 2, kv_heads, head_dim]; each slot's row must be contiguous.
void relocate_kv(at::Tensor kv_caches, const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK(kv_caches.is_cuda() && kv_caches.dim() == 5, "kv_caches: a 5-d CUDA tensor");
  const auto dt = kv_caches.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
              "kv_caches: float32, float16 or bfloat16");
  const int64_t row = kv_caches.size(2) * kv_caches.size(3) * kv_caches.size(4);
  TORCH_CHECK(kv_caches.stride(4) == 1 && kv_caches.stride(3) == kv_caches.size(4) &&
                  kv_caches.stride(2) == kv_caches.size(3) * kv_caches.size(4) &&
                  kv_caches.stride(1) == row,
              "kv_caches: every slot's K/V row must be contiguous");
  TORCH_CHECK(src.numel() == dst.numel(), "src and dst: one slot each per move");
  if (src.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(kv_caches.device());
  const auto idx = at::TensorOptions().device(kv_caches.device()).dtype(at::kLong);
  const at::Tensor s = src.to(idx, /*non_blocking=*/true).contiguous();
  const at::Tensor d = dst.to(idx, /*non_blocking=*/true).contiguous();
  const int64_t num_slots = kv_caches.size(1);
#ifdef VTOKEN_DEBUG
  // debug builds: index ranges checked on the host (a device sync) before the launch
  TORCH_CHECK(s.min().item<int64_t>() >= 0 && s.max().item<int64_t>() < num_slots &&
                  d.min().item<int64_t>() >= 0 && d.max().item<int64_t>() < num_slots,
              "relocate_kv: a slot index outside [0, ", num_slots, ")");
#endif
  const int64_t elem = kv_caches.element_size();
  const int err = vtoken_relocate_kv(kv_caches.data_ptr(), kv_caches.size(0), num_slots,
                                     kv_caches.stride(0) * elem, row * elem,
                                     s.data_ptr<int64_t>(), d.data_ptr<int64_t>(), s.numel(),
                                     c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "vtoken_relocate_kv: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

}  // namespace

TORCH_LIBRARY(vtoken, m) {
  m.def("relocate_kv(Tensor(a!) kv_caches, Tensor src, Tensor dst) -> ()");
}

TORCH_LIBRARY_IMPL(vtoken, CUDA, m) { m.impl("relocate_kv", &relocate_kv); }
