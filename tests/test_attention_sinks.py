"""Learned attention sinks (gpt-oss) in every attention path, against the float64 reference
(kernel_refs.attention_reference / decode_reference with sinks): the C decode kernel of every
ISA build this CPU runs, torch decode, Triton decode in one pass and split-K (interpreter),
span and batched prefill with their column sums, the xformers route; float32, bf16 and fp8 KV
where a path reads them. Each head's sink joins its softmax's denominator, so decode mass and
prefill column sums are the real keys' probabilities: a head's row sums to less than one.
sinks=None leaves each kernel's arithmetic as it was: the C and Triton kernels give the same
bits as with sinks of -inf."""
import os

import pytest
import torch

if not torch.cuda.is_available():   # before any triton kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from vllm.attention import backend as attention  # noqa: E402
from vllm.attention import kv_quant  # noqa: E402
from vllm.attention.backend import AttentionMetadata, PrefillSpan, paged_attention  # noqa: E402
from vllm.kernels import cpu_kernels, ops, triton_decode  # noqa: E402
from tests.kernel_refs import (attention_reference, decode_reference,  # noqa: E402
                               install_fake_xformers, paged_scene, rel_err)

H, KVH, D, SCALE = 4, 2, 16, 0.3          # GQA: two query heads per KV head
LENS = [5, 37, 1, 20, 0]                   # ragged decode rows, one without keys
KV_DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16,
             "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

cpu_built = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need the interpreter; tests/gpu runs on CUDA")


def _sinks(g):
    return torch.randn(H, generator=g) * 2        # N(0, 2): large enough to matter


def _cache(kv, name):
    """kv float32 [S, 2, KVH, D] as a one-layer cache [1, S, 2, KVH, D] of KV_DTYPES[name] (fp8:
    registered, with scales that are not 1) -> (cache, float32 values the kernels read)."""
    dtype = KV_DTYPES[name]
    if not kv_quant.is_fp8_dtype(dtype):
        cache = kv.to(dtype)[None]
        return cache, cache[0].float()
    cache = torch.zeros(1, *kv.shape, dtype=dtype)
    kv_quant.register(cache)
    kv_quant.set_scales(cache, [0.02], [0.03])
    slots = torch.arange(kv.shape[0])
    kv_quant.write(cache[0], slots, kv[:, 0], kv[:, 1])
    return cache, kv_quant.gather(cache[0], slots)


def _decode_scene(name, seed=0):
    kv, slots, lens = paged_scene(LENS, KVH, D, seed=seed, pad=-1)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(LENS), H, D, generator=g)
    cache, values = _cache(kv, name)
    return q, cache, values, slots, lens, _sinks(g)


def _check_decode(run, q, values, slots, lens, sinks):
    """run(mass) -> out, against the reference: output, the mass it adds (a head's share < 1),
    zeros for a row without keys (the sink takes all of it), columns past the views untouched."""
    ref_out, ref_mass = decode_reference(q, values, slots, lens, SCALE, sinks)
    assert rel_err(decode_reference(q, values, slots, lens, SCALE)[0], ref_out) > 0.05
    width = slots.shape[1]
    start = torch.rand(len(lens), width + 3)
    mass = start.clone()
    out = run(mass)
    added = mass[:, :width] - start[:, :width]
    assert rel_err(out, ref_out) < 1e-5 and rel_err(added, ref_mass) < 1e-5
    assert (ref_mass.sum(1) < H).all() and (added.sum(1) < H).all()
    assert torch.equal(out[lens == 0], torch.zeros(int((lens == 0).sum()), H, D))
    assert torch.equal(mass[:, width:], start[:, width:])


# ---- decode -------------------------------------------------------------------------------------
@cpu_built
@pytest.mark.parametrize("name", list(KV_DTYPES))
def test_c_decode_with_sinks(isa, name):
    q, cache, values, slots, lens, sinks = _decode_scene(name)
    _check_decode(lambda mass: ops.decode_attention(q, cache[0], slots, lens, SCALE, mass,
                                                    backend="cpu", sinks=sinks),
                  q, values, slots, lens, sinks)


@pytest.mark.parametrize("name", ["float32", "bf16", "e4m3"])
def test_torch_decode_with_sinks(name):
    q, cache, values, slots, lens, sinks = _decode_scene(name, seed=3)
    _check_decode(lambda mass: ops.decode_attention(q, cache[0], slots, lens, SCALE, mass,
                                                    backend="torch", sinks=sinks),
                  q, values, slots, lens, sinks)


@interpreted
@pytest.mark.parametrize("num_splits", [None, 3])    # None: ops' dispatch, one split here
@pytest.mark.parametrize("name", ["float32", "e4m3"])
def test_triton_decode_with_sinks(num_splits, name):
    """Split-K: 3 splits of one tile over rows of at most 2 tiles leave empty splits; the sink
    joins once, in the reduce."""
    q, cache, values, slots, lens, sinks = _decode_scene(name, seed=5)
    if num_splits is None:
        run = lambda mass: ops.decode_attention(q, cache[0], slots, lens, SCALE, mass,  # noqa
                                                backend="triton", sinks=sinks)
    else:
        run = lambda mass: triton_decode.decode_attention(q, cache[0], slots, lens, SCALE,  # noqa
                                                          mass, num_splits, sinks=sinks)
    _check_decode(run, q, values, slots, lens, sinks)


@cpu_built
def test_c_kernel_without_sinks_is_unchanged(isa):
    """NULL sinks and sinks of -inf run the same arithmetic: the same bits, mass included."""
    q, cache, _, slots, lens, _ = _decode_scene("float32", seed=7)
    runs = []
    for sinks in (None, torch.full((H,), float("-inf"))):
        mass = torch.zeros(slots.shape)
        runs.append((cpu_kernels.decode_attention(q, cache[0], slots, lens, SCALE, mass, sinks),
                     mass))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@interpreted
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_kernels_without_sinks_are_unchanged(num_splits):
    q, cache, _, slots, lens, _ = _decode_scene("float32", seed=9)
    runs = []
    for sinks in (None, torch.full((H,), float("-inf"))):
        mass = torch.zeros(slots.shape)
        runs.append((triton_decode.decode_attention(q, cache[0], slots, lens, SCALE, mass,
                                                    num_splits, sinks=sinks), mass))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


# ---- prefill ------------------------------------------------------------------------------------
def _prefill_scene(name, seed=0):
    """Two decode rows, then three spans: a new prompt (Lq = Lk = 7, plain causal) and a chunk
    whose explicit mask skips keys (Lq 5 of Lk 12), both with column sums from a later query;
    a continued chunk without a mask (Lq 3 of Lk 6, bottom-right causal)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(72, 2, KVH, D, generator=g)
    perm = torch.randperm(72, generator=g)
    mask = torch.ones(5, 12, dtype=torch.bool).tril(7)
    mask[[0, 3], 2] = False
    spans = [PrefillSpan(2, 9, perm[:7], None, colsum=torch.zeros(7), colsum_from=2),
             PrefillSpan(9, 14, perm[7:19], mask, colsum=torch.zeros(12), colsum_from=1),
             PrefillSpan(14, 17, perm[19:25], None)]
    views = perm[25:31].view(2, 3).clone()
    views[1, 2] = -1                               # the engine's views pad with -1
    meta = AttentionMetadata(slot_mapping=torch.zeros(17, dtype=torch.int64), num_decodes=2,
                             decode_views=views, decode_lens=torch.tensor([3, 2]),
                             prefills=spans, decode_mass=torch.zeros(2, 3))
    q = torch.randn(17, H, D, generator=g)
    cache, values = _cache(kv, name)
    return q, cache, values, meta, _sinks(g)


def _check_prefill(out, q, values, meta, sinks):
    """Every span's rows and column sums against the reference (a scored query's row < 1)."""
    for span in meta.prefills:
        lq, lk = span.q_end - span.q_start, len(span.kv_slots)
        kv = values[span.kv_slots]
        mask = span.mask if span.mask is not None else \
            torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        ref, probs = attention_reference(q[span.q_start:span.q_end].transpose(0, 1),
                                         kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1),
                                         mask, SCALE, sinks)
        assert rel_err(out[span.q_start:span.q_end], ref.transpose(0, 1)) < 1e-5
        if span.colsum is not None:
            scored = probs[:, span.colsum_from:]
            assert (scored.sum(-1) < 1).all()
            assert rel_err(span.colsum, scored.sum(dim=(0, 1))) < 1e-5
            assert span.colsum.sum() < H * (lq - span.colsum_from)


@pytest.mark.parametrize("name", ["float32", "bf16", "e4m3"])
@pytest.mark.parametrize("path", ["span", "batched"])
def test_paged_attention_with_sinks(name, path, monkeypatch):
    """Decode rows (torch decode) and prefill spans in one step; tiles small enough that the
    sink prefill and the column sums run several (SINK_QUERY_TILE, QUERY_TILE)."""
    monkeypatch.setattr(ops, "SINK_QUERY_TILE", 3)
    monkeypatch.setattr(attention, "QUERY_TILE", 2)
    q, cache, values, meta, sinks = _prefill_scene(name)
    out = paged_attention(q, cache[0], meta, SCALE, decode_path="torch", prefill_path=path,
                          sinks=sinks)
    _check_prefill(out, q, values, meta, sinks)
    ref_out, ref_mass = decode_reference(q[:2], values, meta.decode_views, meta.decode_lens,
                                         SCALE, sinks)
    assert rel_err(out[:2], ref_out) < 1e-5 and rel_err(meta.decode_mass, ref_mass) < 1e-5


@cpu_built
def test_paged_attention_decodes_on_the_c_kernel_with_sinks(isa):
    q, cache, values, meta, sinks = _prefill_scene("float32", seed=4)
    assert ops.decode_backend(q[:2]) == "cpu"
    out = paged_attention(q, cache[0], meta, SCALE, sinks=sinks)
    ref_out, ref_mass = decode_reference(q[:2], values, meta.decode_views, meta.decode_lens,
                                         SCALE, sinks)
    assert rel_err(out[:2], ref_out) < 1e-5 and rel_err(meta.decode_mass, ref_mass) < 1e-5
    _check_prefill(out, q, values, meta, sinks)


def test_padded_prefill_with_sinks_expanded_as_on_cuda():
    """CUDA's form of the padded batch (K/V repeated per query head) equals the GQA form."""
    q, cache, values, meta, sinks = _prefill_scene("float32", seed=2)
    (batch,) = meta.prefill_batches_torch
    kv = values[batch.kv_slots]
    gqa = ops._prefill_padded(q, kv, batch, SCALE, expand_kv=False, sinks=sinks)
    expanded = ops._prefill_padded(q, kv, batch, SCALE, expand_kv=True, sinks=sinks)
    assert rel_err(expanded, gqa) < 1e-6


def test_xformers_with_sinks_takes_torch_sdpa(monkeypatch):
    """xformers has no sink key: with sinks, span prefill and the batched step go to SDPA."""
    def refuse(*args, **kwargs):
        raise AssertionError("xformers called with sinks")
    install_fake_xformers(monkeypatch, refuse)
    q, cache, values, meta, sinks = _prefill_scene("float32", seed=6)
    with ops.forced_backend("xformers"):
        for path in ("span", "batched"):
            for span in meta.prefills:
                span.colsum = None
            _check_prefill(paged_attention(q, cache[0], meta, SCALE, decode_path="torch",
                                           prefill_path=path, sinks=sinks), q, values, meta,
                           sinks)
    packed = ops.PrefillBatch("xformers", torch.arange(2), torch.arange(2), bias=None)
    with pytest.raises(AssertionError, match="sinks"):
        ops.prefill_attention_batched(q, values[:2], packed, SCALE, sinks)


def test_sink_softmax():
    g = torch.Generator().manual_seed(8)
    scores = torch.randn(2, 3, 5, generator=g)
    scores[0, 1, 3:] = float("-inf")
    sinks = torch.randn(2, 1, 1, generator=g) * 2
    got = ops.sink_softmax(scores, sinks)
    expect = scores.double().exp() / (scores.double().exp().sum(-1, keepdim=True)
                                      + sinks.double().exp())
    assert rel_err(got, expect) < 1e-6 and (got.sum(-1) < 1).all()
    assert torch.equal(ops.sink_softmax(scores, None), torch.softmax(scores, -1))


_SM90 = r"""
import json
from tests.kernel_refs import compile_kernel, decode_kernel_specs, resource_usage
out = {}
for dtype, g in (("bf16", 4), ("fp32", 8)):
    specs = decode_kernel_specs(dtype, 128, g, sinks=True)
    for name in ("decode_stats", "reduce"):
        fn, consts, options = specs[name]
        out[f"{dtype}/{name}"] = resource_usage(compile_kernel(fn, dtype, consts, options, 90))
print("RESULT" + json.dumps(out))
"""


def test_triton_sink_kernels_compile_for_sm90():
    """The kernels that read sinks (one-pass decode, split-K reduce) as the JIT specializes them
    for Hopper, without a GPU (tests/test_triton_sm90.py compiles the sink-free ones): no
    spills, registers for 4 resident CTAs."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root
    run = subprocess.run([sys.executable, "-c", _SM90], env=env, capture_output=True, text=True,
                         cwd=root, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for name, usage in json.loads(run.stdout.split("RESULT", 1)[1]).items():
        assert usage["spill_bytes"] == 0 and usage["regs"] <= 128, (name, usage)
