"""MultiprocExecutor (--distributed-executor-backend mp): tensor parallelism on one node.

Rank 0 runs in the engine's process (TPDriverExecutor, tp_driver_executor.py); ranks 1..N-1
are spawned processes, each running worker_main. CPU threads are split between the ranks (2 cores, N=2: one thread each), every spawned rank
bound to its own cores. A rank that raises or dies ends the executor: its collective fails at
once (a dead peer closes its sockets), the worker's last words (its traceback, or its exit
code) name the rank in the error, and the other workers are stopped. Nothing outlives the
executor: shutdown() (also at garbage collection and interpreter exit) stops every worker.
"""
import logging
import multiprocessing
import os
import traceback
import weakref
from typing import List, Optional, Tuple

import torch

from vllm.config import VllmConfig
from vllm.distributed.tp_group import TPGroup, rank_device
from vllm.executor.tp_driver_executor import JOIN_TIMEOUT_S, TPDriverExecutor, rank_cores, \
    serve_rank

logger = logging.getLogger(__name__)


SHM_BROADCAST_BYTES = 4 << 20    # a pickled step input; a larger one goes over gloo


def shm_sizes(config: VllmConfig) -> dict:
    """TPGroup's shared-memory sizes: the largest all-reduce of the forward (hidden states of a
    full step), the largest logits gather (a full batch's rows of one vocabulary shard) and a
    step input; larger ones use gloo."""
    hf, sc = config.model_config.hf_config, config.scheduler_config
    n = config.parallel_config.tensor_parallel_size
    return {"shm_floats": hf.hidden_size * sc.max_num_batched_tokens,
            "shm_gather_floats": sc.max_num_seqs * -(-hf.vocab_size // n),
            "shm_broadcast_bytes": SHM_BROADCAST_BYTES}


def worker_main(config: VllmConfig, rank: int, port: int, cores: List[int], conn) -> None:
    """A spawned rank: join the group, load its shard, then run rank 0's calls until shutdown.
    Any failure is reported on `conn` and ends the process (which fails rank 0's collective)."""
    try:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
        n = config.parallel_config.tensor_parallel_size
        parent = os.getppid()
        serve_rank(config, rank, TPGroup(rank, n, port=port,
                                         device=rank_device(config.model_config.device, rank, n),
                                         peer_alive=lambda: os.getppid() == parent,
                                         **shm_sizes(config)))
    except BaseException as e:   # noqa: BLE001 -- reported, then the process ends
        try:
            conn.send(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        finally:
            os._exit(1)
    conn.close()


def _kill(procs: List[multiprocessing.Process], tp: TPGroup) -> None:
    """Kill the workers still running and release rank 0's group, its shared memory too (run by
    shutdown and by weakref.finalize)."""
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(JOIN_TIMEOUT_S)
    tp.shutdown()


def _last_words(conn) -> Optional[str]:
    """A failed worker's report, if it sent one (a killed worker only closes its end)."""
    try:
        return conn.recv() if conn.poll(0.5) else None
    except (EOFError, OSError):
        return None


class MultiprocExecutor(TPDriverExecutor):
    def __init__(self, config: VllmConfig):
        super().__init__(config)
        n = config.parallel_config.tensor_parallel_size
        self.procs: List[multiprocessing.Process] = []
        procs = self.procs     # (not self: the group must not keep the executor alive)
        self.tp = TPGroup(0, n, device=rank_device(config.model_config.device, 0, n),
                          connect=False, peer_alive=lambda: all(p.is_alive() for p in procs),
                          **shm_sizes(config))
        ctx = multiprocessing.get_context("spawn")
        self.conns = []
        for rank in range(1, n):
            ours, theirs = ctx.Pipe(duplex=False)
            p = ctx.Process(target=worker_main, name=f"vllm-tp-rank{rank}", daemon=True,
                            args=(config, rank, self.tp.port, rank_cores(rank, n, self.cores),
                                  theirs))
            p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(ours)
        self._finalizer = weakref.finalize(self, _kill, self.procs, self.tp)
        self.driver_worker = self._guard(self._start, config)

    def _failed_worker(self) -> Optional[Tuple[int, str, str]]:
        for p in self.procs:
            p.join(JOIN_TIMEOUT_S if not p.is_alive() else 0.5)
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            report = _last_words(conn)
            if report is not None or not p.is_alive():
                why = report.splitlines()[0] if report else f"exit code {p.exitcode}"
                return rank, why, report
        return None

    def _check_workers_alive(self) -> None:
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                raise RuntimeError(f"tensor-parallel worker rank {rank} exited")

    def _join_workers(self) -> None:
        for p in self.procs:
            p.join(JOIN_TIMEOUT_S)
