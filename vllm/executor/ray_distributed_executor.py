"""RayDistributedExecutor (--distributed-executor-backend ray): tensor parallelism across nodes.

The step protocol is MultiprocExecutor's (shared through TPDriverExecutor and serve_rank in
multiproc_executor.py): rank 0's Worker runs in the engine's process, every call is a
(method, args) pair rank 0 broadcasts over the TPGroup and then runs itself. Ranks 1..N-1 are
Ray actors, one per rank, whose one long-running method (RankActor.run) joins the group at the
engine node's IP (ray.util.get_node_ip_address(), never 127.0.0.1) and rank 0's store port,
builds its Worker and serves the broadcast loop until the shutdown call.

Placement: one placement group of N bundles, strategy PACK (fill a node before the next), one
bundle per rank: {"CPU": c} on CPU (c: VLLM_RAY_CPUS_PER_RANK, default this node's cores / N,
at least 1), {"GPU": 1} on CUDA. Rank 0 reserves bundle 0 too, pinned to the engine's node, so
that Ray never hands rank 0's CPUs or GPU to another rank or another job; on CUDA a probe task
in bundle 0 tells which GPU that is. Rank r's actor runs in bundle r.

Ray itself: if this process is already connected, the executor uses that; else it joins the
cluster at $RAY_ADDRESS if set (auto: the one `ray start` runs on this node), or starts a local
one of its own (no dashboard, warnings only, workers' logs not forwarded: their errors come back
as exceptions). A Ray session the executors started
is shut down when the last of them shuts down.

Failures: a rank that raises closes its group on the way out (serve_rank) and a killed actor's
sockets close with its process, so rank 0's next collective fails at once; the executor then
reads the actors' results (the actor's traceback, or Ray's word that it died) and raises
WorkerFailed naming the rank and its node. While rank 0 builds its Worker (joining the group
waits for every rank) it watches the actors, so an actor that dies before joining fails the
start instead of leaving rank 0 waiting out the group's timeout. shutdown() (also at garbage
collection and interpreter exit) kills the actors and removes the placement group.

Every node needs this package (the same version) and the model at the same path.
"""
import logging
import os
import threading
import weakref
from typing import List, Optional, Tuple

import torch

from vllm import envs
from vllm.config import VllmConfig
from vllm.distributed.tp_group import TPGroup
from vllm.executor.tp_driver_executor import JOIN_TIMEOUT_S, TPDriverExecutor, rank_cores, \
    serve_rank

logger = logging.getLogger(__name__)

INSTALL_HINT = ("pip install '.[ray]' (or pip install -r requirements-ray.txt) in the "
                "repository")
PLACEMENT_TIMEOUT_S = 120.0    # the cluster has room for the placement group by then, or never
DIAGNOSE_WAIT_S = 3.0          # after a failed collective: how long the failed actor may take
POLL_S = 0.2                   # while rank 0 joins: how often the actors are looked at
ENV_PREFIXES = ("VLLM_", "GLOO_", "NCCL_")   # the engine's variables the actors get too
# a rank that failed only because another rank closed its sockets (not the cause)
COLLATERAL = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def import_ray():
    """The ray module, or a ValueError that says how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ValueError(f"--distributed-executor-backend ray needs Ray, which is not "
                         f"installed ({e}): {INSTALL_HINT}; or use mp (one node)") from None
    return ray


# ---- the Ray session: started by the first executor that needs it, ended by the last -----------
_SESSION = {"users": 0, "started": False}
_SESSION_LOCK = threading.RLock()   # a finalizer may run (GC) while it is held


def _acquire_ray(ray, num_cpus: Optional[int]) -> None:
    with _SESSION_LOCK:
        if not ray.is_initialized():
            quiet = dict(logging_level=logging.WARNING, log_to_driver=False)
            address = os.environ.get("RAY_ADDRESS")
            if address:
                ray.init(address=address, **quiet)
            else:
                # "local": a new cluster of our own, even where `ray start` runs on this node
                # (RAY_ADDRESS=auto joins that one)
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **quiet)
            _SESSION["started"] = True
        _SESSION["users"] += 1


def _release_ray(ray) -> None:
    with _SESSION_LOCK:
        _SESSION["users"] -= 1
        if _SESSION["users"] == 0 and _SESSION["started"]:
            _SESSION["started"] = False
            if ray.is_initialized():
                ray.shutdown()


def _stop_ranks(ray, actors: list, groups: list) -> None:
    """Kill the actors, remove the placement group, let go of Ray (weakref.finalize runs it:
    at shutdown, at garbage collection, at interpreter exit, or when the executor fails)."""
    try:
        if ray.is_initialized():     # Ray's own exit hook may have run first: all gone then
            for actor in actors:
                ray.kill(actor, no_restart=True)
            for pg in groups:
                ray.util.remove_placement_group(pg)
    except Exception:   # noqa: BLE001 -- best effort: a job's actors and groups end with it
        logger.debug("stopping the Ray tensor-parallel ranks", exc_info=True)
    finally:
        actors.clear()
        groups.clear()
        _release_ray(ray)


class RankActor:
    """One tensor-parallel rank (1..N-1) in a Ray worker process (wrapped by ray.remote)."""

    def run(self, config: VllmConfig, rank: int, host: str, port: int, device: str,
            threads: Optional[int]) -> None:
        """Join the group at host:port, build this rank's Worker, run rank 0's calls until the
        shutdown call. Returns then; raises (group closed) on any failure."""
        if threads:
            torch.set_num_threads(threads)
        n = config.parallel_config.tensor_parallel_size
        serve_rank(config, rank, TPGroup(rank, n, host=host, port=port,
                                         device=torch.device(device)))


def _assigned_gpu_ids() -> list:
    import ray
    return ray.get_gpu_ids()


def local_cuda_index(gpu_id, visible: Optional[str]) -> int:
    """The index torch gives (in this process) the GPU Ray calls gpu_id: its place in
    CUDA_VISIBLE_DEVICES where that is set, else the id itself."""
    if visible:
        return [v.strip() for v in visible.split(",")].index(str(gpu_id))
    return int(gpu_id)


class RayDistributedExecutor(TPDriverExecutor):
    def __init__(self, config: VllmConfig):
        super().__init__(config)
        ray = self._ray = import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy as InGroup
        n = config.parallel_config.tensor_parallel_size
        cuda = torch.device(config.model_config.device).type == "cuda"
        cpus = envs.VLLM_RAY_CPUS_PER_RANK or len(rank_cores(0, n, self.cores))
        _acquire_ray(ray, None if cuda else max(os.cpu_count() or 1, n * cpus))
        self.actors: list = []
        self.groups: list = []
        self.refs: list = []        # each actor's run(): ends only at shutdown or on failure
        self._finalizer = weakref.finalize(self, _stop_ranks, ray, self.actors, self.groups)
        try:
            self.host = ray.util.get_node_ip_address()
            here = {f"node:{self.host}": 0.001}          # bundle 0: rank 0, on this node
            unit = {"GPU": 1} if cuda else {"CPU": cpus}
            self.bundles = [{**unit, **here}] + [dict(unit) for _ in range(1, n)]
            pg = ray.util.placement_group(self.bundles, strategy="PACK")
            self.groups.append(pg)
            self._wait_for_placement(pg)
            if cuda:     # bundle 0's GPU: the one no actor gets
                ids = ray.get(ray.remote(_assigned_gpu_ids).options(
                    num_cpus=0, num_gpus=1, scheduling_strategy=InGroup(pg, 0)).remote(),
                    timeout=PLACEMENT_TIMEOUT_S)
                visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                driver_device = f"cuda:{local_cuda_index(ids[0], visible)}"
            else:
                driver_device = config.model_config.device
                torch.set_num_threads(cpus)
            self.tp = TPGroup(0, n, host=self.host, device=torch.device(driver_device),
                              connect=False)
            env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
            actor_class = ray.remote(RankActor)
            for rank in range(1, n):
                actor = actor_class.options(
                    num_cpus=0 if cuda else cpus, num_gpus=1 if cuda else 0,
                    scheduling_strategy=InGroup(pg, rank), max_restarts=0,
                    runtime_env={"env_vars": env} if env else None).remote()
                self.actors.append(actor)
                self.refs.append(actor.run.remote(config, rank, self.host, self.tp.port,
                                                  "cuda:0" if cuda else driver_device,
                                                  None if cuda else cpus))
        except BaseException:
            self._finalizer()
            raise
        self.driver_worker = self._guard(self._start_watched, config)

    def _wait_for_placement(self, pg) -> None:
        from ray.exceptions import GetTimeoutError
        ray = self._ray
        try:
            ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            raise ValueError(
                f"--tensor-parallel-size {len(self.bundles)} --distributed-executor-backend "
                f"ray: the Ray cluster could not place {len(self.bundles)} bundles "
                f"{self.bundles[1:2] or self.bundles} (the first on this node, "
                f"{self.host}) within {PLACEMENT_TIMEOUT_S:.0f} s; the cluster has "
                f"{ray.cluster_resources()}, free {ray.available_resources()}") from None

    def _start_watched(self, config: VllmConfig):
        """_start (join the group, build rank 0's Worker) in a thread, while the actors are
        looked at every POLL_S: an actor that ends first fails the start at once."""
        box = {}

        def start():
            try:
                box["worker"] = self._start(config)
            except BaseException as e:   # noqa: BLE001 -- raised again below
                box["error"] = e
        thread = threading.Thread(target=start, name="vllm-tp-rank0-start", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(POLL_S)
            if thread.is_alive():
                self._check_workers_alive()
        if "error" in box:
            raise box["error"]
        return box["worker"]

    # ---- TPDriverExecutor: the actors ----------------------------------------------------------
    def _check_workers_alive(self) -> None:
        done, _ = self._ray.wait(self.refs, num_returns=1, timeout=0) if self.refs else ([], [])
        if done:
            rank = self.refs.index(done[0]) + 1
            raise RuntimeError(f"tensor-parallel worker rank {rank} ended")

    def _join_workers(self) -> None:
        if self.refs:
            self._ray.wait(self.refs, num_returns=len(self.refs), timeout=JOIN_TIMEOUT_S)

    def _failed_worker(self) -> Optional[Tuple[int, str, str]]:
        """The rank whose run() ended, the cause first: an actor that died, then one that
        raised, then one that failed only because another closed its sockets."""
        ray = self._ray
        if not self.refs or not ray.wait(self.refs, num_returns=1, timeout=DIAGNOSE_WAIT_S)[0]:
            return None
        done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0.5)
        ended = [self._ending(rank, ref) for rank, ref in enumerate(self.refs, start=1)
                 if ref in done]
        _, rank, why, report = min(ended)
        return rank, f"Ray actor on {self._node_of(rank)}: {why}", report

    def _ending(self, rank: int, ref) -> Tuple[int, int, str, str]:
        from ray.exceptions import RayActorError, RayTaskError
        try:
            self._ray.get(ref)
            return 3, rank, "it left the group before the shutdown call", ""
        except RayActorError as e:
            return 0, rank, "the actor died: " + _lines(str(e))[-1], str(e)
        except RayTaskError as e:
            cause = e.cause if isinstance(e.cause, BaseException) else e
            why = _lines(f"{type(cause).__name__}: {cause}")[0]
            return (2 if any(s in str(cause) for s in COLLATERAL) else 1), rank, why, str(e)
        except Exception as e:   # noqa: BLE001 -- anything else Ray raises for it
            return 1, rank, _lines(f"{type(e).__name__}: {e}")[0], str(e)

    def _node_of(self, rank: int) -> str:
        """The IP of the node that holds rank's bundle ("?" if Ray cannot say)."""
        try:
            node_id = self._ray.util.placement_group_table(self.groups[0])[
                "bundles_to_node_id"][rank]
            return next(nd["NodeManagerAddress"] for nd in self._ray.nodes()
                        if nd["NodeID"] == node_id)
        except Exception:   # noqa: BLE001 -- only for the message
            return "?"


def _lines(text: str) -> List[str]:
    """The text's non-blank lines, stripped (at least one)."""
    return [line.strip() for line in text.splitlines() if line.strip()] or [text]
