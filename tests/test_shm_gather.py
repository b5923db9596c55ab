"""ShmGather (vllm/distributed/shm_gather.py) through TPGroup.gather_vocab: rank 0's logits are
bitwise those of gloo's gather, also for vocabulary shards that do not divide evenly (the last
one zero-padded) and at N=3; a gather larger than the segment falls back to gloo; a peer that
dies is an error, not a hang; the segment is gone after shutdown.

Rank 0 runs in the test process, the other ranks are spawned and run the same calls.
"""
import multiprocessing
import os
import time

import pytest
import torch

from vllm.distributed.shm_gather import ShmGather
from vllm.distributed.shm_segment import PeerGone
from vllm.distributed.tp_group import TPGroup

MAX_ROWS = 8
# (rows, vocab): 1001 over 2 ranks is 501 + 500 (+1 padding), over 3 ranks 334 + 334 + 333
CASES = [(1, 1001), (5, 1001), (MAX_ROWS, 1001), (3, 1000), (MAX_ROWS + 1, 1001)]


def shard(vocab: int, n: int) -> int:
    return -(-vocab // n)


def local_logits(rank: int, n: int, rows: int, vocab: int) -> torch.Tensor:
    """Rank `rank`'s [rows, shard] block, random but the same in every process; the padding
    columns past the vocabulary are zero, as a zero-padded LM head gives."""
    g = torch.Generator().manual_seed(1000 * rank + 10 * rows + n)
    width = shard(vocab, n)
    x = torch.randn(rows, width, generator=g)
    x[:, max(0, vocab - rank * width):] = 0.0
    return x


def gather_calls(tp: TPGroup):
    """Every case through shared memory (where it fits) and then through gloo alone."""
    out = []
    for rows, vocab in CASES:
        local = local_logits(tp.rank, tp.world_size, rows, vocab)
        before = tp.shm_gather.calls
        got = tp.gather_vocab(local, vocab)
        used_shm = tp.shm_gather.calls > before
        shm, tp.shm_gather = tp.shm_gather, None
        ref = tp.gather_vocab(local, vocab)
        tp.shm_gather = shm
        out.append((rows, vocab, used_shm, got, ref))
    return out


def group(rank: int, n: int, port: int = 0, connect: bool = True) -> TPGroup:
    parent = os.getppid()                   # a spawned rank's wait ends with the test process
    return TPGroup(rank, n, port=port, connect=connect, timeout_s=120,
                   shm_gather_floats=MAX_ROWS * shard(max(v for _, v in CASES), n),
                   peer_alive=(lambda: os.getppid() == parent) if rank else None)


def peer(rank: int, n: int, port: int) -> None:
    tp = group(rank, n, port)
    try:
        gather_calls(tp)
    finally:
        tp.shutdown()


def run_group(n: int):
    """-> (rank 0's results, the segment's path while it lived)."""
    tp = group(0, n, connect=False)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=peer, args=(r, n, tp.port), daemon=True) for r in range(1, n)]
    for p in procs:
        p.start()
    segment = f"/dev/shm/{tp.shm_gather.name.lstrip('/')}"
    try:
        tp.connect()
        results = gather_calls(tp)
        assert os.path.exists(segment)
    finally:
        for p in procs:
            p.join(60)
        tp.shutdown()
    assert all(p.exitcode == 0 for p in procs)
    return results, segment


@pytest.mark.parametrize("n", [2, 3])
def test_gather_is_bitwise_gloos_and_the_segment_goes_at_shutdown(n):
    results, segment = run_group(n)
    assert not os.path.exists(segment)
    for rows, vocab, used_shm, got, ref in results:
        assert used_shm == (rows <= MAX_ROWS)      # larger: gloo, the same on every rank
        expected = torch.cat([local_logits(r, n, rows, vocab) for r in range(n)], dim=1)
        assert got.shape == ref.shape == (rows, vocab)
        assert torch.equal(got, ref) and torch.equal(got, expected[:, :vocab])


def test_world_size_one_returns_the_shard_trimmed():
    x = torch.randn(2, 7)
    assert torch.equal(TPGroup().gather_vocab(x, 5), x[:, :5])


def _write_once_then_die(name: str) -> None:
    g = ShmGather(1, 2, 64, name)
    g(torch.ones(2, 4))         # call 1 arrives; call 2 never does
    os._exit(0)


def test_a_dead_peer_is_an_error_not_a_hang():
    g = ShmGather(0, 2, 64)
    p = multiprocessing.get_context("spawn").Process(target=_write_once_then_die,
                                                     args=(g.name,), daemon=True)
    p.start()
    g.seg.peer_alive = p.is_alive
    try:
        out = g(torch.zeros(2, 4))
        assert torch.equal(out, torch.cat([torch.zeros(2, 4), torch.ones(2, 4)], dim=1))
        t0 = time.monotonic()
        with pytest.raises(PeerGone, match="gather"):
            g(torch.zeros(2, 4))
        assert time.monotonic() - t0 < 10
    finally:
        p.join(10)
        g.close()


def test_a_peer_that_never_comes_times_out():
    g = ShmGather(0, 2, 64, timeout_s=0.3)
    try:
        with pytest.raises(PeerGone, match="waited"):
            g(torch.zeros(2, 4))
    finally:
        g.close()
