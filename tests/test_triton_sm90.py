"""The Triton decode path compiled for Hopper (sm_90) without a GPU: every decode-path kernel
(one-split decode, split-K partials and reduce, attention mass) at the block sizes and warps
decode_attention picks, as the JIT specializes them (16-byte aligned pointers and strides),
fits its registers with zero spill bytes, and the attention kernels run their dots on tensor
cores (mma in the PTX, HMMA in the SASS) for bf16/fp16 caches and on exact FMA for fp32.

Shapes compiled (one subprocess, once per module; ~30 kernels, a couple of minutes cold, seconds
from Triton's cache): every kernel at bf16 for head_dim 64 and 128 and 1, 4, 8 query heads per
KV head; fp32 every kernel at head_dim 128 (the larger, the register-hungrier) for 1, 4, 8 and
the attention kernels at head_dim 64 with 8; fp16 the split kernel at 128 / 4. The one-split
decode kernel without statistics differs from the one with them by two stores: compiled at
bf16 128 / 4 and fp32 128 / 8 only."""
import functools
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTENTION = ("decode_stats", "split", "mass")


def _cases():
    cases = [("bf16", d, g, k) for d in (64, 128) for g in (1, 4, 8) for k in ATTENTION]
    cases += [("bf16", d, 1, "reduce") for d in (64, 128)]
    cases += [("fp32", 128, g, k) for g in (1, 4, 8) for k in ATTENTION]
    cases += [("fp32", 64, 8, k) for k in ATTENTION]
    cases += [("fp32", 128, 1, "reduce"), ("fp16", 128, 4, "split"),
              ("bf16", 128, 4, "decode"), ("fp32", 128, 8, "decode")]
    return cases


CASES = _cases()
_RUN = r"""
import json, sys
from tests.kernel_refs import compile_decode_kernels
cases = [tuple(c) for c in json.loads(sys.argv[1])]
print("RESULT" + json.dumps(compile_decode_kernels(cases, 90)))
"""


@functools.lru_cache(maxsize=None)
def _compiled() -> dict:
    """Every case compiled in one process without TRITON_INTERPRET (which other test modules
    set at import), cached for the module."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    run = subprocess.run([sys.executable, "-c", _RUN, json.dumps(CASES)], env=env,
                         capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.split("RESULT", 1)[1])


@pytest.mark.parametrize("dtype,d,g,kernel", CASES, ids=["/".join(map(str, c)) for c in CASES])
def test_decode_kernel_on_sm90(dtype, d, g, kernel):
    usage = _compiled()[f"{dtype}/{d}/{g}/{kernel}"]
    assert usage["spill_bytes"] == 0, usage
    assert usage["regs"] <= 128, usage          # room for 4 resident CTAs of 4 warps per SM
    tensor_cores = dtype != "fp32" and kernel != "reduce"
    assert usage["mma_ptx"] == tensor_cores and usage["mma_sass"] == tensor_cores, usage


def test_block_sizes_follow_the_group():
    """The query-head block is the group rounded up to a power of two, never padded to 16."""
    import torch

    from vllm.attention import triton_decode as td
    for g, block in ((1, 1), (2, 2), (4, 4), (5, 8), (8, 8)):
        for dtype in (torch.bfloat16, torch.float32):
            assert td._config(g, 128, dtype).block_g == block
    assert td._config(4, 80, torch.bfloat16).block_d == 128
