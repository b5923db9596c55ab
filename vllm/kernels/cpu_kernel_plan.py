"""KernelPlan: which CPU path runs each op at each batch size, chosen once per model by timing.

At model load, each GEMM shape of the model is timed at one row count per band (BANDS, timed at
TIMED_ROWS) on three paths:
    c      the C packed GEMM (vllm/kernels/cpu_kernels.py; weights as its panels)
    mkl    MKL's packed sgemm (torch.ops.mkl._mkl_linear): its packing is only valid for one row
           count, so a band it serves gets its own copy, packed for the band's largest row count
           (rows padded up to it), and that copy is 2.7-4.3x the weight's bytes
    torch  x @ Wt, Wt [K, N] contiguous
Each candidate cycles through copies of its weight (or attention's K/V) filling pool_bytes(), at
least the L3, so that every timed call streams from memory as in a decode step over all layers.
Decode attention is timed C vs torch, and on the built model the fused C decode layer
(cpu_kernels.decode_layer) with and without the C GEMM's next-panel prefetch vs the per-op path:
`prefetch` per band is what the C GEMMs then use in that band (the prefetch overlaps the weight
stream with the arithmetic from a few rows, but at one row, where the stream is all a pass does,
it can slow the stream down). Memory: each weight is kept in the layout of the path that wins
most of its bands (ties: c); another layout is added only for a band where it is MARGIN faster
than that one, at the cost in `as_dict()["extra_weight_bytes"]`.

Timing needs our cores: while other processes hold them (every multi-threaded call then waits a
scheduler tick) it gives up after a few seconds and runs the C path everywhere, uncached (source
"busy"). A plan timed while other processes used more than OTHERS_MAX_CORES of the host's CPUs
(/proc/stat against our own CPU time) is used for this run but not cached (source "contended"),
so a later, quiet load times again. A model whose GEMM weights (float32 and blocks) fit in
STREAM_BYTES (test models) is bound by per-op overhead, not by streaming weights: it runs the C
path everywhere, untimed (source "small").
GGUF Q4_0 / Q4_1 layers are timed against torch's own 4-bit GEMM (choose_int4): it runs the bands
it wins by MARGIN, per op there. A GGUF or bf16 model that keeps float32 layers beside its blocks
times the crossover between the two (cpu_decode.CpuDecodeModel.quant_crossover): both choices
are part of the plan and cached with it, unless timed beside other processes.
VLLM_CPU_GEMM=c|mkl|torch forces that GEMM path in every band (mkl: up to 128 rows, torch above)
and times nothing (tests): attention then runs in C, and the fused layer wherever the GEMM is c.
The decision is cached in <cache root>/cpu_kernels/plan-<key>.json, the key naming the kernel
builds (source, variant, CPU; the quant kernels' too for a model with GGUF blocks), threads,
torch version, the model's shapes and its weight types: later loads read it and time nothing;
`decisions()` returns the last one made as a dict.
"""
import bisect
import hashlib
import itertools
import json
import logging
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from vllm import envs
from vllm.kernels import cpu_kernels, quant_kernels

logger = logging.getLogger(__name__)

BANDS = ((1, 1), (2, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, 128), (129, None))
TIMED_ROWS = (1, 4, 8, 16, 32, 64, 128, 256)      # each band timed at its largest row count
GEMM_PATHS = ("c", "mkl", "torch")
TIMING_VERSION = 6          # in the cache key; raised whenever how a plan is timed changes, so
                            # that plans timed the old way are timed again, not read
MARGIN = 0.20               # a second layout of a weight must be this much faster in its band
STREAM_BYTES = 64 << 20     # weights timed on copies of at least this (and of the L3 size, up to
MAX_STREAM_BYTES = 1 << 30  # this) so that every timed call streams its weight from memory
MAX_TIMED_COLS = 4096       # wider weights (the LM head) are timed on their first columns
CALLS = 8                   # timed calls per candidate and band (the minimum is kept)
LAYER_CALLS = 16            # decode-layer rounds per band (the median per-round ratio decides)
PREFETCH_MARGIN = 0.05      # the next-panel prefetch is kept in a band only this much faster
BUSY_SECONDS = 1e-3         # a near-empty parallel region slower than this: the host is busy
BUSY_RETRIES = 30           # checks 0.1 s apart before timing gives up (HostBusy)
OTHERS_MAX_CORES = 0.25     # other processes' mean CPU use while timing above which: not cached
_LAST = len(BANDS) - 1
_TOPS = [hi for _, hi in BANDS[:-1]]


def band(m: int) -> int:
    """Index into BANDS of a batch of m rows: band(1) == 0, band(3) == 1, band(300) == 7."""
    return bisect.bisect_left(_TOPS, m)


def mkl_available() -> bool:
    return hasattr(torch.ops.mkl, "_mkl_linear") and torch.backends.mkl.is_available()


def shape_name(k: int, n: int) -> str:
    return f"{k}x{n}"


@dataclass
class KernelPlan:
    isa: str
    cpu: str
    threads: int
    gemm: Dict[str, List[str]]            # shape_name(K, N) -> path per band
    attention: List[str]                  # per band: "c" or "torch"
    decode_layer: List[bool] = field(default_factory=lambda: [False] * len(BANDS))
    prefetch: List[bool] = field(default_factory=lambda: [True] * len(BANDS))
    source: str = "timed"       # "timed", "cache", "forced", "small", "busy" or "contended"
    seconds: float = 0.0                  # time spent timing
    timings_ms: Dict[str, Dict[str, List[float]]] = field(default_factory=dict)
    extra_weight_bytes: int = 0           # bytes kept beyond one layout per weight
    cache_path: str = ""
    others_cores: Optional[float] = None  # other processes' mean CPU use while timing (OthersCpu)
    int4: Dict[str, List[bool]] = field(default_factory=dict)   # choose_int4, per band
    quant_below: Optional[int] = None     # the weight twin's crossover rows (cpu_decode)

    def gemm_path(self, k: int, n: int, m: int) -> str:
        return self.gemm[shape_name(k, n)][band(m)]

    def attention_path(self, m: int) -> str:
        return self.attention[band(m)]

    def use_decode_layer(self, m: int) -> bool:
        return self.decode_layer[band(m)]

    def prefetch_next(self, m: int) -> bool:
        """Whether the C GEMMs of an m-row step prefetch their next panels."""
        return self.prefetch[band(m)]

    def as_dict(self) -> dict:
        """JSON-able: bands as [lo, hi] (hi None = unbounded) and every choice per band."""
        return {"bands": [list(b) for b in BANDS], **asdict(self)}


_LAST_PLAN: Optional[KernelPlan] = None


def decisions() -> dict:
    """The most recent model's plan in this process, as_dict(); {} when none was made."""
    return _LAST_PLAN.as_dict() if _LAST_PLAN else {}


# ---- timing ---------------------------------------------------------------------------------
class HostBusy(Exception):
    """Other processes hold our cores: timings would measure them, not the kernels."""


def _region_seconds() -> float:
    """The cheapest of a few near-empty multi-threaded C calls: microseconds on an idle host, a
    scheduler tick (milliseconds) when another process runs on a core our threads need."""
    x, w = torch.zeros(1, 16), cpu_kernels.pack_weight(torch.zeros(16, 16))
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        cpu_kernels.packed_gemm(x, w, 16)
        best = min(best, time.perf_counter() - t0)
    return best


class OthersCpu:
    """Mean cores other processes (and the hypervisor: steal) used since construction: host busy
    time from /proc/stat minus this process's CPU time, over the wall time. 2 cores, 10 s: the
    host was busy 18 s, we used 15 s -> 0.3. None where /proc/stat does not exist."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample() -> Optional[Tuple[float, float, float]]:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
        own = os.times()
        return busy, own.user + own.system, time.monotonic()

    def cores(self) -> Optional[float]:
        end = self._sample()
        if self.start is None or end is None:
            return None
        (busy0, own0, t0), (busy1, own1, t1) = self.start, end
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / max(t1 - t0, 1e-9)


def _wait_until_quiet() -> None:
    for _ in range(BUSY_RETRIES):
        if torch.get_num_threads() < 2 or _region_seconds() < BUSY_SECONDS:
            return
        time.sleep(0.1)
    raise HostBusy


def _rounds(candidates: Dict[str, Iterator[Callable[[], object]]],
            rounds: int) -> Dict[str, List[float]]:
    """Seconds of each candidate's call in each of `rounds` rounds, the candidates taking turns
    call by call (after one warm-up round); while the host stays busy (no near-empty parallel
    region fast enough), timing stops: HostBusy."""
    _wait_until_quiet()
    times: Dict[str, List[float]] = {name: [] for name in candidates}
    for i in range(rounds + 1):                       # round 0 is a warm-up
        for name, calls in candidates.items():
            fn = next(calls)
            t0 = time.perf_counter()
            fn()
            if i:
                times[name].append(time.perf_counter() - t0)
    return times


def _min_seconds(candidates: Dict[str, Iterator[Callable[[], object]]]) -> Dict[str, float]:
    """Min over CALLS timed calls of each candidate. On a shared host a call that another process
    preempts costs a scheduler tick (milliseconds), so the minimum of single calls, not the sum of
    many, is the cost of the kernel itself."""
    return {name: min(ts) for name, ts in _rounds(candidates, CALLS).items()}


def paired(a: List[float], b: List[float]) -> float:
    """Median over rounds of a's time / b's time in the same round: below 1, a is faster. Each
    ratio compares calls made a moment apart, so the host's drift between rounds (a shared
    host's memory bandwidth moves within minutes) and one preempted call cancel out, where two
    minima taken at different moments need not (see choose_decode_layer)."""
    return statistics.median(x / y for x, y in zip(a, b))


def _round_robin(calls: Dict[str, List[Callable[[], object]]]
                 ) -> Dict[str, Iterator[Callable[[], object]]]:
    """_min_seconds iterators for candidates that share one pool of n copies (the model's
    layers, attention's K/V): as the candidates take turns, the t-th timed call reads copy
    t mod n, so no copy is read again before every other one has been. Each cycling through
    the pool from the start, the candidate after another would read the copy just pulled into
    L3 (a layer is smaller than the L3) and win bands it loses when it streams from memory.
    3 candidates, 5 copies: a reads 0 3 1 4 2 .., b 1 4 2 0 3 .., c 2 0 3 .."""
    k, n = len(calls), len(next(iter(calls.values())))
    assert all(len(fns) == n for fns in calls.values())

    def turns(fns, j):                 # a function: each generator binds its own fns and j
        return (fns[(j + i * k) % n] for i in itertools.count())
    return {name: turns(fns, j) for j, (name, fns) in enumerate(calls.items())}


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size from sysfs (0 if unknown); a cache the whole socket shares
    counts whole, though this process gets only part of it."""
    sizes = [0]
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        sizes.append(int(digits) * unit if digits.isdigit() else 0)
    return max(sizes)


def pool_bytes() -> int:
    """Bytes of copies a timed weight cycles through, so that each call streams it from memory,
    as in a decode step over all layers. A pool smaller than the L3 stays cached and flatters
    whichever path computes fastest, where from memory the paths stream at about the same
    speed: hence at least the L3 and STREAM_BYTES, up to MAX_STREAM_BYTES."""
    return min(max(STREAM_BYTES, last_level_cache_bytes()), MAX_STREAM_BYTES)


def _copies(nbytes: int, available: Optional[int] = None) -> int:
    """Copies of nbytes that fill pool_bytes() (at most `available`)."""
    copies = -(-pool_bytes() // nbytes)
    return max(1, copies if available is None else min(available, copies))


def _mkl_pack(wt: torch.Tensor, m: int) -> torch.Tensor:
    return torch.ops.mkl._mkl_reorder_linear_weight(wt.t().contiguous(), m)


def mkl_gemm(x: torch.Tensor, packed: torch.Tensor, rows: int, n: int, k: int) -> torch.Tensor:
    """x [M <= rows, K] @ W through MKL's weight packed for exactly `rows` rows: x is padded to
    rows (MKL's op only uses the packing then, so its unpacked-weight argument is a stand-in)."""
    m = x.shape[0]
    if m < rows:
        x = torch.cat([x, x.new_zeros(rows - m, k)])
    stand_in = x.new_zeros(1, 1).expand(n, k)
    return torch.ops.mkl._mkl_linear(x, packed, stand_in, None, rows)[:m]


def _time_gemm(k: int, n: int) -> Dict[str, List[float]]:
    """Seconds per call of each path, per band (inf: not a candidate there). Each path cycles
    through its own copies of the weight, so every call reads a weight evicted from L3."""
    cols = min(n, MAX_TIMED_COLS)
    base = torch.randn(k, cols)
    ws = [base.clone() for _ in range(_copies(4 * k * cols))]
    packed = cpu_kernels.pack_weight(base)
    layouts = {"c": itertools.cycle([packed.clone() for _ in ws]), "torch": itertools.cycle(ws)}
    out = {p: [] for p in GEMM_PATHS}
    for b, m in enumerate(TIMED_ROWS):
        x = torch.randn(m, k)
        calls = {"c": (lambda p=p: cpu_kernels.packed_gemm(x, p, cols) for p in layouts["c"]),
                 "torch": (lambda w=w: x @ w for w in layouts["torch"])}
        if mkl_available() and b != _LAST:               # the last band has no largest m
            # 3-4x the bytes: a third as many copies; each packed anew (a clone of MKL's
            # packed tensor is not a valid packing: _mkl_linear faults on it)
            packs = [_mkl_pack(base, m) for _ in range(max(1, len(ws) // 3))]
            calls["mkl"] = (lambda p=p: mkl_gemm(x, p, m, cols, k) for p in itertools.cycle(packs))
        best = _min_seconds(calls)
        for p in GEMM_PATHS:
            out[p].append(best.get(p, math.inf))
    return out


def _choose_gemm(times: Dict[str, List[float]]) -> List[str]:
    """Per band: the primary layout's path (most band wins, ties c) unless another path is
    MARGIN faster there. Extra layouts only exist for such bands."""
    wins = [min(GEMM_PATHS, key=lambda p: times[p][b]) for b in range(len(BANDS))]
    primary = max(("c", "torch"), key=lambda p: (wins.count(p), p == "c"))
    return [w if times[w][b] < (1 - MARGIN) * times[primary][b] else primary
            for b, w in enumerate(wins)]


def _time_attention(heads: int, kv_heads: int, head_dim: int,
                    context: int = 256) -> Dict[str, List[float]]:
    from vllm.attention.backend import AttentionMetadata, _decode
    out = {"c": [], "torch": []}
    for m in TIMED_ROWS:
        slots = m * context
        base = torch.randn(slots, 2, kv_heads, head_dim)
        kvs = [base.clone() for _ in range(_copies(base.numel() * 4))]
        # the paged cache's layout: blocks of 16 slots in random order, each read in order
        views = (torch.randperm(slots // 16)[:, None] * 16 + torch.arange(16)).view(m, context)
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64), num_decodes=m,
                                 decode_views=views, decode_lens=torch.full((m,), context))
        q = torch.randn(m, heads, head_dim)

        # path bound as a default: a lambda reading the loop's variable once timed torch for
        # every candidate
        best = _min_seconds(_round_robin({
            path: [lambda kv=kv, path=path: _decode(q, kv, meta, 0.125, path) for kv in kvs]
            for path in out}))
        for path in out:
            out[path].append(best[path])
    return out


# ---- the plan of one model ------------------------------------------------------------------
def _forced() -> Optional[str]:
    forced = envs.VLLM_CPU_GEMM
    if forced not in ("auto", *GEMM_PATHS):
        raise ValueError(f"VLLM_CPU_GEMM={forced!r}: expected auto, c, mkl or torch")
    if forced == "mkl" and not mkl_available():
        raise ValueError("VLLM_CPU_GEMM=mkl: this torch build has no torch.ops.mkl._mkl_linear")
    return None if forced == "auto" else forced


# what limits the instruction sets of torch's own kernels (the mkl and torch candidates): a plan
# timed with MKL held to AVX2 does not hold for an unrestricted one
TORCH_ISA_ENV = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE",
                 "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def _cache_path(shapes: Dict[Tuple[int, int], int], attention: Tuple[int, ...],
                weight_types: Tuple[str, ...] = ()) -> "os.PathLike":
    isa = cpu_kernels.active_isa()
    # weights beyond float32 also run the quant kernels (GGUF blocks) in the timed choices
    quant = cpu_kernels.build_key(isa, quant_kernels.SOURCE) \
        if weight_types and quant_kernels.SOURCE else None
    key = json.dumps([cpu_kernels.build_key(isa), quant, isa, torch.get_num_threads(),
                      torch.__version__, sorted(shapes.items()), attention, BANDS, MARGIN,
                      TIMING_VERSION, [os.environ.get(name) for name in TORCH_ISA_ENV],
                      list(weight_types)])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return envs.VLLM_CACHE_ROOT / "cpu_kernels" / f"plan-{isa}-{digest}.json"


def plan_model(shapes: Dict[Tuple[int, int], int], heads: int, kv_heads: int, head_dim: int,
               layers: int, weight_types: Tuple[str, ...] = (),
               block_bytes: int = 0) -> KernelPlan:
    """The GEMM and attention choices for a model whose float32 GEMM weights have these shapes
    ((K, N) -> how many); decode_layer, int4 and quant_below are filled in later
    (choose_decode_layer, choose_int4, the model's crossover) or read from the cache.
    weight_types: what the weights are stored as beyond float32 (their GGUF types, and whether
    float32 layers are kept beside them), part of the cache key since the later choices depend
    on it; block_bytes: the bytes of the GEMM weights kept that way (they count towards a model
    too small to time)."""
    global _LAST_PLAN
    isa, forced = cpu_kernels.active_isa(), _forced()
    common = dict(isa=isa, cpu=cpu_kernels.cpu_name(), threads=torch.get_num_threads())
    bands = len(BANDS)
    small = sum(4 * k * n * c for (k, n), c in shapes.items()) + block_bytes < STREAM_BYTES
    if forced or small:
        path = forced or "c"
        last = "torch" if path == "mkl" else path        # MKL's packing needs a largest m
        plan = KernelPlan(**common, gemm={shape_name(*s): [path] * _LAST + [last] for s in shapes},
                          attention=["c"] * bands, source="forced" if forced else "small",
                          decode_layer=[path == "c"] * _LAST + [False])
    else:
        cache = _cache_path(shapes, (heads, kv_heads, head_dim, layers), weight_types)
        plan = _read(cache) or _timed(common, shapes, (heads, kv_heads, head_dim))
        plan.cache_path = str(cache)
    plan.extra_weight_bytes = _extra_bytes(plan, shapes)
    if plan.source in ("forced", "small"):
        logger.info("CPU kernel plan (%s, %s): %s", plan.isa, plan.source,
                    summary(plan.as_dict()))
    _LAST_PLAN = plan
    return plan


def _timed(common: dict, shapes: Dict[Tuple[int, int], int],
           attention_shape: Tuple[int, ...]) -> KernelPlan:
    """A plan from timings; the default C plan, not cached, if the host is too busy to time."""
    t0, bands, others = time.perf_counter(), len(BANDS), OthersCpu()
    try:
        timings = {shape_name(k, n): _time_gemm(k, n) for k, n in shapes}
        timings["attention"] = _time_attention(*attention_shape)
    except HostBusy:
        logger.warning("CPU kernel plan: host too busy to time kernels (other processes on our "
                       "cores); using the C path everywhere for this run, not cached")
        return KernelPlan(**common, gemm={shape_name(*s): ["c"] * bands for s in shapes},
                          attention=["c"] * bands, decode_layer=[True] * _LAST + [False],
                          source="busy", seconds=time.perf_counter() - t0)
    attention = [min(("c", "torch"), key=lambda p: timings["attention"][p][b])
                 for b in range(bands)]
    gemm = {name: _choose_gemm(t) for name, t in timings.items() if name != "attention"}
    return KernelPlan(**common, gemm=gemm, attention=attention, timings_ms=_to_ms(timings),
                      seconds=time.perf_counter() - t0, others_cores=others.cores())


def choose_decode_layer(plan: KernelPlan, step: Optional[Callable[[int, bool, bool],
                                                                  List[Callable[[], object]]]]):
    """Time step(m, fused, prefetch) -- callables that each run one layer of an m-row decode
    step, fused in C or per op, the C GEMMs prefetching their next panels or not -- at each band
    up to 128 rows: the fused layer with and without prefetch, and the per-op path with it, in
    LAYER_CALLS rounds. Keep the prefetch of the fused layer where it is PREFETCH_MARGIN faster
    in the median round (paired), and the faster of fused and per op likewise; cache the plan.
    The margin: one layer's calls misjudge the prefetch's cost in a whole step by a few
    percent either way, so a small win in single-layer rounds is no evidence; where the
    prefetch pays (from a few rows) it wins by far more than the margin. step None: the model
    has no fused layer (prefetch stays on)."""
    if plan.source != "timed":
        return
    t0, others = time.perf_counter(), OthersCpu()
    variants = {"fused": (True, True), "fused_no_prefetch": (True, False),
                "per_op": (False, True)}
    times = {name: [] for name in variants}
    prefetch, fused_wins = [], []
    try:
        for m in TIMED_ROWS[:_LAST] if step else ():
            rounds = _rounds(_round_robin({name: step(m, *args)
                                           for name, args in variants.items()}), LAYER_CALLS)
            for name in times:
                times[name].append(min(rounds[name]))
            on, off, per_op = rounds["fused"], rounds["fused_no_prefetch"], rounds["per_op"]
            prefetch.append(paired(on, off) <= 1.0 - PREFETCH_MARGIN)
            fused_wins.append(paired(on if prefetch[-1] else off, per_op) < 1.0)
    except HostBusy:
        logger.warning("CPU kernel plan: host too busy to time the decode layer; using the "
                       "fused C layer, not cached")
        plan.decode_layer, plan.source = [True] * _LAST + [False], "busy"
        return
    pad = len(BANDS) - len(times["fused"])
    plan.prefetch = prefetch + [True] * pad
    plan.decode_layer = fused_wins + [False] * pad
    plan.timings_ms["decode_layer"] = _to_ms(times)
    plan.seconds += time.perf_counter() - t0
    layer_cores = others.cores()          # the busier of the two timing windows counts
    if layer_cores is not None:
        plan.others_cores = max(plan.others_cores or 0.0, layer_cores)
    if plan.others_cores is not None and plan.others_cores > OTHERS_MAX_CORES:
        plan.source = "contended"
        logger.warning("CPU kernel plan: other processes used %.2f cores while kernels were "
                       "timed; using this plan for this run, not cached", plan.others_cores)
    else:
        _write(plan)
    logger.info("CPU kernel plan (%s, %d threads, timed in %.1f s): %s", plan.isa, plan.threads,
                plan.seconds, summary(plan.as_dict()))


def choose_int4(plan: Optional[KernelPlan], layers: List) -> bool:
    """torch's own 4-bit GEMM as an alternative to the GGUF blocks: for each shape of the
    QuantLinears whose weights map onto it (Q4_0 / Q4_1, quant_linear.int4_layout), time both at
    each band up to 128 rows, the model's layers of that shape in turn (so that the weights
    stream from memory), in CALLS rounds; torch's runs a band where it is MARGIN faster in the
    median round (paired), as a second weight layout must be, and such a band runs per op (the
    fused C decode layer multiplies the blocks). Layouts of shapes that win no band are dropped.
    A cached plan's choice is reused; a choice timed on a busy host is used for this load only.
    A busy host, a forced plan, no plan, or 4-bit weights under a quarter of STREAM_BYTES in all
    (test models: per-op overhead, not the weight stream, would decide; the default model has
    53 MB) keep the blocks. -> whether a choice was timed into the plan (not read from it)."""
    from vllm.model_executor.quant_linear import int4_layout
    by_shape: Dict[str, List] = {}
    for lin in layers:
        if lin.int4_source is not None:
            by_shape.setdefault(shape_name(lin.in_features, lin.out_features), []).append(lin)
    nbytes = sum(lin.in_features * lin.out_features // 2 for lins in by_shape.values()
                 for lin in lins)
    timed = plan is not None and plan.source not in ("forced", "busy") and \
        nbytes >= STREAM_BYTES // 4
    added = False
    for name, lins in by_shape.items() if timed else ():
        for lin in lins:
            lin.int4 = int4_layout(lin.int4_source)
        wins = plan.int4.get(name) if plan.source == "cache" else None
        if wins is None:
            try:
                wins = plan.int4[name] = _int4_wins(lins)
                added = True
            except HostBusy:
                wins = [False] * len(BANDS)             # this load only: not in the plan
        bands = tuple(b for b, win in enumerate(wins) if win)
        for lin in lins:
            lin.int4, lin.int4_bands = (lin.int4, bands) if bands else (None, ())
        for b in bands:
            plan.decode_layer[b] = False
    for lin in layers:
        lin.int4_source = None
    if by_shape and timed:
        logger.info("CPU kernel plan: torch's 4-bit GEMM in bands %s",
                    {name: list(lins[0].int4_bands) for name, lins in by_shape.items()})
    return added


def _int4_wins(lins: List) -> List[bool]:
    """Per band: torch's 4-bit GEMM MARGIN faster than the blocks (the last band: as 128 rows)."""
    wins = []
    for m in TIMED_ROWS[:_LAST]:
        x = torch.randn(m, lins[0].in_features)
        rounds = _rounds(_round_robin({
            "blocks": [lambda lin=lin: lin.blocks_gemm(x) for lin in lins],
            "int4": [lambda lin=lin: lin.int4_gemm(x) for lin in lins]}), CALLS)
        wins.append(paired(rounds["int4"], rounds["blocks"]) <= 1.0 - MARGIN)
    return wins + wins[-1:]


def summary(plan: dict) -> str:
    """An as_dict() plan in one line: 'gemm 576x960 c c c c c c c c; attention c ...;
    decode_layer 1 1 ...; prefetch 0 1 ... (bands 1 4 ... 256 rows)'."""
    rows = [f"gemm {name} {' '.join(paths)}" for name, paths in plan["gemm"].items()]
    rows.append(f"attention {' '.join(plan['attention'])}")
    rows.append(f"decode_layer {' '.join(str(int(f)) for f in plan['decode_layer'])}")
    rows.append(f"prefetch {' '.join(str(int(f)) for f in plan['prefetch'])}")
    return "; ".join(rows) + f" (bands {' '.join(str(m) for m in TIMED_ROWS)} rows)"


def _extra_bytes(plan: KernelPlan, shapes: Dict[Tuple[int, int], int]) -> int:
    total = 0
    for (k, n), count in shapes.items():
        paths = plan.gemm[shape_name(k, n)]
        layouts = {p for p in paths if p != "mkl"}
        mkl_ratio = 4.0 if "mkl" in paths else 0.0       # about 2.7-4.3x per band
        total += count * 4 * k * n * (max(len(layouts) - 1, 0) + mkl_ratio * paths.count("mkl"))
    return int(total)


def _to_ms(times: Dict) -> Dict:
    if isinstance(times, dict):
        return {k: _to_ms(v) for k, v in times.items()}
    return [round(t * 1e3, 4) if math.isfinite(t) else None for t in times]


def _read(path) -> Optional[KernelPlan]:
    try:
        data = json.loads(path.read_text())
        fields = {k: v for k, v in data.items() if k in KernelPlan.__dataclass_fields__}
        plan = KernelPlan(**{**fields, "source": "cache"})
    except (OSError, ValueError, TypeError):
        return None
    plan.cache_path = str(path)
    logger.info("CPU kernel plan (%s) from %s: %s", plan.isa, path, summary(plan.as_dict()))
    return plan


def remember(plan: Optional[KernelPlan]) -> None:
    """Cache the plan again with the choices made after its GEMMs were timed (int4, the weight
    twin's crossover), where it came from the cache or was timed quietly."""
    if plan is not None and plan.cache_path and plan.source in ("timed", "cache"):
        _write(plan)


def too_busy(others: "OthersCpu") -> bool:
    """Other processes used more than OTHERS_MAX_CORES while `others` watched: a timing then
    is used for this load only."""
    cores = others.cores()
    return cores is not None and cores > OTHERS_MAX_CORES


def _write(plan: KernelPlan) -> None:
    path = envs.VLLM_CACHE_ROOT / "cpu_kernels" / os.path.basename(plan.cache_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(plan.as_dict(), indent=1))
    tmp.replace(path)
