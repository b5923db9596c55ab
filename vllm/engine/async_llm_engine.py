"""AsyncLLMEngine: one background thread steps the LLMEngine; each request gets an async stream.

    event loop (server)                          engine thread
    -------------------                          -------------
    generate() --- add cmd ---> commands ----->  drain commands (add / abort / call)
        ^                                        engine.step()
        |                                        step stats -> listeners (metrics)
    RequestStream.queue <-- call_soon_threadsafe -- RequestOutput per step

Only the engine thread touches the LLMEngine, so the engine needs no locks. Commands are
plain callables on a queue; a request's errors (bad prompt, failed step) travel through its
own stream and are raised by `generate()`. A failing step aborts every request in flight
(their engine state is suspect); the loop goes on if the engine is still healthy
(LLMEngine.check_health), else it dies: every request in flight and every later one gets
EngineDeadError, check_health() raises it, and the server exits (api_server). A worker that
dies while nothing runs is noticed within idle_wait_s. Every request is added to the engine
with stream=True, so the thread sees every new token (for TTFT / inter-token latency) and
callers may stream or wait for the end.

The loop thread calls LLMEngine.shutdown() (which stops tensor-parallel workers) when it ends,
by shutdown() or by dying; shutdown() also calls it when no loop thread ever ran.

The Python API is upstream's (AsyncEngineArgs -> from_engine_args -> generate / abort /
check_health / shutdown): the loop starts with the first request, so a script needs no start().
"""
import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Dict, Iterable, List, Optional, Tuple, Union

from vllm.engine.llm_engine import EngineSleepingError, LLMEngine, PromptType
from vllm.kv_eviction_params import KVEvictionParams
from vllm.outputs import RequestOutput, RequestOutputKind, delta_output
from vllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SLEEP_MODES = ("abort", "wait")   # upstream's PauseMode, less "keep" (a request keeps no KV)
_DRAIN_POLL_S = 0.05              # sleep(mode="wait"): how often it looks for the last request


class EngineStepError(RuntimeError):
    """The engine failed while this request was in flight; the request was aborted."""


class EngineDeadError(EngineStepError):
    """The engine loop is not running: it died or was shut down (upstream's name)."""


@dataclass
class FinishedRequestStats:
    """One finished request's phases (upstream's): queued = arrival -> first admission,
    prefill = admission -> first token, decode = first -> last token, inference = both."""
    e2e: float
    reason: str
    queued: float
    prefill: float
    decode: float
    inference: float
    prompt_tokens: int
    generation_tokens: int     # over all n samples


@dataclass
class StepStats:
    """What one engine step did, for metrics (a plain value, built on the engine thread)."""
    now: float
    snapshot: Dict[str, float]
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft: List[float] = field(default_factory=list)
    itl: List[float] = field(default_factory=list)
    finished: List[Tuple[float, str]] = field(default_factory=list)   # (e2e latency, reason)
    finished_requests: List[FinishedRequestStats] = field(default_factory=list)
    n_params: List[int] = field(default_factory=list)   # n of each request that began decoding


class RequestStream:
    """Outputs of one request, handed from the engine thread to the event loop that asked."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, deltas: bool = True):
        self.request_id = request_id
        self.loop = loop
        self.deltas = deltas         # False: only the final output crosses to the event loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        # engine-thread bookkeeping for latency metrics
        self.arrival = time.monotonic()
        self.last_token_time: Optional[float] = None
        self.num_tokens = 0

    def put(self, item) -> bool:
        """Engine thread -> owner loop. False if that loop is gone (its client with it)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:
            return False


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 1.0, log_requests: bool = False,
                 start_engine_loop: bool = True):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self.log_requests = log_requests
        self.start_engine_loop = start_engine_loop   # the first request starts the loop
        self._death: Optional[BaseException] = None  # what killed the loop thread
        self._closed = False          # the loop thread has ended: _submit refuses commands
        self._submit_lock = threading.Lock()
        self._commands: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: Dict[str, RequestStream] = {}       # engine thread only
        self._listeners: List[Callable[[StepStats], None]] = []
        self._thread: Optional[threading.Thread] = None
        self._parked: Optional[threading.Event] = None    # set: the builder thread starts looping
        self._stopping = False
        self._engine_released = False                     # LLMEngine.shutdown() was called
        self._release_lock = threading.Lock()
        self.num_step_errors = 0
        self._falling_asleep = False      # sleep(mode="wait") drains: new requests are refused
        self.snapshot: Dict[str, float] = self._snapshot()

    @classmethod
    def from_engine_args(cls, args, start_engine_loop: bool = True) -> "AsyncLLMEngine":
        """Builds the LLMEngine on the thread that will step it, which then waits for start()
        (or the first request, unless start_engine_loop is false).
        The engine is stepped on the thread that loaded it: OpenMP teams and first-touched
        memory belong to the loading thread, and another thread's steps run the CPU decode
        path slower."""
        built: concurrent.futures.Future = concurrent.futures.Future()
        parked = threading.Event()
        owner: List["AsyncLLMEngine"] = []

        def builder_then_loop():
            try:
                built.set_result(LLMEngine(args))
            except BaseException as e:
                built.set_exception(e)
                return
            parked.wait()
            owner[0]._loop()

        thread = threading.Thread(target=builder_then_loop, name="engine-loop", daemon=True)
        thread.start()
        self = cls(built.result(), log_requests=getattr(args, "enable_log_requests", False),
                   start_engine_loop=start_engine_loop)
        owner.append(self)
        self._thread, self._parked = thread, parked
        return self

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def kv_config(self):
        return self.engine.kv_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def get_tokenizer(self):
        return self.engine.tokenizer

    async def get_model_config(self):
        return self.engine.model_config

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._parked is not None:          # the thread that built the engine loops from now on
            self._stopping = False
            self._parked.set()
            self._parked = None
            return
        if self.is_running:
            return
        if self._engine_released:             # its workers are gone: it cannot step again
            raise self.dead_error
        if self._thread is not None:          # an ended loop first fails what it still holds
            self._thread.join()
        self._death, self._closed, self._stopping = None, False, False
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop (requests in flight get EngineDeadError), then the LLMEngine (its
        tensor-parallel workers). A loop stuck in a step past `timeout` stops the engine itself
        once the step returns (or the workers go with the process at exit)."""
        self._stopping = True
        self._wake.set()
        if self._parked is not None:          # never started: let the builder thread exit
            self._parked.set()
            self._parked = None
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("the engine loop did not stop within %.0f s; its engine is shut "
                               "down when its step returns", timeout)
                return
        self._release_engine()

    def _release_engine(self) -> None:
        """LLMEngine.shutdown(), once (the loop thread at its end, or shutdown())."""
        with self._release_lock:
            if self._engine_released:
                return
            self._engine_released = True
        try:
            self.engine.shutdown()
        except Exception:
            logger.exception("engine shutdown failed")

    @property
    def is_running(self) -> bool:
        return (not self._closed and self._parked is None and self._thread is not None
                and self._thread.is_alive())

    @property
    def errored(self) -> bool:
        """The loop died or was shut down (not merely waiting for its first request)."""
        return self._death is not None or self._stopping or self._closed

    @property
    def is_stopped(self) -> bool:
        return self.errored

    @property
    def died(self) -> bool:
        """The loop ended on an error (e.g. a tensor-parallel worker failed), not by shutdown():
        the engine cannot serve again."""
        return self._death is not None

    @property
    def dead_error(self) -> EngineDeadError:
        if self._death is not None:
            return EngineDeadError(f"the engine loop died: {self._death!r}")
        if self.errored:
            return EngineDeadError("the engine loop was shut down")
        return EngineDeadError("the engine loop is not running (start_engine_loop=False and "
                               "start() was not called)")

    async def check_health(self) -> None:
        """Raises EngineDeadError once the loop died or was shut down."""
        if self.errored:
            raise self.dead_error

    def _ensure_running(self) -> None:
        if self.is_running:
            return
        if self.errored or not self.start_engine_loop:
            raise self.dead_error
        self.start()

    def add_stat_listener(self, fn: Callable[[StepStats], None]) -> None:
        """fn runs on the engine thread after every step; it must be quick and thread-safe."""
        self._listeners.append(fn)

    # ---- the API the server uses --------------------------------------------------------------
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str, *, lora_request=None, priority: int = 0,
                       kv_eviction: Optional[KVEvictionParams] = None,
                       deltas: Optional[bool] = None) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs as sampling_params.output_kind asks: the cumulative
        output after every step (default), only what is new (DELTA), or the final output alone
        (FINAL_ONLY: the event loop wakes once, not once per token); the last one is finished.
        deltas (the server's switch) overrides it: True = cumulative, False = final only.
        Leaving early (break, cancellation, client disconnect) aborts the request."""
        _check_supported(lora_request, priority)
        self.check_awake()
        self._ensure_running()
        kind = sampling_params.output_kind if deltas is None else (
            RequestOutputKind.CUMULATIVE if deltas else RequestOutputKind.FINAL_ONLY)
        stream = RequestStream(request_id, asyncio.get_running_loop(),
                               deltas=kind != RequestOutputKind.FINAL_ONLY)
        if not self._submit(lambda: self._add(stream, prompt, sampling_params, kv_eviction)):
            raise self.dead_error
        sent: Dict[int, Tuple[int, int]] = {}
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    stream.finished = True
                    raise item
                stream.finished = item.finished
                yield delta_output(item, sent) if kind == RequestOutputKind.DELTA else item
                if item.finished:
                    return
        finally:
            if not stream.finished:
                self._submit(lambda: self._abort(request_id))

    async def abort(self, request_id: Union[str, Iterable[str]]) -> None:
        """Ends the requests; each one's generate() yields a last output with finish_reason
        "abort". Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._submit(lambda: [self._abort(rid, notify=True) for rid in ids])

    # ---- sleep mode (upstream's) ----------------------------------------------------------------
    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """LLMEngine.sleep(level) on the engine thread. mode: the requests in flight are
        ended at once with finish_reason "abort" (abort), or finish first while new ones are
        refused with EngineSleepingError (wait)."""
        if mode not in SLEEP_MODES:
            raise ValueError(f"mode: {mode!r}; sleep modes are {list(SLEEP_MODES)} (keep is "
                             f"not served: a kept request would lose its KV cache)")
        self.engine.check_sleep(level)
        self._falling_asleep = mode == "wait"
        try:
            while mode == "wait" and await self.acall(lambda e: e.has_unfinished_requests()):
                await asyncio.sleep(_DRAIN_POLL_S)
            await self.acall(lambda e: self._abort_all_then_sleep(level))
        finally:
            self._falling_asleep = False

    def _abort_all_then_sleep(self, level: int) -> None:
        """Engine thread, one command: nothing is admitted between the aborts and the sleep."""
        for rid in list(self._streams):
            self._abort(rid, notify=True)
        self.engine.abort_request(list(self.engine.requests))
        self.engine.sleep(level)

    async def wake_up(self, tags: Optional[List[str]] = None) -> None:
        await self.acall(lambda e: e.wake_up(tags))

    async def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def check_awake(self) -> None:
        """Raises EngineSleepingError while the engine sleeps or drains for sleep (mode
        "wait"): a new request would not be served."""
        if self.engine.is_sleeping():
            raise EngineSleepingError("the engine is sleeping (its KV cache is released): "
                                      "wake it up first (POST /wake_up)")
        if self._falling_asleep:
            raise EngineSleepingError("the engine is going to sleep (mode=wait): it admits no "
                                      "new request")

    def call(self, fn: Callable[[LLMEngine], object]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between steps (e.g. check_invariants)."""
        self._ensure_running()
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run():
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:   # delivered to the caller, never raised in the loop
                fut.set_exception(e)
        if not self._submit(run):
            fut.set_exception(self.dead_error)
        return fut

    async def acall(self, fn: Callable[[LLMEngine], object]):
        return await asyncio.wrap_future(self.call(fn))

    def num_streams(self) -> int:
        return len(self._streams)

    # ---- engine thread ------------------------------------------------------------------------
    def _submit(self, cmd: Callable[[], None]) -> bool:
        """False once the loop thread has ended (it runs every command accepted before)."""
        with self._submit_lock:
            if self._closed:
                return False
            self._commands.put(cmd)
        self._wake.set()
        return True

    def _add(self, stream: RequestStream, prompt: PromptType, params: SamplingParams,
             kv_eviction: Optional[KVEvictionParams]) -> None:
        rid = stream.request_id
        try:
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            self.engine.add_request(rid, prompt, params, arrival_time=stream.arrival, stream=True,
                                    kv_eviction=kv_eviction)
        except Exception as e:   # bad prompt or params: the caller gets it, the loop goes on
            if self.log_requests:
                logger.info("Request %s failed: %s", rid, e)
            stream.put(e)
            return
        self._streams[rid] = stream
        if self.log_requests:
            logger.info("Added request %s.", rid)

    def _abort(self, request_id: str, notify: bool = False) -> None:
        """notify: hand the caller a last output (finish_reason "abort") that ends its stream."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        state = self.engine.requests.get(request_id)
        # what it has generated so far, as a finished output
        final = self.engine._make_output(state, True) if notify and state is not None else None
        self.engine.abort_request(request_id)
        if final is not None:
            for c in final.outputs:
                c.finish_reason = c.finish_reason or "abort"
            stream.put(final)
        if self.log_requests:
            logger.info("Aborted request %s.", request_id)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                cmd()
            except Exception:
                logger.exception("engine command failed")

    def _loop(self) -> None:
        try:
            self._step_until_stopped()
        except BaseException as e:   # a fatal error: the thread ends, its requests fail
            self._death = e
            logger.critical("the engine loop died; the engine cannot serve again", exc_info=e)
        with self._submit_lock:      # a request submitted from now on is refused, not lost
            self._closed = True
        self._drain_commands()
        self._fail_all(self.dead_error if self._death is not None
                       else EngineDeadError("the engine is shutting down"))
        self._release_engine()       # stop the workers: no step runs on this engine again

    def _step_until_stopped(self) -> None:
        while not self._stopping:
            try:
                self._run_once()
            except Exception as e:   # the step (or its bookkeeping) failed: fail its requests
                self.num_step_errors += 1
                tb = e.__traceback__
                if not self._engine_healthy():   # e.g. WorkerFailed: it cannot step again
                    raise e.with_traceback(tb)   # (check_health may re-raise the same error)
                logger.error("engine step failed; aborting %d requests", len(self._streams),
                             exc_info=e)
                self._fail_all(EngineStepError(f"engine step failed: {e!r}"))
                time.sleep(0.01)

    def _engine_healthy(self) -> bool:
        try:
            self.engine.check_health()
        except Exception:
            return False
        return True

    def _run_once(self) -> None:
        self._wake.clear()
        self._drain_commands()
        if not self.engine.has_unfinished_requests():
            self.snapshot = self._snapshot()
            self._wake.wait(self.idle_wait_s)
            if not self._stopping:
                self.engine.check_health()   # a worker that died while idle ends the loop now
            return
        self._dispatch(self.engine.step())

    def _fail_all(self, error: Exception) -> None:
        """Abort every request in flight and hand each caller the error."""
        ids = list(self._streams)
        try:
            self.engine.abort_request(list(self.engine.requests))
        except Exception:
            logger.exception("abort after a failed step also failed")
        for rid in ids:
            self._streams.pop(rid).put(type(error)(str(error)))

    def _dispatch(self, outputs: List[RequestOutput]) -> None:
        stats = StepStats(now=time.monotonic(), snapshot={})
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:       # aborted after it was scheduled in this step
                continue
            self._account(stream, out, stats)
            if out.finished:
                del self._streams[out.request_id]
            elif not stream.deltas:
                continue
            if not stream.put(out) and not out.finished:
                self._abort(out.request_id)
        stats.snapshot = self.snapshot = self._snapshot()
        for fn in self._listeners:
            try:
                fn(stats)
            except Exception:
                logger.exception("stat listener failed")

    @staticmethod
    def _account(stream: RequestStream, out: RequestOutput, stats: StepStats) -> None:
        n = sum(len(c.token_ids) for c in out.outputs)
        new = n - stream.num_tokens
        if new > 0:
            if stream.last_token_time is None:
                stats.prompt_tokens += len(out.prompt_token_ids)
                stats.ttft.append(stats.now - stream.arrival)
                stats.n_params.append(len(out.outputs))
            else:
                stats.itl.append(stats.now - stream.last_token_time)
            stream.last_token_time = stats.now
            stream.num_tokens = n
            stats.generation_tokens += new
        if out.finished:
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "stop")
            stats.finished.append((stats.now - stream.arrival, reason))
            stats.finished_requests.append(_finished_stats(stream, out, stats.now, reason, n))

    def _snapshot(self) -> Dict[str, float]:
        e = self.engine
        bm = e.kv.bm
        snap = dict(e.get_kv_stats())
        tt = bm.token_table   # live tokens now (the monitor's figure is as of the last step)
        live = sum(tt.num_live(s.seq_id) for s in e.scheduler.running if s.seq_id in tt)
        used = bm.num_blocks - bm.num_free_blocks
        snap.update(live_tokens=live,
                    memory_utilization=live / (used * bm.block_size) if used else 0.0)
        snap.update(num_requests_running=len(e.scheduler.running),
                    num_requests_waiting=len(e.scheduler.waiting),
                    num_free_blocks=bm.num_free_blocks, num_blocks=bm.num_blocks,
                    num_preemptions=e.scheduler.num_preemptions,
                    num_token_tables=len(bm.token_table))
        return snap


def _check_supported(lora_request, priority: int) -> None:
    if lora_request is not None:
        raise ValueError("lora_request: this engine serves no LoRA adapters")
    if priority != 0:
        raise ValueError(f"priority: got {priority}, but this engine schedules first come, "
                         "first served (only priority 0)")


def _finished_stats(stream: RequestStream, out: RequestOutput, now: float, reason: str,
                    num_generated: int) -> FinishedRequestStats:
    m = out.metrics
    admitted = m.get("first_scheduled_time") or stream.arrival
    first = m.get("first_token_time") or now
    return FinishedRequestStats(
        e2e=now - stream.arrival, reason=reason, queued=max(admitted - stream.arrival, 0.0),
        prefill=max(first - admitted, 0.0), decode=max(now - first, 0.0),
        inference=max(now - admitted, 0.0), prompt_tokens=len(out.prompt_token_ids),
        generation_tokens=num_generated)
