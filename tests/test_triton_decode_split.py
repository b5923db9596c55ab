"""Split-K Triton decode (vllm/attention/triton_decode.py) against the float64 reference, under
TRITON_INTERPRET=1, and the split kernels compiled for Hopper without a GPU."""
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():   # before any triton kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from vllm.attention import triton_decode  # noqa: E402
from tests.kernel_refs import decode_reference, paged_scene, rel_err  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need the interpreter; tests/gpu runs on CUDA")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _scene(h, kvh, d, lens, seed, dtype=torch.float32, num_blocks=48):
    """paged_scene with tails past lens that mix -1, 0 and real slots (all must be ignored)."""
    kv, slots, lens_t = paged_scene(lens, kvh, d, seed=seed, num_blocks=num_blocks, pad=0,
                                    dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    for i, n in enumerate(lens):
        tail = torch.randint(0, kv.shape[0], (slots.shape[1] - n,), generator=g)
        tail[::2] = -1                                   # -1 in the middle of the tail
        slots[i, n:] = tail
    q = torch.randn(len(lens), h, d, generator=g).to(dtype)
    return q, kv, slots, lens_t


@interpreted
@pytest.mark.parametrize("num_splits", [1, 2, 3, 5])
@pytest.mark.parametrize("h,kvh,d", [(4, 2, 16), (8, 1, 16), (2, 2, 16), (4, 2, 24)])
def test_split_decode_matches_reference(num_splits, h, kvh, d):
    """GQA / MQA / MHA / odd head_dim; rows of 0 keys and shorter than Lmax; 5 splits over at
    most 4 tiles (and 3 splits of 2 tiles each) leave empty splits."""
    lens = [0, 100, 33]
    q, kv, slots, lens_t = _scene(h, kvh, d, lens, seed=h * 10 + kvh + d, num_blocks=96)
    ref_out, ref_mass = decode_reference(q, kv, slots, lens_t, 0.3)
    start = torch.rand(len(lens), slots.shape[1] + 3)     # mass may be wider than Lmax
    mass = start.clone()
    out = triton_decode.decode_attention(q, kv, slots, lens_t, 0.3, mass, num_splits=num_splits)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_err(out, ref_out) < 1e-5
    assert out[0].eq(0).all()                             # no keys: zeros, not NaN
    width = slots.shape[1]
    assert rel_err(mass[:, :width] - start[:, :width], ref_mass) < 1e-5
    assert torch.equal(mass[:, width:], start[:, width:])
    plain = triton_decode.decode_attention(q, kv, slots, lens_t, 0.3, num_splits=num_splits)
    assert rel_err(plain, ref_out) < 1e-5


@interpreted
def test_default_split_heuristic_on_the_interpreter():
    """Without num_splits the interpreter still splits a long row (MIN_TILES tiles per split);
    the short row fits in its first split."""
    lens = [300, 45]
    q, kv, slots, lens_t = _scene(4, 1, 16, lens, seed=7, num_blocks=140)
    assert triton_decode.num_splits_for(2, 1, 300, 32, q.device) == 2
    ref_out, ref_mass = decode_reference(q, kv, slots, lens_t, 0.25)
    mass = torch.zeros(slots.shape)
    out = triton_decode.decode_attention(q, kv, slots, lens_t, 0.25, mass)
    assert rel_err(out, ref_out) < 1e-5 and rel_err(mass, ref_mass) < 1e-5


@interpreted
@pytest.mark.parametrize("num_splits", [1, 3])
def test_bf16_cache_split_decode(num_splits):
    lens = [37, 64, 5]
    q, kv, slots, lens_t = _scene(4, 2, 16, lens, seed=11, dtype=torch.bfloat16)
    ref_out, ref_mass = decode_reference(q, kv, slots, lens_t, 0.25)
    mass = torch.zeros(slots.shape)
    out = triton_decode.decode_attention(q, kv, slots, lens_t, 0.25, mass, num_splits=num_splits)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref_out) < 2e-2 and rel_err(mass, ref_mass) < 2e-2


def test_split_heuristic(monkeypatch):
    """Shapes only: enough programs for WAVES per SM, at least MIN_TILES tiles per split."""
    monkeypatch.setattr(triton_decode, "_sm_count", lambda device: 132)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert triton_decode.num_splits_for(1, 8, 8192, 32, cuda) == 64
    assert triton_decode.num_splits_for(1, 8, 1024, 32, cuda) == 8        # 32 tiles / 4
    assert triton_decode.num_splits_for(16, 8, 8192, 32, cuda) == 4       # 528 // 128
    assert triton_decode.num_splits_for(64, 8, 8192, 32, cuda) == 1
    assert triton_decode.num_splits_for(1, 8, 100, 32, cuda) == 1         # too short to split
    assert triton_decode.num_splits_for(1, 1, 8192, 32, cpu) == triton_decode.CPU_PROGRAMS


_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm.attention import triton_decode as td

def sig(fn, dtype, consts):
    types = {"q_ptr": dtype, "kv_ptr": dtype, "out_ptr": dtype, "slots_ptr": "*i64",
             "lens_ptr": "*i64", "scale": "fp32"}
    return {a: "constexpr" if a in consts else types.get(a, "*fp32" if a.endswith("_ptr")
                                                          else "i32") for a in fn.arg_names}

tile = dict(G=4, D=128, BLOCK_G=16, BLOCK_N=32, BLOCK_D=128)
kernels = {"split": (td._split_kernel, tile), "mass": (td._mass_kernel, tile),
           "reduce": (td._reduce_kernel, dict(D=128, BLOCK_S=64, BLOCK_D=128, WANT_STATS=True))}
sizes = {}
for name, (fn, consts) in kernels.items():          # bf16: loads cast to fp32 before tl.dot
    k = triton.compile(ASTSource(fn, sig(fn, "*bf16", consts), constexprs=consts),
                       target=GPUTarget("cuda", 90, 32))
    sizes[name] = len(k.asm["cubin"])
print(sizes)
"""


def test_split_kernels_compile_for_sm90():
    """The interpreter is more permissive than the compiler: compile for Hopper, no GPU needed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert all(name in run.stdout for name in ("split", "reduce", "mass"))
