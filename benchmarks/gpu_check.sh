#!/usr/bin/env bash
# One script for a lent GPU machine (well under 5 minutes): compile-check the kernel, build
# vllm._C in place, run tests/gpu (+ the kernel tests), time relocation vs the D2D copy ceiling.
#   bash benchmarks/gpu_check.sh            results go to $OUT (device tool) or benchmarks/results
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
RESULTS=${OUT:-benchmarks/results}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
start=$SECONDS
mkdir -p "$RESULTS"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  $PY -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)"
  echo "== nvcc check";        bash csrc/nvcc_check.sh
  echo "== build vllm._C"
  TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-8} \
    $PY setup.py build_ext --inplace >"$RESULTS/build.log" 2>&1 \
    || { tail -n 40 "$RESULTS/build.log"; exit 1; }
  $PY -c "import vllm._C, torch; print('op registered:', torch.ops.vtoken.relocate_kv)"
  echo "== tests (build $((SECONDS - start)) s)"
  $PY -m pytest -q -p no:cacheprovider tests/gpu tests/test_kernels.py
  echo "== relocation vs copy ceiling"
  $PY benchmarks/benchmark_relocation.py --device cuda --out-dir "$RESULTS"
  echo "gpu_check: done in $((SECONDS - start)) s"
} 2>&1 | tee "$RESULTS/gpu_check.log"
