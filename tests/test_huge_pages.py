"""The CPU KV pool on transparent huge pages (vllm/huge_pages.py): zeros of every KV dtype, the
advice taken where the kernel grants huge pages on request, and the engine's pool advised."""
import os

import pytest
import torch

from tests.conftest import random_prompts
from vllm import LLM, SamplingParams, huge_pages

MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
ROLLUP = "/proc/self/smaps_rollup"


def thp_on_request() -> bool:
    if not (os.path.exists(MODE) and os.path.exists(ROLLUP)):
        return False
    with open(MODE) as f:
        mode = f.read()
    return "[madvise]" in mode or "[always]" in mode


def anon_huge_kib() -> int:
    with open(ROLLUP) as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


needs_thp = pytest.mark.skipif(not thp_on_request(), reason="no transparent huge pages here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
def test_zeros_of_every_kv_dtype(dtype):
    t = huge_pages.zeros((3, 2048, 2, 3, 64), dtype)
    assert t.shape == (3, 2048, 2, 3, 64) and t.dtype == dtype
    assert not t.view(torch.uint8).any()


def test_mapping_is_aligned_zeroed_and_outlives_its_maker():
    t = huge_pages.mapping(3 * huge_pages.HUGE_PAGE + 5)
    assert t.dtype == torch.uint8 and t.numel() == 3 * huge_pages.HUGE_PAGE + 5
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0 and not t.any()
    f = t[:4 << 20].view(torch.float32)                      # the mapping lives on in views
    del t
    f.fill_(2.0)
    assert f.sum().item() == 2.0 * (1 << 20)


@needs_thp
def test_advised_memory_is_on_huge_pages():
    """64 MiB advised before the first touch: at least 48 MiB of it on huge pages (the process's
    AnonHugePages grows by that much; 2 MiB at each unaligned end may stay small)."""
    before = anon_huge_kib()
    t = huge_pages.zeros((16 << 20,), torch.float32)
    assert anon_huge_kib() - before >= 48 << 10
    del t


@needs_thp
def test_engine_kv_pool_is_on_huge_pages(tiny_llama):
    """The engine's CPU KV pool (worker.initialize_cache) is advised: AnonHugePages grows by at
    least the pool's size less its two unaligned ends, and generation runs on it as before."""
    before = anon_huge_kib()
    llm = LLM(tiny_llama, num_gpu_blocks_override=16384)
    pool = llm.llm_engine.kv_caches
    assert pool.nbytes >= 32 << 20
    assert (anon_huge_kib() - before) << 10 >= pool.nbytes - (4 << 20)
    out = llm.generate([{"prompt_token_ids": p} for p in random_prompts(2, seed=5)],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
