"""torch's own 4-bit GEMM (_weight_int4pack_mm_for_cpu) as an alternative to the GGUF blocks:
Q4_0 / Q4_1 weights map onto its layout exactly up to its bf16 scales; the load-time plan
(cpu_kernel_plan.choose_int4) runs it in the bands where it is MARGIN faster, per op there."""
import numpy as np
import pytest
import torch

from vllm.kernels import cpu_kernel_plan, quant_kernels
from vllm.model_executor.quant_linear import QuantLinear, QuantWeight, int4_layout
from vllm.kernels.quant_kernels import Q4_0, Q4_1, Q8_0

gguf = pytest.importorskip("gguf")
from test_quant_kernels import block_fields, quantize_weight  # noqa: E402

pytestmark = pytest.mark.skipif(not quant_kernels.available(), reason="no C compiler")


def _weight(qtype: int, n: int, k: int, seed: int) -> QuantWeight:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
    return QuantWeight(torch.from_numpy(quantize_weight(w, qtype)), qtype, (n, k))


def _dequantized(w: QuantWeight) -> np.ndarray:
    d, m, q = block_fields(w.blocks.numpy(), w.qtype, w.shape[1])
    offset = 8 if w.qtype == Q4_0 else 0
    return ((q - offset) * d[..., None] + m[..., None]).reshape(w.shape)


@pytest.mark.parametrize("qtypes", [(Q4_0,), (Q4_1,), (Q4_1, Q4_0)])
def test_int4_gemm_is_the_block_math_to_bf16(qtypes):
    """A fused GEMM of Q4_0 / Q4_1 weights through torch's layout against float64 on the
    blocks' exact values: within bf16 rounding of the activations and scales (relative 2^-7 of
    the sum of |terms|); bias and residual added in float32."""
    ws = [_weight(t, 48, 96, seed=i) for i, t in enumerate(qtypes)]
    bias = torch.randn(48 * len(ws))
    lin = QuantLinear(ws, bias)
    lin.int4 = int4_layout(ws)
    x, res = torch.randn(5, 96), torch.randn(5, 48 * len(ws))
    w = np.concatenate([_dequantized(w) for w in ws])
    want = x.double().numpy() @ w.T + bias.double().numpy() + res.double().numpy()
    scale = np.abs(x.double().numpy()) @ np.abs(w.T) + 1e-3
    got = lin.int4_gemm(x, res).double().numpy()
    assert np.all(np.abs(got - want) <= scale * 2.0 ** -7)


def test_other_types_have_no_int4_layout():
    assert int4_layout([_weight(Q8_0, 32, 64, 0)]) is None
    assert int4_layout([_weight(Q4_1, 32, 64, 0), _weight(Q8_0, 32, 64, 1)]) is None
    assert QuantLinear([_weight(Q8_0, 32, 64, 0)]).int4_source is None


def _plan():
    bands = len(cpu_kernel_plan.BANDS)
    return cpu_kernel_plan.KernelPlan(isa="avx2", cpu="test", threads=1, gemm={},
                                      attention=["c"] * bands, decode_layer=[True] * bands)


@pytest.mark.parametrize("wins", [[True] + [False] * 7, [False] * 8])
def test_choose_int4_runs_it_per_op_where_it_wins(monkeypatch, wins):
    """A band torch's GEMM wins: its layers run it there (forward equals int4_gemm) and the band
    runs per op; no win: the layouts are dropped. The sources go either way."""
    lins = [QuantLinear([_weight(Q4_1, 64, 128, seed=i)]) for i in range(3)]
    monkeypatch.setattr(cpu_kernel_plan, "STREAM_BYTES", 0)        # time a tiny model too
    monkeypatch.setattr(cpu_kernel_plan, "_int4_wins", lambda layers: list(wins))
    plan = _plan()
    assert cpu_kernel_plan.choose_int4(plan, lins)                   # timed into the plan
    assert plan.int4 == {"128x64": wins}
    assert plan.decode_layer == [not w for w in wins]
    x1, x4 = torch.randn(1, 128), torch.randn(4, 128)
    for lin in lins:
        assert lin.int4_source is None
        assert (lin.int4 is not None) == any(wins)
        if any(wins):
            assert torch.equal(lin(x1), lin.int4_gemm(x1))
        assert torch.equal(lin(x4), lin.blocks_gemm(x4))           # band 1: the blocks


def test_choose_int4_reads_a_cached_plan_and_keeps_a_busy_timing_out_of_it(monkeypatch):
    """A plan from the cache holds the choice (nothing timed); a timing the host was too busy
    for keeps the blocks for this load and leaves the plan without a choice (a later, quiet
    load times it and caches it)."""
    monkeypatch.setattr(cpu_kernel_plan, "STREAM_BYTES", 0)
    cached = _plan()
    cached.source, cached.int4 = "cache", {"128x64": [True] + [False] * 7}
    lins = [QuantLinear([_weight(Q4_1, 64, 128, seed=i)]) for i in range(2)]
    monkeypatch.setattr(cpu_kernel_plan, "_int4_wins", lambda layers: pytest.fail("timed"))
    assert not cpu_kernel_plan.choose_int4(cached, lins)              # nothing new to cache
    assert all(lin.int4 is not None and lin.int4_bands == (0,) for lin in lins)
    assert cached.decode_layer[0] is False

    def busy(layers):
        raise cpu_kernel_plan.HostBusy()
    monkeypatch.setattr(cpu_kernel_plan, "_int4_wins", busy)
    plan, lins = _plan(), [QuantLinear([_weight(Q4_1, 64, 128, seed=3)])]
    assert not cpu_kernel_plan.choose_int4(plan, lins)
    assert plan.int4 == {} and lins[0].int4 is None and plan.decode_layer[0] is True


def test_choose_int4_times_nothing_for_small_models_or_without_a_plan(monkeypatch):
    lins = [QuantLinear([_weight(Q4_0, 64, 128, seed=0)])]
    monkeypatch.setattr(cpu_kernel_plan, "_int4_wins", lambda layers: pytest.fail("timed"))
    plan = _plan()
    cpu_kernel_plan.choose_int4(plan, lins)
    cpu_kernel_plan.choose_int4(None, lins)
    assert plan.int4 == {} and lins[0].int4 is None and lins[0].int4_source is None


def test_int4_wins_times_both_paths_per_band(monkeypatch):
    """The real timing on a few layers: one verdict per band, the last band as the 128-row one."""
    lins = [QuantLinear([_weight(Q4_1, 64, 128, seed=i)]) for i in range(2)]
    for lin in lins:
        lin.int4 = int4_layout(lin.int4_source)
    monkeypatch.setattr(cpu_kernel_plan, "CALLS", 2)
    wins = cpu_kernel_plan._int4_wins(lins)
    assert len(wins) == len(cpu_kernel_plan.BANDS) and wins[-1] == wins[-2]
