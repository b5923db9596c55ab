"""The GGUF block-quantized GEMM (csrc/cpu/quant_kernels.c, vllm/kernels/quant_kernels.py) against a
float64 reference of the same block math, on every instruction-set variant this CPU runs."""
import numpy as np
import pytest
import torch

from vllm.kernels import cpu_kernels, quant_kernels
from vllm.kernels.quant_kernels import (BLOCK, BLOCK_BYTES, BLOCK_ELEMS, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1,
                                Q6_K, Q8_0)

gguf = pytest.importorskip("gguf")
from gguf_kquants import random_blocks  # noqa: E402
quant_built = pytest.mark.skipif(not quant_kernels.available(), reason="no C compiler")


def quantize_weight(w: np.ndarray, qtype: int) -> np.ndarray:
    """w [N, K] float32 -> GGML blocks uint8 [N, K / 32 * block bytes]."""
    return gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType(qtype))


def block_fields(blocks: np.ndarray, qtype: int, k: int):
    """(d float64 [N, nb], m float64 [N, nb] (zeros but Q4_1), q int64 [N, nb, 32]) exactly as
    the GGUF blocks hold them (q: Q8_0 signed, Q4 nibbles 0..15)."""
    n = blocks.shape[0]
    nb = k // BLOCK
    b = blocks.reshape(n, nb, BLOCK_BYTES[qtype])
    d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    m = np.zeros_like(d)
    if qtype == Q8_0:
        return d, m, b[..., 2:].copy().view(np.int8).astype(np.int64)
    if qtype == Q4_1:
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    qs = b[..., 4:] if qtype == Q4_1 else b[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int64)
    return d, m, q


def reference(x: np.ndarray, blocks: np.ndarray, qtype: int):
    """(y float64 [M, N], the sum of |block terms| [M, N]): W dequantized exactly, x quantized
    exactly as the kernel does, the block products summed in float64."""
    m_rows, k = x.shape
    dw, mw, qw = block_fields(blocks, qtype, k)
    qx, ex, dx, ed, sx = quant_kernels.quantize_activations(x)
    qx = qx.reshape(m_rows, k // BLOCK, BLOCK).astype(np.int64)
    ex = ex.reshape(m_rows, k // BLOCK, BLOCK).astype(np.int64)
    isum = np.einsum("mbi,nbi->mnb", qx, qw).astype(np.float64)
    esum = np.einsum("mbi,nbi->mnb", ex, qw).astype(np.float64)
    terms = dw[None] * (dx.astype(np.float64)[:, None] * isum +
                        ed.astype(np.float64)[:, None] * esum)
    if qtype == Q4_0:
        terms = terms - 8.0 * dw[None] * sx.astype(np.float64)[:, None]
    elif qtype == Q4_1:
        terms = terms + mw[None] * sx.astype(np.float64)[:, None]
    return terms.sum(-1), np.abs(terms).sum(-1)


@pytest.fixture(params=cpu_kernels.ISAS)
def isa(request):
    if request.param not in cpu_kernels.runnable_isas():
        pytest.skip(f"this CPU cannot run {request.param}")
    if quant_kernels.library(request.param) is None:
        pytest.skip("no C compiler")
    return request.param


def test_activation_quantization_matches_the_kernel(isa):
    """Every build (the x86 ones quantize 8 lanes at a time) gives numpy's bits."""
    lib = quant_kernels.library(isa)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 96)).astype(np.float32) * 3
    x[1, :32] = 0                           # an all-zero block: scale 0
    x[2, 40] = 1e4                          # one outlier
    q, e = np.empty((5, 96), np.int8), np.empty((5, 96), np.int8)
    d, ed, s = (np.empty((5, 3), np.float32) for _ in range(3))
    lib.vq_quantize_rows(x.ctypes.data, 5, 96, q.ctypes.data, e.ctypes.data, d.ctypes.data,
                         ed.ctypes.data, s.ctypes.data)
    for got, want in zip((q, e, d, ed, s), quant_kernels.quantize_activations(x)):
        assert np.array_equal(got, want)
    # two digits: x within half a step of the second one
    assert (np.abs(d.repeat(32, 1) * q + ed.repeat(32, 1) * e - x) <=
            ed.repeat(32, 1) * 0.5 * (1 + 1e-5)).all()




@quant_built
@pytest.mark.parametrize("qtype", [Q8_0, Q4_0, Q4_1])
@pytest.mark.parametrize("k", [32, 576, 1536])
def test_quant_gemm_matches_float64_block_math(isa, qtype, k):
    assert quant_kernels.library(isa).vq_isa().decode() == isa
    rng = np.random.default_rng(k + qtype)
    n = 37                                  # not a multiple of 16 (nor of the 8-column chunks)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    w[3] += 0.3                             # rows with an offset: Q4_1's min term matters
    blocks = quantize_weight(w, qtype)
    tblocks = torch.from_numpy(blocks)
    for m in (1, 3, 17, 33, 70):            # 4+ rows: tiles; 70: two passes of 64 rows
        x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1))).astype(np.float32)
        x[0, :BLOCK] = 0.0                  # a zero block
        bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
        residual = torch.from_numpy(rng.standard_normal((m, n)).astype(np.float32))
        y = quant_kernels.gemm(torch.from_numpy(x), tblocks, qtype, n, k, isa=isa).double()
        ref, scale = reference(x, blocks, qtype)
        err = (y.numpy() - ref).__abs__()
        assert (err <= 1e-5 * scale + 1e-6).all(), (isa, m, float(err.max()))
        y2 = quant_kernels.gemm(torch.from_numpy(x), tblocks, qtype, n, k, bias, residual,
                                isa=isa)
        expect = torch.from_numpy(ref) + bias.double() + residual.double()
        assert torch.allclose(y2.double(), expect, rtol=1e-5, atol=1e-4 + 1e-5 * scale.max())


@quant_built
@pytest.mark.parametrize("qtype", [Q8_0, Q4_0, Q4_1])
def test_quant_gemm_is_close_to_the_float_matmul(qtype):
    """The whole approximation (weight and activation quantization) stays small."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 576)).astype(np.float32) * 0.05
    x = rng.standard_normal((4, 576)).astype(np.float32)
    blocks = quantize_weight(w, qtype)
    y = quant_kernels.gemm(torch.from_numpy(x), torch.from_numpy(blocks), qtype, 64, 576)
    ref = torch.from_numpy(x @ w.T)
    rel = float((y - ref).norm() / ref.norm())
    assert rel < {Q8_0: 0.02, Q4_0: 0.15, Q4_1: 0.15}[qtype]
    # the activations' two digits make it the matmul of the dequantized weights, nearly
    deq = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype))
    exact = torch.from_numpy(x.astype(np.float64) @ deq.astype(np.float64).T)
    assert float((y.double() - exact).norm() / exact.norm()) < 1e-4


# ---- Q5_0 / Q5_1 and the K-quants (Q4_K, Q6_K): random block bytes, gguf's dequantizer ------

def dequantize(blocks: np.ndarray, qtype: int, k: int) -> np.ndarray:
    """W [n, k] float64 by gguf's own numpy dequantizer (independent of ours)."""
    deq = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype))
    return deq.reshape(blocks.shape[0], k).astype(np.float64)


def zero_quants(blocks: np.ndarray, qtype: int) -> np.ndarray:
    """The blocks with every quant zeroed, keeping scales and mins (w = the offset / min)."""
    b = blocks.reshape(blocks.shape[0], -1, BLOCK_BYTES[qtype]).copy()
    start = {Q5_0: 2, Q5_1: 4, Q4_K: 16, Q6_K: 0}[qtype]
    stop = {Q6_K: 192}.get(qtype, BLOCK_BYTES[qtype])
    b[..., start:stop] = 0
    return b.reshape(blocks.shape)


def reference_k(x: np.ndarray, blocks: np.ndarray, qtype: int):
    """(y float64 [M, N], the sum of |terms| the kernel adds [M, N]): gguf's dequantized W times x
    as the two-digit activation quantization sees it (d * q + ed * e per block). The kernel's
    terms are the quant part and the offset / min part (Q6_K: signed quants, no offset)."""
    m_rows, k = x.shape
    qx, ex, dx, ed, _ = quant_kernels.quantize_activations(x)
    seen = (dx.astype(np.float64).repeat(BLOCK, 1) * qx +
            ed.astype(np.float64).repeat(BLOCK, 1) * ex)
    w = dequantize(blocks, qtype, k)
    if qtype == Q6_K:
        magnitude = np.abs(w)
    else:
        w0 = dequantize(zero_quants(blocks, qtype), qtype, k)
        magnitude = np.abs(w - w0) + np.abs(w0)
    return seen @ w.T, np.abs(seen) @ magnitude.T


KTYPES = [Q5_0, Q5_1, Q4_K, Q6_K]


def test_zero_quants_leaves_the_offset():
    """The test's split of W into its quant and offset parts, checked on one known block."""
    blk = np.zeros((1, BLOCK_BYTES[Q5_0]), np.uint8)
    blk[0, :2] = np.array([0.5], np.float16).view(np.uint8)
    blk[0, 2:6] = [1, 0, 0, 0]               # element 0's fifth bit
    blk[0, 6] = 0x23                         # element 0: low nibble 3, element 16: 2
    w = dequantize(blk, Q5_0, 32)[0]
    assert (w[0], w[16], w[1]) == (0.5 * (19 - 16), 0.5 * (2 - 16), -8.0)
    assert (dequantize(zero_quants(blk, Q5_0), Q5_0, 32) == -8.0).all()


@quant_built
@pytest.mark.parametrize("qtype", KTYPES)
def test_new_types_match_float64_block_math(isa, qtype):
    rng = np.random.default_rng(qtype)
    n = 37                                  # not a multiple of the 8-column chunks
    lib = quant_kernels.library(isa)
    for k in ((256, 512, 768) if BLOCK_ELEMS[qtype] == 256 else (32, 96, 576)):
        blocks = random_blocks(rng, n, k, qtype)
        assert blocks.shape[1] == quant_kernels.row_bytes(qtype, k)
        assert lib.vq_block_bytes(qtype) == BLOCK_BYTES[qtype]
        tblocks = torch.from_numpy(blocks)
        for m in (1, 2, 3, 4, 5):
            x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1))).astype(np.float32)
            x[0, :BLOCK] = 0.0              # a zero activation block
            y = quant_kernels.gemm(torch.from_numpy(x), tblocks, qtype, n, k, isa=isa).double()
            ref, scale = reference_k(x, blocks, qtype)
            err = np.abs(y.numpy() - ref)
            assert (err <= 1e-5 * scale + 1e-6).all(), (isa, k, m, float((err / scale).max()))
            # and close to the float product with the unquantized activations
            exact = x.astype(np.float64) @ dequantize(blocks, qtype, k).T
            assert np.linalg.norm(y.numpy() - exact) <= 1e-4 * np.linalg.norm(exact)


@quant_built
def test_q5_from_float_weights_is_close_to_the_matmul():
    """Q5_0 / Q5_1 as gguf quantizes real weights: the whole approximation stays small."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 576)).astype(np.float32) * 0.05
    w[5] += 0.2
    x = rng.standard_normal((3, 576)).astype(np.float32)
    for qtype in (Q5_0, Q5_1):
        blocks = quantize_weight(w, qtype)
        y = quant_kernels.gemm(torch.from_numpy(x), torch.from_numpy(blocks), qtype, 64, 576)
        ref = x @ w.T
        assert float(np.linalg.norm(y.numpy() - ref) / np.linalg.norm(ref)) < 0.08


@quant_built
def test_gemm_parts_puts_each_weight_in_its_columns(isa):
    """Mixed types in one call (a Q4_K_M fused Q/K/V: Q4_K, Q4_K, Q6_K), with bias and
    residual: exactly the single-weight GEMMs side by side."""
    rng = np.random.default_rng(7)
    k, m = 512, 5
    parts = [(torch.from_numpy(random_blocks(rng, n, k, t)), t)
             for n, t in ((24, Q4_K), (8, Q4_K), (13, Q6_K), (9, Q5_0))]
    parts.append((torch.from_numpy(quantize_weight(rng.standard_normal((3, k)), Q8_0)), Q8_0))
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    n = sum(b.shape[0] for b, _ in parts)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    residual = torch.from_numpy(rng.standard_normal((m, n)).astype(np.float32))
    y = quant_kernels.gemm_parts(x, quant_kernels.Parts(parts, k), bias, residual, isa=isa)
    each = torch.cat([quant_kernels.gemm(x, b, t, b.shape[0], k, isa=isa) for b, t in parts], 1)
    assert torch.equal(y, each + bias + residual)
    assert torch.equal(quant_kernels.gemm_parts(x, quant_kernels.Parts(parts[:1], k), isa=isa),
                       quant_kernels.gemm(x, parts[0][0], Q4_K, 24, k, isa=isa))


@quant_built
def test_gemm_rejects_bad_shapes_in_c():
    lib = quant_kernels.library(quant_kernels.active_isa())
    x = np.zeros((1, 288), np.float32)
    y = np.zeros((1, 4), np.float32)
    w = np.zeros(4 * BLOCK_BYTES[Q4_K] * 2, np.uint8)
    # 288 is a multiple of 32 but not of Q4_K's 256
    assert lib.vq_gemm(Q4_K, w.ctypes.data, 4, 288, x.ctypes.data, 1, None, None,
                       y.ctypes.data) == -1
    assert lib.vq_gemm(Q5_0, w.ctypes.data, 4, 288, x.ctypes.data, 1, None, None,
                       y.ctypes.data) == 0
    assert lib.vq_gemm(13, w.ctypes.data, 4, 256, x.ctypes.data, 1, None, None,
                       y.ctypes.data) == -1                     # Q5_K: not covered


# ---- Q4_0 / Q4_1 / Q8_0 repacked (16 columns interleaved; the x86 builds) --------------------

@quant_built
@pytest.mark.parametrize("qtype", [Q8_0, Q4_0, Q4_1])
def test_repacked_gemm_matches_float64_block_math(isa, qtype):
    """Q8_0, Q4_0 and Q4_1 repacked (column pairs; the avx2 build's 4-bit types as column
    quads, multiplied as bytes at one row): the float64 block math at every row count, and each
    row's output bit for bit the same whatever the number of rows beside it."""
    if not quant_kernels.packs(qtype, isa):
        pytest.skip(f"the {isa} build multiplies GGUF blocks only")
    rng = np.random.default_rng(qtype)
    n = 37                                  # three column groups, the last one 5 wide
    for k in (32, 576):
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        w[3] += 0.3
        blocks = quantize_weight(w, qtype)
        packed = quant_kernels.repack(torch.from_numpy(blocks), qtype, isa=isa)
        assert packed.shape == (48, blocks.shape[1])
        x_all = (rng.standard_normal((70, k)) * rng.uniform(0.1, 10, (70, 1))).astype(np.float32)
        x_all[0, :BLOCK] = 0.0
        y_all = quant_kernels.gemm(torch.from_numpy(x_all), packed,
                                   qtype | quant_kernels.PACKED, n, k, isa=isa)
        for m in (1, 2, 3, 5, 8, 9, 70):   # records multiplied per row (< 8) or as tiles
            x = x_all[:m]
            y = quant_kernels.gemm(torch.from_numpy(x), packed, qtype | quant_kernels.PACKED,
                                   n, k, isa=isa)
            assert torch.equal(y, y_all[:m]), (isa, k, m)   # each row's bits at any row count
            y = y.double()
            ref, scale = reference(x, blocks, qtype)
            err = np.abs(y.numpy() - ref)
            assert (err <= 1e-5 * scale + 1e-6).all(), (isa, k, m, float((err / scale).max()))


@quant_built
@pytest.mark.parametrize("qtype, record_bytes", [(Q4_K, 24), (Q6_K, 28), (Q5_0, 34)])
def test_repacked_avx2_types_are_lossless(isa, qtype, record_bytes):
    """Q4_K, Q6_K and Q5_0 repacked (the avx2 build: Q4_K as nibbles with float32 scales and
    mins per 32-element sub-block; Q6_K as column quads of its unsigned values, nibbles and a
    plane of their top two bits, with fp16 d and int8 scales; Q5_0 as Q8_0 records of
    q5 - 16): the float64 block math of gguf's own dequantization at every row count; each row
    bit for bit the same at 1 row (Q6_K: u8 x s8 products), 2-7 (records decoded per row
    group or to a tile per record) and 8+ (tiles); the K-quants also bit for bit the unrepacked
    blocks' product wherever those run as tiles (4+ rows), whose math their records share
    (Q5_0's records drop its offset term, so only the sums agree)."""
    if not quant_kernels.packs(qtype, isa):
        pytest.skip(f"the {isa} build multiplies {quant_kernels.TYPE_NAMES[qtype]} as blocks")
    rng = np.random.default_rng(qtype)
    n = 37                                  # three column groups, the last one 5 wide
    for k in (256, 768):
        blocks = random_blocks(rng, n, k, qtype)
        packed = quant_kernels.repack(torch.from_numpy(blocks), qtype, isa=isa)
        assert packed.shape == (48, k // 32 * record_bytes)
        assert packed.shape[1] == quant_kernels.packed_row_bytes(qtype, k, isa)
        x_all = (rng.standard_normal((70, k)) * rng.uniform(0.1, 10, (70, 1))).astype(np.float32)
        x_all[0, :BLOCK] = 0.0
        y_all = quant_kernels.gemm(torch.from_numpy(x_all), packed, qtype | quant_kernels.PACKED,
                                   n, k, isa=isa)
        for m in (1, 2, 3, 4, 5, 8, 9, 70):
            x = x_all[:m]
            tx = torch.from_numpy(x)
            y = quant_kernels.gemm(tx, packed, qtype | quant_kernels.PACKED, n, k, isa=isa)
            assert torch.equal(y, y_all[:m]), (k, m)
            ref, scale = reference_k(x, blocks, qtype)
            err = np.abs(y.double().numpy() - ref)
            assert (err <= 1e-5 * scale + 1e-6).all(), (isa, k, m, float((err / scale).max()))
            if m >= 4 and qtype != Q5_0:
                unpacked = quant_kernels.gemm(tx, torch.from_numpy(blocks), qtype, n, k, isa=isa)
                assert torch.equal(y, unpacked), (k, m)


@quant_built
@pytest.mark.parametrize("qtype", [Q8_0, Q4_0, Q4_1, Q6_K])
def test_vnni_and_madd_variants_agree_bit_for_bit(isa, qtype):
    """On an AVX-512 VNNI CPU the kernels multiply with vpdpbusd / vpdpwssd; turned off, with
    maddubs / madd. Neither saturates, so the integer sums and every output bit agree."""
    lib = quant_kernels.library(isa)
    if not lib.vq_uses_vnni():
        pytest.skip(f"the {isa} build does not use VNNI on this CPU")
    rng = np.random.default_rng(7)
    n, k = 37, 512
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    blocks = torch.from_numpy(random_blocks(rng, n, k, qtype) if qtype == Q6_K
                              else quantize_weight(w, qtype))
    weight = (quant_kernels.repack(blocks, qtype, isa=isa), qtype | quant_kernels.PACKED) \
        if quant_kernels.packs(qtype, isa) else (blocks, qtype)
    for m in (1, 3, 6, 9):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        with_vnni = quant_kernels.gemm(x, *weight, n, k, isa=isa)
        try:
            assert lib.vq_set_vnni(0) == 0
            without = quant_kernels.gemm(x, *weight, n, k, isa=isa)
        finally:
            assert lib.vq_set_vnni(1) == 1
        assert torch.equal(with_vnni, without), (qtype, m)


@quant_built
def test_gemm_parts_mixes_repacked_and_block_weights(isa):
    """A fused GEMM of a repacked Q4_1 part, a Q6_K part and a repacked Q8_0 part (bias,
    residual): exactly each weight's own GEMM side by side, at one row and at many."""
    if not quant_kernels.packs(Q4_1, isa):
        pytest.skip(f"the {isa} build multiplies GGUF blocks only")
    rng = np.random.default_rng(11)
    k = 512
    q41 = quantize_weight(rng.standard_normal((24, k)).astype(np.float32) * 0.05, Q4_1)
    q80 = quantize_weight(rng.standard_normal((7, k)).astype(np.float32) * 0.05, Q8_0)
    q6k = torch.from_numpy(random_blocks(rng, 13, k, Q6_K))
    packed = [(quant_kernels.repack(torch.from_numpy(b), t, isa=isa), t | quant_kernels.PACKED,
               b.shape[0]) for b, t in ((q41, Q4_1), (q80, Q8_0))]
    parts = quant_kernels.Parts([packed[0], (q6k, Q6_K), packed[1]], k)
    for m in (1, 9):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        bias = torch.from_numpy(rng.standard_normal(44).astype(np.float32))
        residual = torch.from_numpy(rng.standard_normal((m, 44)).astype(np.float32))
        y = quant_kernels.gemm_parts(x, parts, bias, residual, isa=isa)
        each = torch.cat([quant_kernels.gemm(x, *packed[0][:2], 24, k, isa=isa),
                          quant_kernels.gemm(x, q6k, Q6_K, 13, k, isa=isa),
                          quant_kernels.gemm(x, *packed[1][:2], 7, k, isa=isa)], 1)
        assert torch.equal(y, each + bias + residual)


def test_repack_rejects_what_the_build_does_not_repack():
    with pytest.raises(ValueError, match="Q5_1"):
        quant_kernels.repack(torch.zeros(16, BLOCK_BYTES[Q5_1], dtype=torch.uint8), Q5_1)
