"""Batched prefill (one attention call for the step's spans, the CUDA path) against the span by
span path, on CPU: the padded SDPA layout, and the xformers layout with a torch stand-in for
memory_efficient_attention (xformers' kernels do not run on CPU)."""
import types

import numpy as np
import pytest
import torch

from vllm.kernels import ops
from vllm.attention.backend import AttentionMetadata, PrefillSpan, paged_attention
from vllm.worker.model_runner import ModelRunner
from tests.kernel_refs import install_fake_xformers, rel_err

H, KVH, D, SLOTS = 6, 2, 16, 96


def _span(start, n, computed, view_ids, slots):
    """A span as the model runner builds it (explicit mask for continued chunks and holes)."""
    runner = types.SimpleNamespace(device=torch.device("cpu"))
    return ModelRunner._prefill_span(runner, start, n, computed, np.asarray(view_ids),
                                     np.asarray(slots))


def _scene(seed=0):
    """Two decode rows, then: a new prompt (Lq = Lk = 5), a chunk continuing a prompt (Lq 3,
    Lk 10), a new prompt (Lq = Lk = 2), and a chunk whose view has evicted holes (Lq 4)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(SLOTS, 2, KVH, D, generator=g)
    perm = torch.randperm(SLOTS, generator=g).numpy()
    spans, at, used = [], 2, 0
    for n, computed, ids in [(5, 0, range(5)), (3, 7, range(10)), (2, 0, range(2)),
                             (4, 9, [0, 2, 3, 5, 8, 9, 10, 11, 12])]:
        ids = np.array(list(ids))
        spans.append(_span(at, n, computed, ids, perm[used:used + len(ids)]))
        at, used = at + n, used + len(ids)
    decode_views = torch.tensor(perm[used:used + 6].reshape(2, 3))
    meta = AttentionMetadata(slot_mapping=torch.zeros(at, dtype=torch.int64), num_decodes=2,
                             decode_views=decode_views, decode_lens=torch.tensor([3, 3]),
                             prefills=spans)
    return torch.randn(at, H, D, generator=g), kv, meta


def test_scene_covers_the_cases():
    _, _, meta = _scene()
    lens = [(s.q_end - s.q_start, len(s.kv_slots)) for s in meta.prefills]
    assert lens == [(5, 5), (3, 10), (2, 2), (4, 9)]
    assert [s.mask is None for s in meta.prefills] == [True, False, True, False]
    # query id 9 sees the live ids 0, 2, 3, 5, 8, 9 (ids 1, 4, 6, 7 were evicted): the
    # runner's mask for holes is still causal from the bottom right of the view
    assert meta.prefills[3].mask[0].tolist() == [True] * 6 + [False] * 3
    assert torch.equal(meta.prefills[3].mask, torch.ones(4, 9, dtype=torch.bool).tril(5))


def _punch(meta):
    """Masks that are not causal: the continued chunk's queries 0 and 2 skip keys 1 and 4."""
    meta.prefills[1].mask[[0, 2], 1] = False
    meta.prefills[1].mask[:, 4] = False


@pytest.mark.parametrize("seed,punched", [(0, False), (1, False), (2, True)])
def test_batched_matches_span_by_span(seed, punched):
    q, kv, meta = _scene(seed)
    if punched:
        _punch(meta)
    ref = paged_attention(q, kv, meta, 0.3, prefill_path="span")
    with ops.forced_backend("torch"):
        assert [b.backend for b in meta.prefill_batches] == ["torch"]   # one call, all spans
    out = paged_attention(q, kv, meta, 0.3, prefill_path="batched")
    assert rel_err(out, ref) < 1e-5


def test_colsum_spans_join_the_batch():
    """A span that collects column sums attends in the batched call like the others (its
    output is the one it would have without them); its sums come from a pass beside it."""
    q, kv, meta = _scene()
    plain = paged_attention(q, kv, meta, 0.3, prefill_path="batched")
    meta.prefills[1].colsum = torch.zeros(10)
    meta.prefills[1].colsum_from = 1
    ref = paged_attention(q, kv, meta, 0.3, prefill_path="span")
    ref_colsum = meta.prefills[1].colsum.clone()
    meta.prefills[1].colsum.zero_()
    with ops.forced_backend("torch"):
        batches = meta.prefill_batches
    assert len(batches) == 1 and batches[0].shape == (4, 5, 10)   # every span
    out = paged_attention(q, kv, meta, 0.3, prefill_path="batched")
    assert torch.equal(out, plain) and rel_err(out, ref) < 1e-5
    assert torch.allclose(meta.prefills[1].colsum, ref_colsum)


def test_padded_layout_and_no_nan_rows():
    q, kv, meta = _scene()
    batch = ops.prefill_batch([(s.q_start, s.q_end) for s in meta.prefills],
                              [s.kv_slots for s in meta.prefills],
                              [s.mask for s in meta.prefills], "torch")
    assert batch.shape == (4, 5, 10)
    assert batch.q_rows.tolist() == list(range(2, 16))
    # span 2 (2 queries): rows 10, 11, then three padding rows reading the first real row
    assert batch.pad.view(4, 5)[2].tolist() == [10, 11, 2, 2, 2]
    assert batch.unpad.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 15, 16, 17, 18]
    slots = batch.kv_slots.view(4, 10)
    for b, s in enumerate(meta.prefills):
        assert torch.equal(slots[b, :len(s.kv_slots)], s.kv_slots)
    mask = batch.bias[:, 0]
    assert torch.equal(mask[0, :5, :5], torch.ones(5, 5, dtype=torch.bool).tril())
    assert torch.equal(mask[1, :3], meta.prefills[1].mask)
    assert torch.equal(mask[3, :4, :9], meta.prefills[3].mask)
    for b, s in enumerate(meta.prefills):
        assert not mask[b, :, len(s.kv_slots):].any()      # padding keys never seen
    assert mask.any(-1).all()                              # no row without a key: no NaN
    kvg = kv.index_select(0, batch.kv_slots)
    padded = ops._prefill_padded(q, kvg, batch, 0.3)
    assert torch.isfinite(padded).all()
    # the CUDA form (K/V per query head, additive 16-aligned bias), run here on CPU
    expanded = ops._prefill_padded(q, kvg, batch, 0.3, expand_kv=True)
    assert rel_err(expanded, padded) < 1e-5 and torch.isfinite(expanded).all()
    bias = batch.additive[torch.float32]
    assert bias.stride(-2) % 16 == 0 and torch.equal(bias == 0, batch.bias)


def test_cpu_default_is_span_by_span(monkeypatch):
    q, kv, meta = _scene()
    monkeypatch.setattr(ops, "prefill_batch", None)        # building a batch would raise
    paged_attention(q, kv, meta, 0.3)


# ---- xformers layout -----------------------------------------------------------------------------
def _mea(q, k, v, attn_bias=None, scale=None):
    """memory_efficient_attention on the packed 5-d [1, M, G, H, K] layout, in torch."""
    qh, kh, vh = (t[0].permute(1, 2, 0, 3) for t in (q, k, v))        # [G, H, M, K]
    s = qh @ kh.transpose(-1, -2) * scale
    s = s + attn_bias.materialize(s.shape[-2:], dtype=s.dtype, device=s.device)
    return (torch.softmax(s, -1) @ vh).permute(2, 0, 1, 3)[None]


class _FakeBottomRight:
    """Stands in for xformers' BlockDiagonalCausalFromBottomRightMask (records its seqlens)."""
    def __init__(self, q_seqlen, kv_seqlen, device):
        self.q_seqlen, self.kv_seqlen, self.device = q_seqlen, kv_seqlen, device

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen=None, *, device=None):
        return cls(list(q_seqlen), list(kv_seqlen), device)

    def materialize(self, shape, dtype=torch.float32, device="cpu"):
        bias = torch.full(shape, float("-inf"), dtype=dtype)
        qs, ks = np.cumsum([0] + self.q_seqlen), np.cumsum([0] + self.kv_seqlen)
        for q0, q1, k0, k1 in zip(qs, qs[1:], ks, ks[1:]):
            keep = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril((k1 - k0) - (q1 - q0))
            bias[q0:q1, k0:k1].masked_fill_(keep, 0.0)
        return bias


def _fake_xformers(monkeypatch):
    install_fake_xformers(monkeypatch, _mea,
                          BlockDiagonalCausalFromBottomRightMask=_FakeBottomRight)


def test_xformers_takes_plain_spans_padded_sdpa_the_rest(monkeypatch):
    _fake_xformers(monkeypatch)
    q, kv, meta = _scene()
    _punch(meta)
    ref = paged_attention(q, kv, meta, 0.3, prefill_path="span")
    with ops.forced_backend("xformers"):
        xf, padded = meta.prefill_batches
    assert (xf.backend, padded.backend) == ("xformers", "torch")
    assert (xf.bias.q_seqlen, xf.bias.kv_seqlen, xf.bias.device) == ([5, 2], [5, 2],
                                                                      torch.device("cpu"))
    assert xf.q_rows.tolist() == [2, 3, 4, 5, 6, 10, 11]
    assert torch.equal(xf.kv_slots, torch.cat([meta.prefills[0].kv_slots,
                                               meta.prefills[2].kv_slots]))
    assert padded.shape == (2, 4, 10)                       # the masked spans 1 and 3
    out = paged_attention(q, kv, meta, 0.3, prefill_path="batched")
    assert rel_err(out, ref) < 1e-5


def test_xformers_continued_chunk_without_mask(monkeypatch):
    """A mask-None span with Lk > Lq (bottom-right causal) through the packed layout."""
    _fake_xformers(monkeypatch)
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(SLOTS, 2, KVH, D, generator=g)
    spans = [PrefillSpan(0, 3, torch.arange(10, 20), None),
             PrefillSpan(3, 7, torch.arange(4), None)]
    meta = AttentionMetadata(slot_mapping=torch.zeros(7, dtype=torch.int64), num_decodes=0,
                             decode_views=torch.zeros(0, 1, dtype=torch.int64),
                             decode_lens=torch.zeros(0, dtype=torch.int64), prefills=spans)
    q = torch.randn(7, H, D, generator=g)
    ref = paged_attention(q, kv, meta, 0.3, prefill_path="span")
    with ops.forced_backend("xformers"):
        assert [b.backend for b in meta.prefill_batches] == ["xformers"]
    assert rel_err(paged_attention(q, kv, meta, 0.3, prefill_path="batched"), ref) < 1e-5


def test_real_xformers_bias_from_our_seqlens(monkeypatch):
    """Where xformers is installed: its own bias class from our seqlens, materialized on CPU."""
    attn_bias = pytest.importorskip("xformers.ops.fmha.attn_bias")
    xops = pytest.importorskip("xformers.ops")
    monkeypatch.setattr(xops, "memory_efficient_attention", _mea)
    q, kv, meta = _scene()
    with ops.forced_backend("xformers"):
        xf = meta.prefill_batches[0]
    assert isinstance(xf.bias, attn_bias.BlockDiagonalCausalFromBottomRightMask)
    assert xf.bias.q_seqinfo.seqstart_py == [0, 5, 7]
    assert xf.bias.k_seqinfo.seqstart_py == [0, 5, 7]
    ref = paged_attention(q, kv, meta, 0.3, prefill_path="span")
    assert rel_err(paged_attention(q, kv, meta, 0.3, prefill_path="batched"), ref) < 1e-5
