"""pack_weight packs for every variant the CPU runs (benchmark_cpu_isa.py times them side by
side), and the benchmark's rows cover every variant and prefetch setting."""
import os
import sys

import pytest
import torch

from vllm.kernels import cpu_kernels

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import benchmark_cpu_isa as bench  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")


@pytest.mark.parametrize("isa", cpu_kernels.runnable_isas())
def test_pack_for_any_variant_gives_x_at_w(isa):
    torch.manual_seed(0)
    wt, x = torch.randn(96, 40), torch.randn(5, 96)
    packed = cpu_kernels.pack_weight(wt, isa=isa)
    assert packed.shape == (-(-40 // cpu_kernels._panel_width(isa)), 96,
                            cpu_kernels._panel_width(isa))
    if isa == cpu_kernels.active_isa():
        assert torch.equal(packed, cpu_kernels.pack_weight(wt))
    for prefetch in (1, 0):
        y = torch.empty(5, 40)
        cpu_kernels.library(isa).vtok_packed_gemm(x.data_ptr(), 5, 96, packed.data_ptr(), 40,
                                                  None, None, y.data_ptr(), prefetch)
        torch.testing.assert_close(y, (x.double() @ wt.double()).float(), rtol=1e-4, atol=1e-4)


def test_measure_times_every_variant_at_every_row_count():
    isas = cpu_kernels.runnable_isas()
    rows = bench.measure(isas, [1, 3], reps=2, gemms=((64, 48, 2), (48, 64, 1)))
    assert [r["rows"] for r in rows] == [1, 3]
    for r in rows:
        for isa in isas:
            for name in (isa, f"{isa}_nopf"):
                assert r[f"{name}_ms"] > 0 and r[f"{name}_gb_s"] > 0
