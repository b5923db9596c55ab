// vToken KV relocation: a torch-free C ABI (the torch binding lives in relocate_binding.cpp).
// build_relocate_lib.sh also builds relocate_kv.cu alone into a plain shared library exporting
// exactly these functions (the CUDA runtime linked in statically), which vllm/kernels/cuda_kernels.py
// loads with ctypes where no compiler exists.
//
// The KV cache of all layers, as bytes:
//
//   kv  [num_layers][num_slots][row_bytes]      row = K and V of one slot: 2 * kv_heads * head_dim
//        ^ layer_stride_bytes apart              elements, contiguous (the fork's cache layout)
//
// For every move i and every layer l:  kv[l][dst[i]] = kv[l][src[i]]  (one launch for all).
// A pure byte copy, so fp32, fp16 and bf16 caches all go through the same kernel; rows are
// copied 16 bytes at a time when the base pointer, row size and layer stride allow it.
// src and dst must be disjoint (the planner moves live tokens into dead slots only).
//
// Built with -DVTOKEN_DEBUG, the kernel traps on a slot outside [0, num_slots) (and the torch
// binding checks the index ranges on the host first); without it nothing is checked.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// src, dst: device arrays of num_moves int64 slot indices.  stream: a cudaStream_t (0 = default).
// Returns 0 (cudaSuccess) or the cudaError_t of the launch.  Asynchronous: nothing is waited on.
int vtoken_relocate_kv(void* kv, int64_t num_layers, int64_t num_slots,
                       int64_t layer_stride_bytes, int64_t row_bytes, const int64_t* src,
                       const int64_t* dst, int64_t num_moves, void* stream);

// The access width (16, 8, 4, 2 or 1 bytes) the launcher picks for this layout.
int vtoken_relocate_vector_bytes(const void* kv, int64_t layer_stride_bytes, int64_t row_bytes);

// The name and description of an error code returned above ("cudaErrorNoKernelImageForDevice:
// no kernel image is available for execution on the device"), in a per-thread buffer that the
// next call on the same thread overwrites.
const char* vtoken_relocate_error_string(int error);

#ifdef __cplusplus
}
#endif
