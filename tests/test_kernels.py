"""Kernels against torch references on CPU: the Triton relocation and decode-attention kernels
(under TRITON_INTERPRET=1), the dispatch rules of vllm/kernels/ops.py, and prefill dispatch."""
import os
import platform
import sys
import types

import pytest
import torch

if not torch.cuda.is_available():   # before any triton kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from vllm.kernels import ops  # noqa: E402
from vllm.kernels import cpu_kernels  # noqa: E402
from vllm.kernels import triton_decode, triton_relocate  # noqa: E402
from vllm.huge_pages import HUGE_PAGE  # noqa: E402
from vllm.weight_arena import WeightArena  # noqa: E402
from tests.kernel_refs import (decode_reference, install_fake_xformers, moves,  # noqa: E402
                               paged_scene, prefill_reference, rel_err)

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need the interpreter; tests/gpu runs on CUDA")


# ---- relocation ---------------------------------------------------------------------------------
@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kvh,d", [(2, 8), (1, 3)])      # 3: rows not a multiple of 16 bytes
def test_triton_relocation_is_exact(dtype, kvh, d):
    kv = torch.randn(3, 64, 2, kvh, d).to(dtype)
    kv[0, 5] = float("nan")                  # bits are copied, NaN payloads too
    src, dst = moves(64, 12, seed=1)
    ref = kv.clone()
    ops.relocate_kv(ref, src, dst, backend="torch")
    triton_relocate.relocate_kv(kv, src, dst)
    assert torch.equal(kv.view(torch.uint8), ref.view(torch.uint8))


def test_relocation_dispatch():
    kv = torch.randn(2, 32, 2, 2, 4)
    src, dst = moves(32, 5, seed=2)
    expect = kv.clone()
    expect[:, dst] = expect[:, src]
    ops.relocate_kv(kv, src, dst)                                    # CPU default: torch
    assert torch.equal(kv, expect)
    ops.relocate_kv(kv, src[:0], dst[:0])                            # empty batch: no-op
    assert ops._pick(None, False, ("cuda", "triton", "torch")) == "torch"
    assert ops._pick("triton", False, ("cuda", "triton", "torch")) == "triton"
    with pytest.raises(AssertionError):
        ops._pick("cuda", False, ("triton", "torch"))


# ---- decode attention ---------------------------------------------------------------------------
@interpreted
@pytest.mark.parametrize("h,kvh", [(4, 2), (8, 1), (2, 2)])      # GQA, MQA, MHA
@pytest.mark.parametrize("pad", [-1, 0])                          # input buffers / current views
def test_triton_decode_matches_reference(h, kvh, pad):
    lens = [5, 37, 1, 20]
    kv, slots, lens_t = paged_scene(lens, kvh, 16, seed=h + kvh + pad, pad=pad)
    q = torch.randn(len(lens), h, 16, generator=torch.Generator().manual_seed(3))
    ref_out, ref_mass = decode_reference(q, kv, slots, lens_t, 0.25)
    mass = torch.zeros(slots.shape)
    out = triton_decode.decode_attention(q, kv, slots, lens_t, 0.25, mass)
    assert rel_err(out, ref_out) < 1e-5
    assert rel_err(mass, ref_mass) < 1e-5
    plain = triton_decode.decode_attention(q, kv, slots, lens_t, 0.25)    # online softmax pass
    assert rel_err(plain, ref_out) < 1e-5


@interpreted
def test_decode_mass_accumulates_over_layers_and_odd_head_dim():
    kv, slots, lens = paged_scene([9, 3], kvh=2, d=12, seed=5)
    q = torch.randn(2, 4, 12, generator=torch.Generator().manual_seed(4))
    mass = torch.zeros(slots.shape)
    triton_decode.decode_attention(q, kv, slots, lens, 0.3, mass)
    triton_decode.decode_attention(q, kv, slots, lens, 0.3, mass)        # a second "layer"
    _, ref_mass = decode_reference(q, kv, slots, lens, 0.3)
    assert rel_err(mass, 2 * ref_mass) < 1e-5
    assert torch.allclose(mass.sum(1), torch.tensor([8.0, 8.0]))        # 4 heads x 2 layers


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpreted)])
def test_decode_dispatch_matches_the_cpu_backend(backend):
    """ops.decode_attention (both paths) agrees with the attention backend's CPU decode."""
    from vllm.attention.backend import AttentionMetadata, _decode
    lens = [6, 17, 11]
    kv, slots, lens_t = paged_scene(lens, kvh=2, d=16, seed=9, pad=-1)
    q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(8))
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64), num_decodes=3,
                             decode_views=slots, decode_lens=lens_t,
                             decode_mass=torch.zeros(slots.shape))
    with ops.forced_backend("torch"):                 # the backend's torch gather + SDPA path
        ref = _decode(q, kv, meta, 0.25)
    mass = torch.zeros(slots.shape)
    out = ops.decode_attention(q, kv, slots, lens_t, 0.25, mass, backend=backend)
    assert rel_err(out, ref) < 1e-5 and rel_err(mass, meta.decode_mass) < 1e-5


# ---- prefill attention --------------------------------------------------------------------------
@pytest.mark.parametrize("lq,lk,explicit", [(7, 7, False), (3, 10, False), (5, 9, True)])
def test_prefill_torch_path(lq, lk, explicit):
    g = torch.Generator().manual_seed(lq + lk)
    q, k, v = torch.randn(4, lq, 8, generator=g), torch.randn(2, lk, 8, generator=g), \
        torch.randn(2, lk, 8, generator=g)
    causal = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    own = causal & ~causal.tril(lk - lq - 1)              # each query's own key: never masked
    mask = causal & (torch.rand(lq, lk, generator=g) > 0.3) | own if explicit else causal
    out = ops.prefill_attention(q, k, v, mask if explicit else None, 0.35)
    assert rel_err(out, prefill_reference(q, k, v, mask, 0.35)) < 1e-5


def _fake_xformers(monkeypatch):
    """A torch stand-in for xformers.ops on the 5-d [B, M, G, H, K] layout (checks our layout)."""
    class BottomRight:
        pass

    def mea(q, k, v, attn_bias=None, scale=None):
        qh, kh, vh = (t.permute(0, 2, 3, 1, 4) for t in (q, k, v))     # [B, G, H, M, K]
        s = qh @ kh.transpose(-1, -2) * scale
        if isinstance(attn_bias, BottomRight):
            lq, lk = s.shape[-2:]
            s = s.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq), -torch.inf)
        else:
            s = s + attn_bias
        return (torch.softmax(s, -1) @ vh).permute(0, 3, 1, 2, 4)
    install_fake_xformers(monkeypatch, mea, LowerTriangularFromBottomRightMask=BottomRight)


@pytest.mark.parametrize("explicit", [False, True])
def test_prefill_xformers_layout(monkeypatch, explicit):
    _fake_xformers(monkeypatch)
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(6, 5, 8, generator=g), torch.randn(2, 9, 8, generator=g), \
        torch.randn(2, 9, 8, generator=g)
    mask = torch.ones(5, 9, dtype=torch.bool).tril(4)
    if explicit:
        mask[:, 1] = False
    out = ops.prefill_attention(q, k, v, mask if explicit else None, 0.3, backend="xformers")
    assert rel_err(out, prefill_reference(q, k, v, mask, 0.3)) < 1e-5


def test_cpu_prefill_never_imports_xformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "xformers", None)    # importing it would raise
    q = torch.randn(2, 4, 8)
    ops.prefill_attention(q, q[:1], q[:1], None, 0.3)


def test_triton_kernels_compile_for_sm90():
    """The interpreter is more permissive than the compiler: compile for Hopper, no GPU needed."""
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from tests.kernel_refs import compile_kernels; print(compile_kernels(90))"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "relocate" in run.stdout and "decode_fp16_mass1" in run.stdout
    assert all(k in run.stdout for k in ("'split'", "'reduce'", "'mass'", "'write_kv'"))


# ---- C decode kernels (vllm/kernels/cpu_kernels.py) -----------------------------------------------------
cpu_built = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")


def test_cpu_kernels_build_where_a_compiler_exists():
    """A source that stops compiling would silently fall back to torch: fail loudly instead."""
    import shutil
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler")
    assert cpu_kernels.available() and ops.cpu_kernels_enabled()


@cpu_built
def test_isa_variants_build_with_their_panel_width(isa):
    assert cpu_kernels.library(isa).vtok_isa().decode() == isa
    width = {"avx512": 16, "avx2": 8, "generic": 4}[isa]
    assert cpu_kernels.panel_width() == width
    assert cpu_kernels.pack_weight(torch.ones(3, 2 * width + 1)).shape == (3, 3, width)


@pytest.mark.parametrize("variant", cpu_kernels.ISAS)
def test_every_variant_compiles(tmp_path, variant):
    """Also the ones this CPU cannot run (compiled only, never loaded)."""
    import shutil
    import subprocess
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None or (variant != "generic" and platform.machine() != "x86_64"):
        pytest.skip("no C compiler for this variant")
    run = subprocess.run([cc, "-O1", *cpu_kernels._CFLAGS[variant], "-fopenmp", "-Wall",
                          "-Werror", "-c", str(cpu_kernels.SOURCE), "-o", str(tmp_path / "k.o")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]


def test_isa_detection_and_forcing(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_cpu_model", lambda: "model name : X\nflags : fpu sse2")
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    assert cpu_kernels.runnable_isas() == ["generic"]
    flags = "flags : sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512dq"
    monkeypatch.setattr(cpu_kernels, "_cpu_model", lambda: flags)
    assert cpu_kernels.runnable_isas() == ["avx512", "avx2", "generic"]
    monkeypatch.setattr(cpu_kernels, "_cpu_model", lambda: "flags : sse2 avx2 fma")
    assert cpu_kernels.runnable_isas() == ["generic"]         # F16C widens the fp8 cache
    monkeypatch.setattr(cpu_kernels, "_cpu_model", lambda: "flags : sse2 avx2 fma f16c")
    for forced, expect in [(None, "avx2"), ("generic", "generic"), ("avx512", ValueError),
                           ("sse9", ValueError)]:
        if forced:
            monkeypatch.setenv("VLLM_CPU_ISA", forced)
        cpu_kernels.active_isa.cache_clear()
        if expect is ValueError:
            with pytest.raises(ValueError, match="VLLM_CPU_ISA"):
                cpu_kernels.active_isa()
        else:
            assert cpu_kernels.active_isa() == expect
    cpu_kernels.active_isa.cache_clear()


@cpu_built
# tails of both tiles, and where each build leaves one-panel passes for pairs (avx2 after 3
# rows, avx512 after 8)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 9, 13, 15, 16, 17, 33, 200])
@pytest.mark.parametrize("k,n", [(5, 7), (64, 48), (96, 200)])       # n not a multiple of 16 too
@pytest.mark.parametrize("bf16", [False, True])
def test_packed_gemm_matches_torch(isa, m, k, n, bf16):
    """float32 panels, and bf16 ones against a float64 reference of the bf16 values (widened
    exactly, float32 accumulation: the same bound)."""
    g = torch.Generator().manual_seed(m * k + n)
    x, w, bias = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g), \
        torch.randn(n, generator=g)
    res = torch.randn(m, n, generator=g)
    packed = cpu_kernels.pack_weight(w, bf16=bf16)
    assert packed.dtype == (torch.bfloat16 if bf16 else torch.float32)
    w = w.bfloat16().float() if bf16 else w
    for prefetch in (True, False):
        assert rel_err(cpu_kernels.packed_gemm(x, packed, n, prefetch=prefetch),
                       x.double() @ w.double()) < 1e-6
        assert rel_err(cpu_kernels.packed_gemm(x, packed, n, bias, res, prefetch),
                       x.double() @ w.double() + bias.double() + res.double()) < 1e-6


@cpu_built
@pytest.mark.parametrize("m", [97, 250])
def test_packed_gemm_row_blocks_in_place(isa, m):
    """A prefill-sized GEMM runs in row blocks of 256 KB of x (K = 2048: 126 rows with the
    avx2 tile, 120 with avx512's): block tails, an odd last panel, residual in place."""
    g = torch.Generator().manual_seed(m)
    x, w, bias = torch.randn(m, 2048, generator=g), torch.randn(2048, 40, generator=g), \
        torch.randn(40, generator=g)
    y = torch.randn(m, 40, generator=g)
    y16 = y.clone()
    expect = x.double() @ w.double() + bias.double() + y.double()
    packed = cpu_kernels.pack_weight(w)
    cpu_kernels._library().vtok_packed_gemm(x.data_ptr(), m, 2048, packed.data_ptr(), 40,
                                            bias.data_ptr(), y.data_ptr(), y.data_ptr(), 1)
    assert rel_err(y, expect) < 4e-6        # fp32 sums over K = 2048
    w16 = w.bfloat16().float()
    expect = x.double() @ w16.double() + bias.double() + y16.double()
    packed = cpu_kernels.pack_weight(w, bf16=True)
    cpu_kernels._library().vtok_packed_gemm_bf16(x.data_ptr(), m, 2048, packed.data_ptr(), 40,
                                                 bias.data_ptr(), y16.data_ptr(), y16.data_ptr(),
                                                 1)
    assert rel_err(y16, expect) < 4e-6


@cpu_built
@pytest.mark.parametrize("h,kvh,d", [(4, 2, 16), (8, 1, 64), (3, 3, 32), (9, 3, 128),
                                     (14, 2, 64)])          # 7 query heads per KV head: 4 + 3
def test_cpu_decode_matches_reference(isa, h, kvh, d):
    lens = [5, 37, 1, 20, 0]                             # ragged, one row of padding only
    kv, slots, lens_t = paged_scene(lens, kvh, d, seed=h + d, pad=-1)
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(3))
    ref_out, ref_mass = decode_reference(q, kv, slots, lens_t, 0.25)
    mass = torch.ones(slots.shape)                       # accumulated into, like over layers
    out = ops.decode_attention(q, kv, slots, lens_t, 0.25, mass, backend="cpu")
    assert rel_err(out, ref_out) < 1e-5
    assert rel_err(mass - 1, ref_mass) < 1e-5
    assert torch.equal(out[4], torch.zeros(h, d))        # no keys: zeros, never NaN
    assert ops.decode_backend(q) == "cpu" and ops.decode_backend(q[..., :12]) == "torch"


@cpu_built
def test_cpu_decode_long_views_with_holes(isa):
    """Views longer than the prefetch distance (64 keys), with a run of padding inside one: the
    padding gets no mass and the output matches the reference over the live keys."""
    h, kvh, d = 9, 3, 64
    lens = [1500, 700, 33]
    kv, slots, lens_t = paged_scene(lens, kvh, d, seed=11, num_blocks=1000, pad=-1)
    holed = slots.clone()
    holed[0, 500:1100] = -1
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(5))
    mass = torch.zeros(slots.shape)
    out = ops.decode_attention(q, kv, holed, lens_t, 0.125, mass, backend="cpu")
    live = holed[0, :1500] >= 0
    compact = slots.clone()
    compact[0] = -1
    compact[0, :int(live.sum())] = holed[0, :1500][live]
    ref_out, ref_mass = decode_reference(q, kv, compact, torch.tensor([int(live.sum()), 700, 33]),
                                         0.125)
    assert rel_err(out, ref_out) < 1e-5
    assert torch.equal(mass[0, 500:1100], torch.zeros(600))
    assert rel_err(mass[0, :1500][live], ref_mass[0, :int(live.sum())]) < 1e-5
    assert rel_err(mass[1:], ref_mass[1:]) < 1e-5


@cpu_built
@pytest.mark.parametrize("n", [1, 7, 49152, 50001])        # 50001: a tail past the vectors
def test_cpu_argmax_rows_matches_torch(isa, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(12, n, generator=g)
    x[1] = x[1].round()                                  # many ties: the first one wins
    x[2] = float("-inf")
    x[3, n // 2] = x[3, n - 1] = 1e30                    # a tie across vector lanes
    x[4, n - 1] = float("nan")
    x[5, :] = x[5].max() + 1                             # all equal
    if n > 2:
        x[6, n - 2] = float("nan")
        x[6, 0] = float("nan")                           # the first NaN
    got = cpu_kernels.argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.argmax(x, dim=1))
    assert torch.equal(ops.argmax_rows(x), got)
    assert torch.equal(cpu_kernels.argmax_rows(x[:1, :]), got[:1])


@cpu_built
@pytest.mark.parametrize("m", [1, 16, 100])                 # 100: rows split across threads
def test_cpu_rms_norm_and_silu_mul_match_torch(isa, m):
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 48, generator=g) * 3, torch.randn(48, generator=g)
    ref = torch.nn.functional.rms_norm(x.double(), (48,), w.double(), 1e-5)
    assert rel_err(cpu_kernels.rms_norm(x, w, 1e-5), ref) < 1e-6
    gate_up = torch.randn(m, 64, generator=g) * 8               # exp of large |x| both ways
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, -90.0, 90.0])  # past exp's float range
    gate, up = gate_up.double().chunk(2, dim=-1)
    assert rel_err(cpu_kernels.silu_mul(gate_up), torch.nn.functional.silu(gate) * up) < 1e-6


@cpu_built
@pytest.mark.parametrize("t", [3, 100])                    # 100: tokens split across threads
def test_cpu_rope_and_kv_write_match_torch(isa, t):
    from vllm.attention.backend import write_kv
    from vllm.model_executor.models.llama import Rotary
    h, kvh, d = 4, 2, 16
    g = torch.Generator().manual_seed(t)
    rotary = Rotary(d, 256, 10000.0, {"rope_type": "default"}, torch.float32)
    positions = torch.randint(0, 256, (t,), generator=g)
    cos, sin = rotary.cos[positions], rotary.sin[positions]
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g)
    slots = torch.randperm(128, generator=g)[:t]
    slots[1] = -1                                           # no write for this token
    kv, kv_ref = torch.zeros(128, 2, kvh, d), torch.zeros(128, 2, kvh, d)
    q = cpu_kernels.rope_write_kv(qkv, cos, sin, slots, kv, h)
    qk = rotary(qkv[:, :(h + kvh) * d].view(t, -1, d), cos[:, None], sin[:, None])
    v = qkv[:, (h + kvh) * d:].view(t, kvh, d)
    keep = slots >= 0
    write_kv(kv_ref, slots[keep], qk[keep, h:], v[keep])
    assert rel_err(q, qk[:, :h]) < 1e-6
    assert rel_err(kv, kv_ref) < 1e-6 and torch.equal(kv[:, 1], kv_ref[:, 1])


# ---- the load-time choice (vllm/kernels/cpu_kernel_plan.py) and the model's use of it ------------------
def _layer_scene(seed=0, m=5, hidden=64, heads=4, kv_heads=2, d=16, inter=96, context=40,
                 qk_norm=False):
    """One decoder layer's config and weights (qk_norm: Qwen3's per-head q/k norms too), and a
    decode step of m rows over `context` cached keys each: (cfg, weights, x, positions,
    kv_cache, meta)."""
    from types import SimpleNamespace
    from vllm.attention.backend import AttentionMetadata
    g = torch.Generator().manual_seed(seed)
    cfg = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=d,
                          rms_norm_eps=1e-5)
    shapes = {"self_attn.q_proj": (heads * d, hidden), "self_attn.k_proj": (kv_heads * d, hidden),
              "self_attn.v_proj": (kv_heads * d, hidden), "self_attn.o_proj": (hidden, heads * d),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
              "mlp.down_proj": (hidden, inter)}
    w = {f"l.{n}.weight": torch.randn(*s, generator=g) * 0.2 for n, s in shapes.items()}
    w.update({f"l.{n}.weight": 1 + 0.1 * torch.randn(hidden, generator=g)
              for n in ("input_layernorm", "post_attention_layernorm")})
    if qk_norm:
        w.update({f"l.self_attn.{n}.weight": 1 + 0.3 * torch.randn(d, generator=g)
                  for n in ("q_norm", "k_norm")})
    w.update({f"l.self_attn.{n}_proj.bias": torch.randn(s[0], generator=g) * 0.1
              for n, s in zip("qkv", (shapes["self_attn.q_proj"], shapes["self_attn.k_proj"],
                                      shapes["self_attn.v_proj"]))})
    views = torch.randperm(m * context, generator=g).view(m, context)
    meta = AttentionMetadata(slot_mapping=torch.arange(m * context, m * context + m),
                             num_decodes=m, decode_views=views,
                             decode_lens=torch.full((m,), context))
    kv = torch.randn(m * context + m, 2, kv_heads, d, generator=g)
    x = torch.randn(m, hidden, generator=g)
    return cfg, w, x, torch.randint(0, 100, (m,), generator=g), kv, meta


def _forced_plan(monkeypatch, path, shapes, attention=(4, 2, 16)):
    from vllm.kernels import cpu_kernel_plan
    monkeypatch.setenv("VLLM_CPU_GEMM", path)
    return cpu_kernel_plan.plan_model(shapes, *attention, layers=1)


@cpu_built
@pytest.mark.parametrize("path", ["c", "torch", pytest.param("mkl", marks=pytest.mark.skipif(
    not hasattr(torch.ops.mkl, "_mkl_linear"), reason="no MKL packed GEMM in this torch"))])
def test_forced_gemm_paths_agree_and_keep_one_layout(monkeypatch, path):
    from vllm.model_executor.models.llama import Linear
    g = torch.Generator().manual_seed(1)
    w, bias = torch.randn(40, 70, generator=g), torch.randn(70, generator=g)
    plan = _forced_plan(monkeypatch, path, {(40, 70): 1})
    last = "torch" if path == "mkl" else path                   # MKL: up to 128 rows
    assert plan.source == "forced" and plan.gemm["40x70"] == [path] * 7 + [last]
    lin = Linear(w, bias, plan)
    kept = {"c": lin.packed is not None, "torch": lin.wt is not None, "mkl": bool(lin.mkl)}
    assert kept == {p: p in (path, last) for p in kept}         # only the layouts it uses
    arena = WeightArena(Linear.arena_floats((40, 70), plan))    # as the model keeps weights
    in_arena = Linear(w, bias, plan, arena)
    assert arena.used == arena.numel
    for m in (1, 3, 16, 100, 300):                              # bands incl. padded MKL rows
        x, res = torch.randn(m, 40, generator=g), torch.randn(m, 70, generator=g)
        ref = x.double() @ w.double() + bias.double() + res.double()
        assert rel_err(lin(x, residual=res), ref) < 1e-6
        assert torch.equal(in_arena(x, residual=res), lin(x, residual=res))


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`, in kB."""
    inside = False
    for line in open("/proc/self/smaps"):
        first = line.split()[0]
        if "-" in first and ":" not in first:
            lo, hi = (int(v, 16) for v in first.split("-"))
            inside = lo <= address < hi
        elif inside and first == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_weight_arena_hands_out_aligned_slices_on_huge_pages():
    arena = WeightArena(3 << 20)                                 # 12 MB of floats
    a, b = arena.take((1 << 20,)), arena.take((2, 1 << 20))
    assert a.data_ptr() % HUGE_PAGE == 0 and b.data_ptr() == a.data_ptr() + (4 << 20)
    with pytest.raises(AssertionError, match="sized for fewer"):
        arena.take((1,))
    b.fill_(1.0)                                                 # first touch: the pages come
    assert b.sum().item() == 2 << 20
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        pytest.skip("no transparent huge pages on this kernel")
    if "[never]" in thp or not arena.advised:
        pytest.skip(f"transparent huge pages off here ({thp.strip()})")
    assert _anon_huge_kb(b.data_ptr()) >= 2048                   # 8 MB touched: >= one 2 MB page


def test_band_of_rows():
    from vllm.kernels.cpu_kernel_plan import BANDS, band
    for i, (lo, hi) in enumerate(BANDS):
        assert band(lo) == i and band(hi or 10 ** 6) == i


def test_gemm_choice_keeps_one_layout_unless_another_wins_by_the_margin():
    from vllm.kernels.cpu_kernel_plan import _choose_gemm
    inf = float("inf")
    times = {"c": [1, 1, 1, 1, 2, 2, 2, 2], "torch": [0.95, 2, 2, 2, 1, 1, 1, 1.7],
             "mkl": [2, 0.5, 2, 2, 2, 2, 2, inf]}
    # torch wins 5 bands -> primary; mkl is 50% faster in band 1, c 50% in bands 2 and 3
    assert _choose_gemm(times) == ["torch", "mkl", "c", "c", "torch", "torch", "torch", "torch"]
    times["torch"][0] = 1.05                      # c wins band 0 by 5% only: torch stays
    assert _choose_gemm(times)[0] == "torch"


def _timing_scene(monkeypatch, tmp_path, calls: int, others_cores: float):
    """Plans timed on tiny shapes (one copy each, `calls` calls per candidate) into a private
    cache, with other processes using `others_cores` of the host."""
    from vllm.kernels import cpu_kernel_plan as kp
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("VLLM_CPU_GEMM", raising=False)
    monkeypatch.setattr(kp, "STREAM_BYTES", 1)
    monkeypatch.setattr(kp, "pool_bytes", lambda: 1)
    monkeypatch.setattr(kp, "CALLS", calls)
    monkeypatch.setattr(kp, "LAYER_CALLS", calls)
    monkeypatch.setattr(kp, "_wait_until_quiet", lambda: None)
    monkeypatch.setattr(kp.OthersCpu, "cores", lambda self: others_cores)


@cpu_built
def test_a_model_in_blocks_counts_its_blocks_towards_the_size_it_is_timed_from(monkeypatch,
                                                                               tmp_path):
    """A model whose GEMMs are all GGUF blocks (no float32 GEMM left) is too small to time only
    if its blocks are: a large one gets a timed plan, cached, so that its later choices (int4,
    the decode layer) are timed once, not at every load."""
    from vllm.kernels import cpu_kernel_plan as kp
    _timing_scene(monkeypatch, tmp_path, calls=1, others_cores=0.0)
    monkeypatch.setattr(kp, "STREAM_BYTES", 1 << 20)
    small = kp.plan_model({}, 4, 2, 16, layers=2, weight_types=("Q4_0",), block_bytes=1 << 19)
    assert small.source == "small" and not small.cache_path
    large = kp.plan_model({}, 4, 2, 16, layers=2, weight_types=("Q4_0",), block_bytes=1 << 20)
    assert large.source == "timed" and large.cache_path
    kp.remember(large)
    again = kp.plan_model({}, 4, 2, 16, layers=2, weight_types=("Q4_0",), block_bytes=1 << 20)
    assert again.source == "cache" and again.cache_path == large.cache_path


@cpu_built
def test_timed_plan_is_cached_and_reused(monkeypatch, tmp_path):
    """Timing outcomes are not checked (they depend on the host), only the decision's shape,
    its JSON form, and that a second load reads the cache instead of timing."""
    import json
    from vllm.kernels import cpu_kernel_plan as kp
    _timing_scene(monkeypatch, tmp_path, calls=1, others_cores=0.0)
    shapes = {(32, 48): 2, (48, 32): 2}
    plan = kp.plan_model(shapes, 4, 2, 16, layers=2)
    assert plan.source == "timed"
    kp.choose_decode_layer(plan, lambda m, fused, prefetch: [lambda: None])
    d = kp.decisions()
    assert json.loads(json.dumps(d)) == d
    assert set(d["gemm"]) == {"32x48", "48x32"} and len(d["bands"]) == len(kp.BANDS)
    assert all(len(p) == len(kp.BANDS) and set(p) <= set(kp.GEMM_PATHS) for p in d["gemm"].values())
    assert set(d["attention"]) <= {"c", "torch"} and d["decode_layer"][-1] is False
    assert len(d["timings_ms"]["decode_layer"]["fused"]) == len(kp.BANDS) - 1
    assert os.path.exists(d["cache_path"]) and d["cache_path"].startswith(str(tmp_path))

    monkeypatch.setattr(kp, "_time_gemm", None)          # a second load must not time
    again = kp.plan_model(shapes, 4, 2, 16, layers=2)
    assert again.source == "cache" and again.gemm == plan.gemm
    assert again.decode_layer == plan.decode_layer and again.attention == plan.attention
    # torch's kernels held to another instruction set: the cached plan's timings do not hold
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2" if os.environ.get(
        "MKL_ENABLE_INSTRUCTIONS") != "AVX2" else "SSE4_2")
    assert str(kp._cache_path(shapes, (4, 2, 16, 2))) != d["cache_path"]


def test_plan_key_of_a_gguf_model_follows_the_quant_kernels(monkeypatch, tmp_path):
    """A model with GGUF blocks times its crossover and int4 choices on the quant kernels: a
    change to quant_kernels.c must time them again, and it leaves float32 models' plans be."""
    from vllm.kernels import cpu_kernel_plan as kp, quant_kernels
    if quant_kernels.SOURCE is None:
        pytest.skip("no quant kernel source")
    shapes, attention = {(32, 48): 2}, (4, 2, 16, 2)
    before = (kp._cache_path(shapes, attention), kp._cache_path(shapes, attention, ("Q4_1",)))
    edited = tmp_path / "quant_kernels.c"
    edited.write_bytes(quant_kernels.SOURCE.read_bytes() + b"\n/* edited */\n")
    monkeypatch.setattr(quant_kernels, "SOURCE", edited)
    assert kp._cache_path(shapes, attention) == before[0]
    assert kp._cache_path(shapes, attention, ("Q4_1",)) != before[1]


class _FakeClock:
    """The plan module's clock, advanced only by the layer calls a test makes: timing
    decisions are then exact, whatever else the host runs meanwhile."""

    def __init__(self, monkeypatch, kp):
        import time
        self.now = 0.0
        monkeypatch.setattr(kp, "time", types.SimpleNamespace(
            perf_counter=lambda: self.now, monotonic=time.monotonic, sleep=time.sleep))

    def call(self, ms: float):
        def run():
            self.now += ms / 1000
        return run


@cpu_built
def test_plan_keeps_the_faster_prefetch_setting_per_band(monkeypatch, tmp_path):
    """One row streams faster without the next-panel prefetch, more rows with it (as on the
    AMD EPYC Zen 4 host): the plan turns it off in band 0 only, and both the fused layer and
    the C GEMMs of that band follow it."""
    from vllm.kernels import cpu_kernel_plan as kp
    _timing_scene(monkeypatch, tmp_path, calls=2, others_cores=0.0)
    plan = kp.plan_model({(32, 48): 2}, 4, 2, 16, layers=2)
    clock = _FakeClock(monkeypatch, kp)

    def step(m, fused, prefetch):
        fast = fused and prefetch == (m > 1)
        return [clock.call(1 if fast else 4)]
    kp.choose_decode_layer(plan, step)
    assert plan.prefetch == [False] + [True] * (len(kp.BANDS) - 1)
    assert plan.decode_layer == [True] * (len(kp.BANDS) - 1) + [False]
    assert not plan.prefetch_next(1) and plan.prefetch_next(4) and plan.prefetch_next(300)
    assert "prefetch 0 1 1" in kp.summary(plan.as_dict())
    again = kp.plan_model({(32, 48): 2}, 4, 2, 16, layers=2)     # the cached plan keeps it
    assert again.source == "cache" and again.prefetch == plan.prefetch


@cpu_built
def test_prefetch_choice_follows_the_median_round_not_one_lucky_call(monkeypatch, tmp_path):
    """Without prefetch the layer is faster in every round but one, where the prefetching one
    has a lucky call at half its time: the minima would keep the prefetch, the median per-round
    ratio does not."""
    from vllm.kernels import cpu_kernel_plan as kp
    _timing_scene(monkeypatch, tmp_path, calls=5, others_cores=0.0)
    plan = kp.plan_model({(32, 48): 2}, 4, 2, 16, layers=2)
    clock = _FakeClock(monkeypatch, kp)
    calls = {"on": 0}

    def prefetching():
        calls["on"] += 1
        clock.call(1.0 if calls["on"] % 6 == 3 else 2.0)()     # one lucky call per band

    def step(m, fused, prefetch):
        if not fused:
            return [clock.call(4.0)]
        return [prefetching] if prefetch else [clock.call(1.6)]
    kp.choose_decode_layer(plan, step)
    fused_ms = plan.timings_ms["decode_layer"]
    assert fused_ms["fused"][0] < fused_ms["fused_no_prefetch"][0]      # the minima disagree
    assert plan.prefetch == [False] * (len(kp.BANDS) - 1) + [True]
    assert plan.decode_layer == [True] * (len(kp.BANDS) - 1) + [False]


@cpu_built
def test_prefetch_must_win_by_the_margin(monkeypatch, tmp_path):
    """Rounds where the prefetching layer is 3% faster (within what one layer's calls can tell)
    turn it off; 10% faster keeps it."""
    from vllm.kernels import cpu_kernel_plan as kp
    _timing_scene(monkeypatch, tmp_path, calls=4, others_cores=0.0)
    plan = kp.plan_model({(32, 48): 2}, 4, 2, 16, layers=2)
    speedup = iter([0.97, 0.90] + [0.5] * (len(kp.BANDS) - 3))

    def rounds(candidates, n):
        assert n == kp.LAYER_CALLS
        s = next(speedup)
        return {"fused": [s * t for t in (1.0, 1.1, 0.9, 1.0)], "fused_no_prefetch":
                [1.0, 1.1, 0.9, 1.0], "per_op": [2.0] * 4}
    monkeypatch.setattr(kp, "_rounds", rounds)
    kp.choose_decode_layer(plan, lambda m, fused, prefetch: [lambda: None])
    assert plan.prefetch == [False] + [True] * (len(kp.BANDS) - 1)
    assert plan.decode_layer == [True] * (len(kp.BANDS) - 1) + [False]


@cpu_built
def test_decode_layer_candidates_take_turns_over_the_layers(monkeypatch, tmp_path):
    """The fused layer's candidates time on the same layers: as they take turns, the t-th timed
    call of a band reads layer t mod n, never the one the call before it just read (from L3,
    which flattered whichever candidate came second)."""
    from vllm.kernels import cpu_kernel_plan as kp
    _timing_scene(monkeypatch, tmp_path, calls=4, others_cores=0.0)
    plan = kp.plan_model({(32, 48): 2}, 4, 2, 16, layers=2)
    read = []

    def step(m, fused, prefetch):
        return [lambda i=i: read.append(i) for i in range(5)]
    kp.choose_decode_layer(plan, step)
    per_band = 3 * (kp.LAYER_CALLS + 1)                 # 3 candidates, a warm-up call each
    assert len(read) == per_band * (len(kp.BANDS) - 1)
    for b in range(0, len(read), per_band):
        assert read[b:b + per_band] == [t % 5 for t in range(per_band)]


@cpu_built
def test_busy_host_gives_the_c_plan_uncached(monkeypatch, tmp_path):
    from vllm.kernels import cpu_kernel_plan as kp
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("VLLM_CPU_GEMM", raising=False)
    monkeypatch.setattr(kp, "STREAM_BYTES", 1)
    monkeypatch.setattr(kp, "pool_bytes", lambda: 1)
    monkeypatch.setattr(kp, "BUSY_RETRIES", 1)
    monkeypatch.setattr(kp, "_region_seconds", lambda: 1.0)     # every region waits a tick
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    plan = kp.plan_model({(32, 48): 2}, 4, 2, 16, layers=2)
    assert plan.source == "busy" and plan.gemm["32x48"] == ["c"] * len(kp.BANDS)
    kp.choose_decode_layer(plan, lambda m, fused, prefetch: [lambda: None])
    assert not list(tmp_path.rglob("plan-*.json"))


@cpu_built
def test_plan_timed_beside_other_processes_is_not_cached(monkeypatch, tmp_path):
    """Kernels timed while another process ran (the test run beside a compiler, say) must not
    fix a wrong plan for every later load."""
    from vllm.kernels import cpu_kernel_plan as kp
    _timing_scene(monkeypatch, tmp_path, calls=1, others_cores=1.0)
    plan = kp.plan_model({(32, 48): 2}, 4, 2, 16, layers=2)
    kp.choose_decode_layer(plan, lambda m, fused, prefetch: [lambda: None])
    assert plan.source == "contended" and plan.others_cores == 1.0
    assert not list(tmp_path.rglob("plan-*.json"))


def test_attention_timing_times_each_path(monkeypatch):
    """Each candidate's calls run its own path (they once all ran the last one named)."""
    from vllm.kernels import cpu_kernel_plan as kp
    from vllm.attention import backend
    ran = []
    monkeypatch.setattr(kp, "pool_bytes", lambda: 1)
    monkeypatch.setattr(kp, "_wait_until_quiet", lambda: None)
    monkeypatch.setattr(kp, "TIMED_ROWS", (1, 2))
    monkeypatch.setattr(backend, "_decode", lambda q, kv, meta, scale, path: ran.append(path))
    times = kp._time_attention(4, 2, 16, context=32)
    assert set(times) == {"c", "torch"} and all(len(t) == 2 for t in times.values())
    assert ran.count("c") == ran.count("torch") == 2 * (kp.CALLS + 1)


def test_others_cpu_counts_another_process():
    import subprocess
    from vllm.kernels.cpu_kernel_plan import OthersCpu
    meter = OthersCpu()
    if meter.start is None:
        pytest.skip("no /proc/stat")
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\n"
                             "while time.time() - t < 1.5: pass"])
    busy.wait()
    assert meter.cores() > 0.4          # ~1 core for 1.5 s (whatever else the host runs)


@cpu_built
def test_small_models_take_the_c_path_untimed(monkeypatch):
    from vllm.kernels import cpu_kernel_plan as kp
    monkeypatch.delenv("VLLM_CPU_GEMM", raising=False)
    monkeypatch.setattr(kp, "_time_gemm", None)
    plan = kp.plan_model({(64, 64): 2}, 4, 2, 16, layers=2)
    assert plan.source == "small" and set(plan.gemm["64x64"]) == {"c"}
    with pytest.raises(ValueError, match="VLLM_CPU_GEMM"):
        _forced_plan(monkeypatch, "blas", {(64, 64): 2})


@cpu_built
@pytest.mark.parametrize("gemm", ["c", "torch"])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_decode_layer_matches_the_torch_path(isa, monkeypatch, gemm, qk_norm):
    """The fused C layer (VLLM_CPU_GEMM=c) or the per-op path on x @ Wt, against the layer's
    pure torch path (C kernels off, as VLLM_KERNEL_BACKEND=torch); with Qwen3's q/k norm too."""
    from vllm.model_executor.models.llama import DecoderLayer, Rotary
    cfg, w, x, positions, kv, meta = _layer_scene(qk_norm=qk_norm)
    rotary = Rotary(16, 128, 10000.0, {"rope_type": "default"}, torch.float32)
    cos, sin = rotary.cos[positions], rotary.sin[positions]
    with ops.forced_backend("torch"):
        ref_kv = kv.clone()
        ref = DecoderLayer(cfg, w, "l", None)(x, cos, sin, rotary, ref_kv, meta)
    plan = _forced_plan(monkeypatch, gemm, {(64, 128): 1, (64, 64): 1, (64, 192): 1, (96, 64): 1})
    layer = DecoderLayer(cfg, w, "l", plan)
    if gemm == "c":
        assert layer.fused is not None and plan.use_decode_layer(x.shape[0])
        scratch = cpu_kernels.decode_scratch(layer.fused, x.shape[0], meta.decode_views)
        out = cpu_kernels.decode_layer(layer.fused, x.clone(), cos, sin, meta.slot_mapping, kv,
                                       meta.decode_views, meta.decode_lens, None, scratch)
    else:
        assert layer.fused is None and not plan.use_decode_layer(x.shape[0])
        out = layer(x, cos, sin, rotary, kv, meta)
    assert rel_err(out, ref) < 1e-5 and rel_err(kv, ref_kv) < 1e-6



@cpu_built
def test_gemma_decode_layer_matches_the_torch_path(isa, monkeypatch):
    """Gemma 3's layer in the C decode layer (its q/k norms, the sandwich norms around
    attention and the MLP, GeGLU), against the layer's pure torch path."""
    from vllm.model_executor.models.gemma3 import Gemma3DecoderLayer
    from vllm.model_executor.models.llama import Rotary
    cfg, w, x, positions, kv, meta = _layer_scene(qk_norm=True)
    cfg.hidden_activation = "gelu_pytorch_tanh"
    g = torch.Generator().manual_seed(7)
    w.update({f"l.{n}.weight": 1 + 0.2 * torch.randn(64, generator=g)
              for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")})
    rotary = Rotary(16, 128, 10000.0, {"rope_type": "default"}, torch.float32)
    cos, sin = rotary.cos[positions], rotary.sin[positions]
    with ops.forced_backend("torch"):
        ref_kv = kv.clone()
        ref = Gemma3DecoderLayer(cfg, w, "l", None)(x, cos, sin, rotary, ref_kv, meta)
    plan = _forced_plan(monkeypatch, "c", {(64, 128): 1, (64, 64): 1, (64, 192): 1, (96, 64): 1})
    layer = Gemma3DecoderLayer(cfg, w, "l", plan)
    assert layer.fused is not None and layer.fused.gelu == 1 and layer.fused.post_ffn
    scratch = cpu_kernels.decode_scratch(layer.fused, x.shape[0], meta.decode_views)
    out = cpu_kernels.decode_layer(layer.fused, x.clone(), cos, sin, meta.slot_mapping, kv,
                                   meta.decode_views, meta.decode_lens, None, scratch)
    assert rel_err(out, ref) < 1e-5 and rel_err(kv, ref_kv) < 1e-6
    per_op = layer(x, cos, sin, rotary, kv.clone(), meta)          # the C kernels op by op
    assert rel_err(per_op, ref) < 1e-5


@cpu_built
@pytest.mark.parametrize("prefetch", [True, False])
def test_decode_layers_is_one_call_per_layer_in_order(isa, monkeypatch, prefetch):
    """The stacked call equals decode_layer applied layer by layer, each on its own cache; the
    next-panel prefetch (on for the reference) changes no bit of it."""
    from vllm.model_executor.models.llama import DecoderLayer, Rotary
    cfg, w, x, positions, kv, meta = _layer_scene()
    rotary = Rotary(16, 128, 10000.0, {"rope_type": "default"}, torch.float32)
    cos, sin = rotary.cos[positions], rotary.sin[positions]
    plan = _forced_plan(monkeypatch, "c", {(64, 128): 1, (64, 64): 1, (64, 192): 1, (96, 64): 1})
    layer = DecoderLayer(cfg, w, "l", plan)
    scratch = cpu_kernels.decode_scratch(layer.fused, x.shape[0], meta.decode_views)
    ref, ref_kv = x.clone(), torch.stack([kv.clone(), kv.clone() * 0.5])
    for i in range(2):
        cpu_kernels.decode_layer(layer.fused, ref, cos, sin, meta.slot_mapping, ref_kv[i],
                                 meta.decode_views, meta.decode_lens, None, scratch)
    out, kvs = x.clone(), torch.stack([kv.clone(), kv.clone() * 0.5])
    cpu_kernels.decode_layers(cpu_kernels.layer_stack([layer.fused] * 2), out, cos, sin,
                              meta.slot_mapping, kvs, meta.decode_views, meta.decode_lens, None,
                              scratch, prefetch)
    assert torch.equal(out, ref) and torch.equal(kvs, ref_kv)


def test_write_kv_skips_padding_slots():
    """slot -1 is padding (fixed-size batches): nothing is written, the pool's last slot kept."""
    from vllm.attention.backend import write_kv
    cache = torch.zeros(6, 2, 1, 4)
    k, v = torch.ones(3, 1, 4), 2 * torch.ones(3, 1, 4)
    write_kv(cache, torch.tensor([2, -1, 0]), k, v)
    assert cache[2, 0].eq(1).all() and cache[0, 1].eq(2).all()
    assert cache[5].eq(0).all() and cache[[1, 3, 4]].eq(0).all()
