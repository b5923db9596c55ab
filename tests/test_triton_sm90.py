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
bf16 128 / 4 and fp32 128 / 8 only.

Over an fp8 cache (--kv-cache-dtype, "bf16+e4m3": bf16 queries over an e4m3fn cache): the
attention kernels at bf16 for both formats, head_dim 64 and 128, 1, 4, 8 heads per KV head
(tensor cores: the fp8 tiles are converted to bf16 in registers); fp16 and fp32 queries at
head_dim 128, 8 (fp32: the exact FMA path, one pipelining stage). The reduce kernel never reads
the cache. The KV write kernel quantizing bf16 into either format: no spills, no tensor cores."""
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
    cases += [(f"bf16+{f}", d, g, k) for f in ("e4m3", "e5m2") for d in (64, 128)
              for g in (1, 4, 8) for k in ATTENTION]
    cases += [(f"{q}+{f}", 128, 8, k) for q in ("fp16", "fp32") for f in ("e4m3", "e5m2")
              for k in ATTENTION]
    cases += [("bf16+e4m3", 128, 4, "decode")]
    return cases


CASES = _cases()
_RUN = r"""
import json, sys
from tests.kernel_refs import compile_decode_kernels, compile_write_kv_fp8, resource_usage
cases = [tuple(c) for c in json.loads(sys.argv[1])]
out = compile_decode_kernels(cases, 90)
for cache in ("fp8e4nv", "fp8e5"):
    out[f"write_kv/{cache}"] = resource_usage(compile_write_kv_fp8(cache, 90))
print("RESULT" + json.dumps(out))
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
    tensor_cores = not dtype.startswith("fp32") and kernel != "reduce"
    assert usage["mma_ptx"] == tensor_cores and usage["mma_sass"] == tensor_cores, usage


@pytest.mark.parametrize("cache", ["fp8e4nv", "fp8e5"])
def test_fp8_write_kv_on_sm90(cache):
    usage = _compiled()[f"write_kv/{cache}"]
    assert usage["spill_bytes"] == 0 and usage["regs"] <= 64, usage
    assert not usage["mma_ptx"], usage


def test_block_sizes_follow_the_group():
    """The query-head block is the group rounded up to a power of two, never padded to 16."""
    import torch

    from vllm.kernels import triton_decode as td
    for g, block in ((1, 1), (2, 2), (4, 4), (5, 8), (8, 8)):
        for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
            assert td._config(g, 128, dtype).block_g == block
    assert td._config(4, 80, torch.bfloat16).block_d == 128


def test_pipelining_depth():
    """Triton's default 3 stages, except fp32 dots over an fp8 cache (1: its prefetched fp32
    tiles spill at 3)."""
    import torch

    from vllm.kernels import triton_decode as td
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    for kv in (torch.bfloat16, torch.float16, torch.float32) + fp8:
        for q in (None, torch.bfloat16, torch.float16, torch.float32):
            want = 1 if kv in fp8 and q == torch.float32 else 3
            assert td._config(4, 128, kv, q).num_stages == want, (kv, q)
