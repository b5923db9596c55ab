"""CPU memory on transparent huge pages (2 MiB), for the two large things a decode step reads:
the model's weights (WeightArena) and the KV pool.

Huge pages are only granted at the first touch of a range advised beforehand, so mapping() maps
fresh anonymous memory (zeros, no page yet) and advises it before anyone writes to it. Where the
kernel has no transparent huge pages, or grants none on request (enabled = never), the advice is
ignored and the memory is plain.

The KV pool is read at scattered slots: after eviction and relocation a request's view jumps
between blocks, and a decode step reads each live token's K and V rows wherever they lie in a
pool of hundreds of MiB. On 4 KiB pages nearly every row is its own TLB entry (a Zen 4 core's L2
TLB covers 12 MiB of them); a 2 MiB page holds 2,048 fp8 rows of the default model.
"""
import math
import mmap
from typing import Sequence

import torch

HUGE_PAGE = 2 << 20
ADVISABLE = hasattr(mmap, "MADV_HUGEPAGE")


def mapping(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] of fresh anonymous memory (zeros, untouched), advised for huge pages,
    starting on a 2 MiB boundary. The tensor keeps the mapping alive."""
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if ADVISABLE:
        m.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(m, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip:skip + nbytes]


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on the CPU, on huge pages; every page touched now (as
    torch.zeros does), so the memory is resident from the start."""
    t = mapping(math.prod(shape) * dtype.itemsize).view(dtype).view(*shape)
    return t.zero_()
