#!/usr/bin/env bash
# Compile-check the relocation kernel with bare nvcc (no torch headers) for sm_80 and sm_90, in
# release and debug (-DVTOKEN_DEBUG) builds; check that its header is plain C; and, where a
# Python with torch is found ($PY, else .venv/bin/python, else python3), syntax-check the torch
# binding against torch's headers (a CPU torch works: the one generated header it lacks is
# stubbed). Seconds to ~20 s, no GPU needed. The op itself is built at first use on a CUDA
# machine (vllm/kernels/cuda_kernels.py), never at install.
set -euo pipefail
cd "$(dirname "$0")"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
start=$(date +%s%N)
if command -v cc >/dev/null 2>&1; then   # the C ABI header must be plain C
  echo '#include "relocate_kv.cuh"' | cc -std=c99 -Wall -Werror -fsyntax-only -I. -x c -
fi
for debug in "" -DVTOKEN_DEBUG; do
  nvcc -std=c++17 -O3 $debug -Werror all-warnings -Xcompiler -Wall,-Wextra \
    -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
    -c relocate_kv.cu -o "$out/relocate_kv$debug.o"
done
if command -v cuobjdump >/dev/null 2>&1; then
  archs=$(cuobjdump --list-elf "$out/relocate_kv.o" | grep -o 'sm_[0-9]*' | sort -u | tr '\n' ' ')
  for a in sm_80 sm_90; do
    [[ " $archs" == *" $a "* ]] || { echo "nvcc_check: no $a code in the object ($archs)"; exit 1; }
  done
fi
# the aligned path must use 16-byte global loads and stores, and no 64-bit division
nvcc -std=c++17 -O3 -arch=sm_90 -ptx relocate_kv.cu -o "$out/relocate_kv.ptx"
for op in ld.global.v4.u32 st.global.v4.u32; do
  grep -q "$op" "$out/relocate_kv.ptx" || { echo "nvcc_check: no $op in the PTX"; exit 1; }
done
if grep -qE '(div|rem)\.(s|u)64' "$out/relocate_kv.ptx"; then
  echo "nvcc_check: a 64-bit division in the kernels' PTX"; exit 1
fi
binding="binding skipped (no torch)"
PY=${PY:-$( [ -x ../.venv/bin/python ] && echo ../.venv/bin/python || echo python3 )}
if torch_dir=$("$PY" -c "import torch, os; print(os.path.dirname(torch.__file__))" 2>/dev/null); then
  mkdir -p "$out/stub/c10/cuda/impl"      # generated at torch's build; absent from CPU wheels
  [ -f "$torch_dir/include/c10/cuda/impl/cuda_cmake_macros.h" ] || \
    printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' \
      >"$out/stub/c10/cuda/impl/cuda_cmake_macros.h"
  cuda_inc=$(nvcc --dryrun -c -x cu /dev/null 2>&1 | sed -n 's/^#\$ INCLUDES="-I\([^"]*\)".*/\1/p' | head -n1)
  for debug in "" -DVTOKEN_DEBUG; do
    ${CXX:-c++} -std=c++20 -fsyntax-only -Wall -Wextra -Werror $debug -isystem "$out/stub" \
      -isystem "$torch_dir/include" -isystem "$torch_dir/include/torch/csrc/api/include" \
      -isystem "$cuda_inc" -I. relocate_binding.cpp
  done
  binding="binding OK against torch $("$PY" -c 'import torch; print(torch.__version__)')"
fi
ms=$(( ($(date +%s%N) - start) / 1000000 ))
echo "nvcc_check: relocate_kv.cu OK for sm_80 sm_90 (release, debug); $binding;" \
  "$((ms / 1000)).$((ms % 1000 / 100)) s"
