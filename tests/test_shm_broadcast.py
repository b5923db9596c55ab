"""ShmBroadcast (vllm/distributed/shm_broadcast.py) through TPGroup.broadcast_object: every rank
gets rank 0's object, one too large for the segment comes over gloo, a received object does not
alias the buffer the next one overwrites; a rank waiting for the next step does not time out
(an idle engine), and it stops when rank 0 is gone.
"""
import multiprocessing
import os
import pickle
import time

import numpy as np
import pytest

from vllm.distributed.shm_broadcast import ShmBroadcast
from vllm.distributed.shm_segment import PeerGone
from vllm.distributed.tp_group import TPGroup

CAPACITY = 4096
MESSAGES = [("execute_step", (np.arange(300, dtype=np.int64),)), None, {"k": [1, 2.5, "x"]},
            np.arange(CAPACITY, dtype=np.int64),          # 32 KiB pickled: over gloo
            ("shutdown", ())]


def peer(rank: int, port: int, conn) -> None:
    parent = os.getppid()                   # no wait outlives the test process
    tp = TPGroup(rank, 3, port=port, timeout_s=120, shm_broadcast_bytes=CAPACITY,
                 peer_alive=lambda: os.getppid() == parent)
    try:
        got = [tp.broadcast_object() for _ in MESSAGES]
        conn.send((got, tp.shm_bcast.calls))
    finally:
        tp.shutdown()


def equal(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(equal, a, b))
    return a == b


def test_every_rank_gets_rank0s_objects_and_the_segment_goes_at_shutdown():
    tp = TPGroup(0, 3, connect=False, timeout_s=120, shm_broadcast_bytes=CAPACITY)
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=peer, args=(r, tp.port, pipes[r - 1][1]), daemon=True)
             for r in (1, 2)]
    for p in procs:
        p.start()
    segment = f"/dev/shm/{tp.shm_bcast.name.lstrip('/')}"
    try:
        tp.connect()
        for m in MESSAGES:
            assert tp.broadcast_object(m) is m
        assert os.path.exists(segment)
        results = [rx.recv() for rx, _ in pipes]
    finally:
        for p in procs:
            p.join(60)
        tp.shutdown()
    assert not os.path.exists(segment)
    for got, calls in results:
        assert calls == len(MESSAGES)       # the large one too: its slot said "over gloo"
        assert all(equal(m, g) for m, g in zip(MESSAGES, got))


def _reader(name: str, gone, conn) -> None:
    b = ShmBroadcast(1, 2, 1024, name, timeout_s=0.2)     # a reader ignores the timeout
    parent = os.getppid()
    b.seg.peer_alive = lambda: not gone.is_set() and os.getppid() == parent
    conn.send("ready")
    first = b.recv()[1]
    second = b.recv()[1]
    conn.send((first, second))
    try:
        b.recv()                # nothing comes, and then rank 0 is gone
    except PeerGone as e:
        conn.send(str(e))
    b.close()


def test_a_reader_waits_past_the_timeout_gets_its_own_copy_and_stops_when_rank0_is_gone():
    ctx = multiprocessing.get_context("spawn")
    b = ShmBroadcast(0, 2, 1024, timeout_s=60)
    gone = ctx.Event()
    rx, tx = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_reader, args=(b.name, gone, tx), daemon=True)
    p.start()
    try:
        assert rx.poll(60) and rx.recv() == "ready"
        time.sleep(1.5)         # the reader waits far longer than its timeout
        first = np.arange(100, dtype=np.int64)
        assert b.send(pickle.dumps(first))
        assert b.send(pickle.dumps(np.zeros(100, dtype=np.int64)))   # overwrites the bytes
        assert rx.poll(60)
        got_first, got_second = rx.recv()
        assert np.array_equal(got_first, first) and not got_second.any()
        gone.set()
        assert rx.poll(10), "the reader did not notice that rank 0 was gone"
        assert "left the shared-memory broadcast" in rx.recv()
    finally:
        p.join(10)
        b.close()


def test_bad_sizes_are_value_errors():
    with pytest.raises(ValueError, match="positive size"):
        ShmBroadcast(0, 2, -5000)
