// CUDA relocation kernel behind the C ABI of relocate_kv.cuh (no torch headers here).
#include <cuda_runtime.h>
#include <stdint.h>

#include "relocate_kv.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 16;   // grid-stride beyond this

// One thread per (layer, move, vector): consecutive threads read consecutive vectors of the
// same row, so every row is one coalesced read and one coalesced write.
//   i = ((layer * num_moves) + move) * row_vecs + v
template <typename Vec>
__global__ void relocate_kernel(char* __restrict__ kv, const int64_t* __restrict__ src,
                                const int64_t* __restrict__ dst, int64_t num_moves,
                                int64_t total, int64_t layer_stride_bytes, int64_t row_bytes,
                                int64_t row_vecs) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t v = i % row_vecs;
    const int64_t pair = i / row_vecs;
    const int64_t move = pair % num_moves;
    const int64_t layer = pair / num_moves;
    char* base = kv + layer * layer_stride_bytes;
    const Vec* from = reinterpret_cast<const Vec*>(base + src[move] * row_bytes) + v;
    Vec* to = reinterpret_cast<Vec*>(base + dst[move] * row_bytes) + v;
    *to = *from;
  }
}

template <typename Vec>
cudaError_t launch(char* kv, int64_t num_layers, int64_t layer_stride_bytes, int64_t row_bytes,
                   const int64_t* src, const int64_t* dst, int64_t num_moves,
                   cudaStream_t stream) {
  const int64_t row_vecs = row_bytes / (int64_t)sizeof(Vec);
  const int64_t total = num_layers * num_moves * row_vecs;
  int64_t blocks = (total + kThreads - 1) / kThreads;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  relocate_kernel<Vec><<<(unsigned)blocks, kThreads, 0, stream>>>(
      kv, src, dst, num_moves, total, layer_stride_bytes, row_bytes, row_vecs);
  return cudaGetLastError();
}

}  // namespace

extern "C" int vtoken_relocate_vector_bytes(const void* kv, int64_t layer_stride_bytes,
                                            int64_t row_bytes) {
  const uint64_t bits = (uint64_t)(uintptr_t)kv | (uint64_t)layer_stride_bytes |
                        (uint64_t)row_bytes;
  for (int width = 16; width > 1; width /= 2) {
    if (bits % width == 0) return width;
  }
  return 1;
}

using Launcher = cudaError_t (*)(char*, int64_t, int64_t, int64_t, const int64_t*,
                                 const int64_t*, int64_t, cudaStream_t);

static Launcher pick_launcher(int vector_bytes) {
  switch (vector_bytes) {
    case 16: return launch<uint4>;
    case 8: return launch<uint2>;
    case 4: return launch<uint32_t>;
    case 2: return launch<uint16_t>;
    default: return launch<uint8_t>;
  }
}

extern "C" int vtoken_relocate_kv(void* kv, int64_t num_layers, int64_t layer_stride_bytes,
                                  int64_t row_bytes, const int64_t* src, const int64_t* dst,
                                  int64_t num_moves, void* stream) {
  if (num_moves <= 0 || num_layers <= 0 || row_bytes <= 0) return cudaSuccess;
  Launcher run = pick_launcher(vtoken_relocate_vector_bytes(kv, layer_stride_bytes, row_bytes));
  return run(static_cast<char*>(kv), num_layers, layer_stride_bytes, row_bytes, src, dst,
             num_moves, static_cast<cudaStream_t>(stream));
}
