#!/usr/bin/env bash
# Compile-check the relocation kernel with bare nvcc (no torch headers) for sm_80 and sm_90,
# and check that its header is plain C.  Seconds, no GPU needed.
set -euo pipefail
cd "$(dirname "$0")"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
start=$(date +%s%N)
if command -v cc >/dev/null 2>&1; then   # the C ABI header must be plain C
  echo '#include "relocate_kv.cuh"' | cc -std=c99 -Wall -Werror -fsyntax-only -I. -x c -
fi
nvcc -std=c++17 -O3 -Werror all-warnings -Xcompiler -Wall,-Wextra \
  -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
  -c relocate_kv.cu -o "$out/relocate_kv.o"
if command -v cuobjdump >/dev/null 2>&1; then
  archs=$(cuobjdump --list-elf "$out/relocate_kv.o" | grep -o 'sm_[0-9]*' | sort -u | tr '\n' ' ')
  for a in sm_80 sm_90; do
    [[ " $archs" == *" $a "* ]] || { echo "nvcc_check: no $a code in the object ($archs)"; exit 1; }
  done
fi
# the aligned path must use 16-byte global loads and stores
nvcc -std=c++17 -O3 -arch=sm_90 -ptx relocate_kv.cu -o "$out/relocate_kv.ptx"
for op in ld.global.v4.u32 st.global.v4.u32; do
  grep -q "$op" "$out/relocate_kv.ptx" || { echo "nvcc_check: no $op in the PTX"; exit 1; }
done
ms=$(( ($(date +%s%N) - start) / 1000000 ))
echo "nvcc_check: relocate_kv.cu OK for sm_80 sm_90 in $((ms / 1000)).$((ms % 1000 / 100)) s"
