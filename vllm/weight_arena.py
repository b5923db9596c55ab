"""WeightArena: one anonymous mapping, advised for transparent huge pages, that holds a CPU
model's GEMM weights in the layouts its kernels read.

A decode step streams every weight once, so at small batches it runs at the rate memory
delivers them. With 4 KB pages that stream also walks a page table per 4 KB, which in a virtual
machine (nested paging) costs a share of the bandwidth; 2 MB pages walk one per 2 MB. The arena is one huge_pages.mapping(), advised before any
weight is written into it and sized once for the whole model (`take` hands out consecutive
slices).
"""
import math
from typing import Sequence

import torch

from vllm import huge_pages


class WeightArena:
    def __init__(self, numel: int):
        self.numel = numel
        self.used = 0
        self.advised = huge_pages.ADVISABLE
        self._floats = huge_pages.mapping(numel * 4).view(torch.float32)

    def take(self, shape: Sequence[int]) -> torch.Tensor:
        """The next math.prod(shape) floats of the arena, uninitialized, as a tensor of shape."""
        n = math.prod(shape)
        assert self.used + n <= self.numel, "the arena was sized for fewer weights"
        out = self._floats[self.used:self.used + n].view(*shape)
        self.used += n
        return out
