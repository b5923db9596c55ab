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

Each bucket has up to two graphs, captured the first time a step needs them: without the
decode mass (Native, score-free policies) and with it (H2O, TOVA, ...: policies that score
with attention). Two variants rather than always computing the mass, so that steps which
collect no statistics pay nothing for them, as in eager mode. The mass variant copies
mass[:B, :width] into the step's own meta.decode_mass after replay, so the runner's statistics
path is the eager one. Graphs share one memory pool; each is captured after a warm-up forward
on a side stream (kernel compilation, allocator state), with the step's own inputs already in
the buffers, which is harmless: the warm-up writes the same K/V to the same slots as the
replay, and the mass is zeroed inside the graph.

Capture needs a decode path that never waits on the host (no .item(), no boolean-mask
indexing: the Triton write_kv and decode kernels); a capture that raises is logged once and
its bucket runs eagerly from then on.

`run` replays after the relocation executor's pre_attention (the compute stream waits on the
copies whose moves the step's views already use) and returns the hidden states of the B real
rows (a copy: the graph's output is overwritten by the next replay). eager=True (and always
off CUDA) calls the model directly on the same static buffers at the bucket size, which is how
CPU tests check that padding changes no token.
"""
import bisect
import collections
import logging
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
        self.failed: set = set()           # (bucket, mass) whose capture raised: run eagerly
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
        g = self.bucket(inp.meta, inp.input_ids.shape[0])
        return g is not None and (g, inp.meta.decode_mass is not None) not in self.failed

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
        if self.eager or (g, want_mass) in self.failed:
            return self._static_forward(self._static_meta(g, want_mass), g)
        entry = self.graphs.get((g, want_mass))
        if entry is None:
            try:
                entry = self.graphs[(g, want_mass)] = self._capture(g, want_mass)
            except Exception as e:   # noqa: BLE001  (a model path that cannot be captured)
                logger.warning("CUDA graph capture failed for batch %d%s (%s: %s); that step "
                               "size runs eagerly", g, " with attention mass" if want_mass
                               else "", type(e).__name__, e)
                self.failed.add((g, want_mass))
                return self._static_forward(self._static_meta(g, want_mass), g)
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
    def _capture(self, g: int, want_mass: bool) -> _Graph:
        meta = self._static_meta(g, want_mass)
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):     # compile kernels and settle the allocator first
            for _ in range(WARMUP_FORWARDS):
                self._static_forward(meta, g)
        current.wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            hidden = self._static_forward(meta, g)
        logger.info("captured the decode CUDA graph for batch %d%s", g,
                    " with attention mass" if want_mass else "")
        return _Graph(graph, hidden, meta)

    def stats(self) -> dict:
        return {"graphs": sorted(self.graphs), "failed": sorted(self.failed),
                "replays": self.replays, "runs": dict(self.runs)}
