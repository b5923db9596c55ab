// CUDA relocation kernel behind the C ABI of relocate_kv.cuh (no torch headers here).
#include <cuda_runtime.h>
#include <stdint.h>

#include <cstdio>

#include "relocate_kv.cuh"

namespace {

constexpr int kThreads = 256;      // per block
constexpr int kLayerChunk = 8;     // layers per block: each thread has this many loads in flight
constexpr int64_t kMaxGridX = 0x7fffffff;
constexpr int64_t kMaxGridY = 65535;

// One thread's share of a row in one layer chunk: the vectors v = first, first + step, ...
// kFull: all kLayerChunk layers exist, so no per-layer predicate (every chunk but the last).
template <typename Vec, bool kFull>
__device__ __forceinline__ void copy_chunk(const char* from, char* to, int layers,
                                           int64_t layer_stride, int first, int step,
                                           int row_vecs) {
  for (int v = first; v < row_vecs; v += step) {
    Vec buf[kLayerChunk];
#pragma unroll
    for (int j = 0; j < kLayerChunk; ++j) {       // all loads first: kLayerChunk in flight
      if (kFull || j < layers) buf[j] = reinterpret_cast<const Vec*>(from + j * layer_stride)[v];
    }
#pragma unroll
    for (int j = 0; j < kLayerChunk; ++j) {
      if (kFull || j < layers) reinterpret_cast<Vec*>(to + j * layer_stride)[v] = buf[j];
    }
  }
}

// Grid (move groups, layer chunks); block (tx, ty): ty moves, tx threads over one row's vectors.
//
//   blockIdx.y = c    layers l0 = c * kLayerChunk .. l0 + kLayerChunk - 1 (fewer in the last)
//   move m = blockIdx.x * ty + threadIdx.y
//   thread x copies vectors v = x, x + tx, ... of row src[m] -> dst[m], in all its layers:
//     it loads the vector of every layer of the chunk first (kLayerChunk independent loads in
//     flight), then stores them.
//
// Consecutive threads read consecutive 16-byte vectors of one row, so each row is one coalesced
// read and one coalesced write. Every address is a base pointer computed once per block (64-bit
// multiplies, no division) plus a vector index: no 64-bit division or modulo per element.
template <typename Vec>
__global__ void __launch_bounds__(kThreads, 3) relocate_kernel(
    char* kv, const int64_t* __restrict__ src, const int64_t* __restrict__ dst,
    int64_t num_moves, int num_layers, int64_t num_slots, int64_t layer_stride,
    int64_t row_bytes, int row_vecs) {
  const int64_t move = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
  if (move >= num_moves) return;
  const int layer0 = blockIdx.y * kLayerChunk;
  const int layers = min(kLayerChunk, num_layers - layer0);
  const int64_t s = src[move];
  const int64_t d = dst[move];
#ifdef VTOKEN_DEBUG
  if (s < 0 || s >= num_slots || d < 0 || d >= num_slots) {
    printf("vtoken_relocate_kv: move %lld copies slot %lld -> %lld, outside [0, %lld)\n",
           (long long)move, (long long)s, (long long)d, (long long)num_slots);
    __trap();
  }
#else
  (void)num_slots;
#endif
  const char* from = kv + layer0 * layer_stride + s * row_bytes;
  char* to = kv + layer0 * layer_stride + d * row_bytes;
  if (layers == kLayerChunk) {
    copy_chunk<Vec, true>(from, to, layers, layer_stride, threadIdx.x, blockDim.x, row_vecs);
  } else {
    copy_chunk<Vec, false>(from, to, layers, layer_stride, threadIdx.x, blockDim.x, row_vecs);
  }
}

template <typename Vec>
cudaError_t launch(char* kv, int64_t num_layers, int64_t num_slots, int64_t layer_stride,
                   int64_t row_bytes, const int64_t* src, const int64_t* dst, int64_t num_moves,
                   cudaStream_t stream) {
  const int row_vecs = (int)(row_bytes / (int64_t)sizeof(Vec));
  int tx = 1;                                    // threads per row: a power of two <= kThreads
  while (tx < row_vecs && tx < kThreads) tx *= 2;
  const int ty = kThreads / tx;                  // moves per block (small rows share a block)
  const int64_t chunks = (num_layers + kLayerChunk - 1) / kLayerChunk;
  if (chunks > kMaxGridY) return cudaErrorInvalidValue;
  for (int64_t first = 0; first < num_moves; first += kMaxGridX * ty) {
    const int64_t moves = num_moves - first < kMaxGridX * ty ? num_moves - first
                                                             : kMaxGridX * ty;
    const dim3 grid((unsigned)((moves + ty - 1) / ty), (unsigned)chunks);
    relocate_kernel<Vec><<<grid, dim3(tx, ty), 0, stream>>>(
        kv, src + first, dst + first, moves, (int)num_layers, num_slots, layer_stride,
        row_bytes, row_vecs);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

using Launcher = cudaError_t (*)(char*, int64_t, int64_t, int64_t, int64_t, const int64_t*,
                                 const int64_t*, int64_t, cudaStream_t);

Launcher pick_launcher(int vector_bytes) {
  switch (vector_bytes) {
    case 16: return launch<uint4>;
    case 8: return launch<uint2>;
    case 4: return launch<uint32_t>;
    case 2: return launch<uint16_t>;
    default: return launch<uint8_t>;
  }
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

extern "C" int vtoken_relocate_kv(void* kv, int64_t num_layers, int64_t num_slots,
                                  int64_t layer_stride_bytes, int64_t row_bytes,
                                  const int64_t* src, const int64_t* dst, int64_t num_moves,
                                  void* stream) {
  if (num_moves <= 0 || num_layers <= 0 || row_bytes <= 0) return cudaSuccess;
  if (num_layers > 0x7fffffff) return cudaErrorInvalidValue;
  const Launcher run =
      pick_launcher(vtoken_relocate_vector_bytes(kv, layer_stride_bytes, row_bytes));
  return run(static_cast<char*>(kv), num_layers, num_slots, layer_stride_bytes, row_bytes, src,
             dst, num_moves, static_cast<cudaStream_t>(stream));
}

extern "C" const char* vtoken_relocate_error_string(int error) {
  static thread_local char text[256];
  const cudaError_t e = static_cast<cudaError_t>(error);
  snprintf(text, sizeof(text), "%s: %s", cudaGetErrorName(e), cudaGetErrorString(e));
  return text;
}
