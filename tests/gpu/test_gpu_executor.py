"""On CUDA: the relocation executor on a real side stream. The copy waits for the compute
stream's writes (stream order, no host wait), overlaps later compute work, completes by event;
force_sync blocks and is timed. Skipped without CUDA."""
import time

import pytest
import torch

from vllm.worker.relocation import RelocationExecutor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SLEEP = 100_000_000      # GPU cycles: ~50 ms of a busy compute stream


def setup(**kwargs):
    """A cache, moves (host tensors, as the backend submits them) and a warmed-up executor."""
    kv = torch.zeros(4, 4096, 2, 8, 128, device="cuda", dtype=torch.float16)
    src, dst = torch.arange(0, 256), torch.arange(2048, 2304)
    ex = RelocationExecutor(kv, **kwargs)
    ex.submit(-1, src, dst).synchronize()    # first-use costs (streams, pinned pool) untimed
    ex.blocked_time = 0.0
    return kv, src, dst, ex


def test_copy_is_ordered_after_compute_writes_without_host_wait():
    kv, src, dst, ex = setup()
    src_on_gpu = src.cuda()
    torch.cuda._sleep(SLEEP)                 # compute stream busy ...
    kv.index_fill_(1, src_on_gpu, 1.0)       # ... then it writes the sources (a host-to-
    assert not torch.cuda.current_stream().query()   # device value copy would wait for the sleep)
    t0 = time.perf_counter()
    event = ex.submit(0, src, dst)
    assert time.perf_counter() - t0 < 0.02 and not event.query()   # submit did not wait
    event.synchronize()
    assert ex.blocked_time > 0
    assert (kv[:, dst.cuda()] == 1).all()


def test_copy_overlaps_later_compute_and_completes_by_event():
    kv, src, dst, ex = setup()
    kv[:, src.cuda()] = 2.0
    event = ex.submit(0, src, dst)
    torch.cuda._sleep(SLEEP)                 # the next step's work, on the compute stream
    deadline = time.perf_counter() + 5
    while not event.query():                 # polled, as the backend does
        assert time.perf_counter() < deadline
    assert not torch.cuda.current_stream().query(), "the copy waited for later compute work"
    t0 = time.perf_counter()
    ex.pre_attention()                       # a stream wait, not a host wait
    assert time.perf_counter() - t0 < 0.01 and ex.newest_completed is None
    assert (kv[:, dst.cuda()] == 2).all() and ex.device_time > 0


def test_force_sync_blocks_and_measures():
    kv, src, dst, ex = setup(force_sync=True)
    torch.cuda._sleep(SLEEP)
    event = ex.submit(0, src, dst)
    assert event.query() and ex.blocked_time > 0.01
    assert ex.stats()["copy_blocked_s"] == ex.blocked_time
