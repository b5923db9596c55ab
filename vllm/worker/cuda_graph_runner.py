"""CudaGraphRunner: decode-only steps replayed from CUDA graphs, one per padded batch size.

A step of B decode rows (no prompt tokens) runs the graph of the smallest bucket G >= B:

    buckets   1, 2, 4, 8, 16, 24, 32, ... (multiples of 8), and max_num_seqs last
              max_num_seqs 20 -> [1, 2, 4, 8, 16, 20];  B = 5 -> G = 8

over the full-size static buffers of InputBuffers, which keep everything past a step's extent
as padding, so rows B..G-1 are padding rows by construction:

    input_ids[:G]     0 past B                 slot_mapping[:G]  -1 past B (writes nothing)
    positions[:G]     0 past B                 view_lens[:G]     0 past B (attends to nothing)
    view_slots[:G, :] the full width max_view_len (= --max-model-len); -1 past each row's
                      length. The Triton decode kernel iterates to view_lens[b], so the unused
                      width costs no loads (the mass kernel too stops at each row's length:
                      nothing scales with the width).
    mass[:G, :]       float32, this runner's own; zeroed at the start of every replay

Every bucket has two graphs, both captured at start-up (Worker.initialize_cache, after the KV
pool is sized, as upstream does): without the decode mass (Native, score-free policies) and with
it (H2O, TOVA, ...: policies that score with attention; per-request policies may ask for it in
any step). Two variants rather than always computing the mass, so that steps which collect no
statistics pay nothing for them, as in eager mode. The mass variant copies mass[:B, :width] into
the step's own meta.decode_mass after replay, so the runner's statistics path is the eager one.
Capture runs largest bucket first, all graphs in one memory pool, each after warm-up forwards on
the capture stream over the padding-only buffers (slot -1 writes nothing, length 0 reads
nothing), with a progress line.

Capture needs a decode path that never waits on the host (no .item(), no boolean-mask
indexing: the Triton write_kv and decode kernels). A capture that raises (torch.cuda.graph's
context manager would leave torch on the capture stream: _capture sets and restores the stream
itself) drops every graph, restores the stream and turns graphs off with one warning: every
step then runs eagerly.

`run` replays after the relocation executor's pre_attention (the compute stream waits on the
copies whose moves the step's views already use) and returns the hidden states of the B real
rows (a copy: the graph's output is overwritten by the next replay). eager=True (and always
off CUDA) calls the model directly on the same static buffers at the bucket size, which is how
CPU tests check that padding changes no token.
"""
import bisect
import collections
import gc
import logging
import time
from typing import Dict, List, Optional, Tuple

import torch

from vllm.attention.backend import AttentionMetadata
from vllm.worker.input_buffers import InputBuffers

logger = logging.getLogger(__name__)
WARMUP_FORWARDS = 2


def capture_sizes(max_num_seqs: int) -> List[int]:
    """The padded batch sizes graphs are captured for (upstream vLLM's, capped)."""
    assert max_num_seqs >= 1
    small = [s for s in (1, 2, 4) if s < max_num_seqs]
    return small + list(range(8, max_num_seqs, 8)) + [max_num_seqs]


def bucket_for(batch: int, sizes: List[int]) -> Optional[int]:
    """The smallest size >= batch, or None when the batch is larger than every size."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if batch >= 1 and i < len(sizes) else None


class _Graph:
    """One captured decode forward: the graph, its static output and its static metadata."""

    def __init__(self, graph, hidden: torch.Tensor, meta: AttentionMetadata):
        self.graph, self.hidden, self.meta = graph, hidden, meta


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: torch.Tensor, buffers: InputBuffers,
                 max_num_seqs: int, eager: bool = False):
        self.model = model
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.sizes = capture_sizes(min(max_num_seqs, buffers.max_seqs, buffers.max_tokens))
        self.eager = eager or not kv_caches.is_cuda
        self.mass = torch.zeros(buffers.max_seqs, buffers.max_view_len, dtype=torch.float32,
                                device=kv_caches.device)
        self.graphs: Dict[Tuple[int, bool], _Graph] = {}
        self.disabled = False              # a capture failed: every step runs eagerly
        self.pool = None                   # one memory pool for every graph
        self.replays = 0                   # graph replays
        self.runs = collections.Counter()  # (bucket, mass) -> steps run, replayed or eager

    # ---- which steps ----------------------------------------------------------------------------
    def bucket(self, meta: AttentionMetadata, num_tokens: int) -> Optional[int]:
        """The bucket of a decode-only step (one token per row, no prompt spans), else None."""
        b = meta.num_decodes
        if meta.prefills or b == 0 or b != num_tokens:
            return None
        return bucket_for(b, self.sizes)

    def accepts(self, inp) -> bool:
        """Whether `run` takes this ModelInput (the runner's own steps run eagerly otherwise)."""
        # a sliding window's views are derived per step (AttentionMetadata.for_layer): eager
        return not self.disabled and inp.meta.window_skip is None and \
            inp.meta.sliding is None and \
            self.bucket(inp.meta, inp.input_ids.shape[0]) is not None

    # ---- one step ---------------------------------------------------------------------------
    def run(self, inp, relocation=None) -> torch.Tensor:
        """The decode step `inp` (buffers already updated) at its bucket: hidden [B, hidden]."""
        meta = inp.meta
        b = meta.num_decodes
        g = self.bucket(meta, inp.input_ids.shape[0])
        want_mass = meta.decode_mass is not None
        assert g is not None and self.buffers.num_seqs == b, "not a decode-only step"
        if relocation is not None:
            relocation.pre_attention()     # replay after the copies its views rely on
        hidden = self._forward(g, want_mass)
        if want_mass:
            meta.decode_mass.copy_(self.mass[:b, :meta.decode_mass.shape[1]])
        return hidden[:b].clone()

    def _forward(self, g: int, want_mass: bool) -> torch.Tensor:
        self.runs[(g, want_mass)] += 1
        if self.eager:
            return self._static_forward(self._static_meta(g, want_mass), g)
        entry = self.graphs[(g, want_mass)]
        entry.graph.replay()
        self.replays += 1
        return entry.hidden

    def _static_meta(self, g: int, want_mass: bool) -> AttentionMetadata:
        buf = self.buffers
        return AttentionMetadata(slot_mapping=buf.slot_mapping[:g], num_decodes=g,
                                 decode_views=buf.view_slots[:g], decode_lens=buf.view_lens[:g],
                                 decode_mass=self.mass[:g] if want_mass else None)

    def _static_forward(self, meta: AttentionMetadata, g: int) -> torch.Tensor:
        if meta.decode_mass is not None:
            meta.decode_mass.zero_()
        return self.model(self.buffers.input_ids[:g], self.buffers.positions[:g],
                          self.kv_caches, meta)

    # ---- capture (CUDA only) ----------------------------------------------------------------
    def capture_all(self, progress: bool = True) -> None:
        """Both variants of every bucket, largest first, into one pool; on the first failure,
        no graphs at all (see the module docstring)."""
        if self.eager or self.graphs or self.disabled:
            return
        todo = [(g, mass) for g in reversed(self.sizes) for mass in (False, True)]
        start, before = time.perf_counter(), torch.cuda.mem_get_info()[0]
        torch.cuda.synchronize()
        gc.collect()
        self.pool = torch.cuda.graph_pool_handle()
        for g, mass in _progress(todo, progress):
            try:
                self.graphs[(g, mass)] = self._capture(g, mass)
            except Exception as e:   # noqa: BLE001  (a model path that cannot be captured)
                self._disable(g, mass, e)
                return
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s, %.2f GiB",
                    len(self.graphs), self.sizes[-1], self.sizes[0],
                    time.perf_counter() - start,
                    (before - torch.cuda.mem_get_info()[0]) / 2**30)

    def _disable(self, g: int, mass: bool, error: Exception) -> None:
        logger.warning("CUDA graph capture failed for batch %d%s (%s: %s); CUDA graphs are off, "
                       "every step runs eagerly", g, " with attention mass" if mass else "",
                       type(error).__name__, error)
        self.disabled = True
        self.graphs.clear()
        self.pool = None
        torch.cuda.empty_cache()

    def _capture(self, g: int, want_mass: bool) -> _Graph:
        """One graph on a side stream; the caller's stream is current again afterwards, whether
        the capture succeeded or raised."""
        meta = self._static_meta(g, want_mass)
        caller = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(caller)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.set_stream(side)
        try:
            for _ in range(WARMUP_FORWARDS):     # compile kernels, settle the allocator
                self._static_forward(meta, g)
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                hidden = self._static_forward(meta, g)
            finally:
                graph.capture_end()              # ends the stream's capture even on failure
        finally:
            torch.cuda.set_stream(caller)
        caller.wait_stream(side)
        return _Graph(graph, hidden, meta)

    def stats(self) -> dict:
        return {"graphs": sorted(self.graphs), "disabled": self.disabled,
                "replays": self.replays, "runs": dict(self.runs)}


def _progress(items: list, show: bool):
    """items with a progress line on stderr (upstream prints one while capturing)."""
    if not show:
        return items
    from tqdm import tqdm
    return tqdm(items, desc="Capturing CUDA graphs (decode)", unit="graph")
