#!/usr/bin/env bash
# Build the relocation kernel (relocate_kv.cu) into a plain CUDA shared library that Python loads
# with ctypes (vllm/kernels/cuda_kernels.py), so relocation runs the CUDA kernel on a machine with no
# compiler (no nvcc, no ninja: a bare pip torch):
#
#   bash csrc/build_relocate_lib.sh [OUT_DIR]     # default csrc/prebuilt  (make relocate-lib)
#
# -> OUT_DIR/libvtoken_relocate.so   exports only the C ABI of relocate_kv.cuh (vtoken_relocate_*);
#                                    the CUDA runtime linked in statically (-cudart static): it
#                                    needs the driver (libcuda.so.1, opened at the first call) and
#                                    libc/libstdc++/libgcc_s, no libcudart. A fat binary: sm_80 and
#                                    sm_90 code, compute_90 PTX for newer GPUs (the driver JITs it).
#    OUT_DIR/libvtoken_relocate.json  its manifest: the library's sha256 and size, the sha256 of
#                                    the sources it was built from (relocate_kv.cuh, relocate_kv.cu
#                                    and this script, concatenated), nvcc's version, the targets.
#                                    The loader uses the library only when both hashes match.
#
# Rebuild and check in both files after any change to those sources; tests/
# test_cuda_kernels_build.py fails while the manifest and the sources disagree. Needs nvcc (CUDA
# 13 here, the CUDA of torch's cu130 wheels); a few seconds.
set -euo pipefail
cd "$(dirname "$0")"
out=${1:-prebuilt}
mkdir -p "$out"
out=$(cd "$out" && pwd)
NAME=libvtoken_relocate
SOURCES=(relocate_kv.cuh relocate_kv.cu build_relocate_lib.sh)
GENCODE=(-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
         -gencode arch=compute_90,code=compute_90)
EXPORTS=(vtoken_relocate_error_string vtoken_relocate_kv vtoken_relocate_vector_bytes)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf '{ global: %s; local: *; };\n' "$(IFS=';'; echo "${EXPORTS[*]}" | sed 's/;/; /g')" \
  >"$tmp/exports.map"
# -cudart static: no libcudart at load time. --exclude-libs/--version-script: nothing of the
# static runtime is exported (it must not interpose on torch's libcudart). -s: stripped.
nvcc -std=c++17 -O3 -shared -Xcompiler -fPIC -cudart static "${GENCODE[@]}" \
  -Xlinker --version-script="$tmp/exports.map" -Xlinker --exclude-libs,ALL \
  -Xlinker --gc-sections -Xlinker -s relocate_kv.cu -o "$tmp/$NAME.so"

exported=$(nm -D --defined-only "$tmp/$NAME.so" | awk '$2 == "T" {print $3}' | sort | tr '\n' ' ')
if [ "$exported" != "${EXPORTS[*]} " ]; then
  echo "build_relocate_lib: exports '$exported', expected '${EXPORTS[*]}'" >&2; exit 1
fi
if readelf -d "$tmp/$NAME.so" | grep -q 'NEEDED.*libcudart'; then
  echo "build_relocate_lib: links libcudart dynamically" >&2; exit 1
fi
mv "$tmp/$NAME.so" "$out/$NAME.so"
nvcc_version=$(nvcc --version | sed -n 's/.*release \([0-9.]*\), V\([0-9.]*\).*/\2/p')
glibc=$(objdump -T "$out/$NAME.so" | grep -o 'GLIBC_[0-9.]*' | sort -Vu | tail -n1)
cat >"$out/$NAME.json" <<EOF
{
 "library": "$NAME.so",
 "sha256": "$(sha256sum "$out/$NAME.so" | cut -d' ' -f1)",
 "bytes": $(stat -c %s "$out/$NAME.so"),
 "sources": ["${SOURCES[0]}", "${SOURCES[1]}", "${SOURCES[2]}"],
 "sources_sha256": "$(cat "${SOURCES[@]}" | sha256sum | cut -d' ' -f1)",
 "nvcc": "$nvcc_version",
 "gencode": "${GENCODE[*]}",
 "exports": ["${EXPORTS[0]}", "${EXPORTS[1]}", "${EXPORTS[2]}"],
 "needs_glibc": "$glibc"
}
EOF
echo "build_relocate_lib: $out/$NAME.so ($(stat -c %s "$out/$NAME.so") bytes, nvcc" \
  "$nvcc_version, needs $glibc) and $NAME.json"
