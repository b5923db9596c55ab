"""WeightArena: one anonymous mapping, advised for transparent huge pages, that holds a CPU
model's GEMM weights in the layouts its kernels read.

A decode step streams every weight once (540 MB for the default model), so at small batches it
runs at the rate memory delivers them. With 4 KB pages that stream also walks a page table per
4 KB, which in a virtual machine (nested paging) costs a share of the bandwidth: the C GEMM at
one row streamed 28 GB/s from 4 KB pages and 33 GB/s from 2 MB pages on 2 Xeon cores (avx2
build; csrc/cpu/decode_kernels.c). Huge pages are only granted at the first touch of a range
advised beforehand, so the arena is mapped and advised before any weight is written into it,
and sized once for the whole model (`take` hands out consecutive slices). Where the kernel has
no transparent huge pages (or they are off) the advice is ignored and the arena is plain memory.
"""
import math
import mmap
from typing import Sequence

import torch

HUGE_PAGE = 2 << 20


class WeightArena:
    def __init__(self, numel: int):
        self.numel = numel
        self.used = 0
        self._map = mmap.mmap(-1, numel * 4 + HUGE_PAGE,         # untouched: no page yet
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.advised = hasattr(mmap, "MADV_HUGEPAGE")
        if self.advised:
            self._map.madvise(mmap.MADV_HUGEPAGE)
        whole = torch.frombuffer(self._map, dtype=torch.float32)  # keeps the mapping alive
        skip = (-whole.data_ptr() % HUGE_PAGE) // 4                # start on a 2 MB boundary
        self._floats = whole[skip:skip + numel]

    def take(self, shape: Sequence[int]) -> torch.Tensor:
        """The next math.prod(shape) floats of the arena, uninitialized, as a tensor of shape."""
        n = math.prod(shape)
        assert self.used + n <= self.numel, "the arena was sized for fewer weights"
        out = self._floats[self.used:self.used + n].view(*shape)
        self.used += n
        return out
