"""On CUDA: a captured decode-attention graph keeps replaying after relocation. The slot views
live in persistent InputBuffers rewritten in place; no recapture. Skipped without CUDA."""
import numpy as np
import pytest
import torch

from tests.kernel_refs import decode_reference, rel_err
from vllm import _custom_ops as ops
from vllm.worker.input_buffers import InputBuffers
from vllm.worker.relocation import RelocationExecutor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
B, H, KVH, D, SLOTS, WIDTH = 4, 8, 2, 64, 1024, 96


def step(bufs, views):
    n = len(views)
    bufs.update(np.zeros(n, np.int64), np.arange(n), np.arange(n) + SLOTS - n, views)


def check(out, mass, q, kv, views):
    slots = torch.full((len(views), WIDTH), -1, dtype=torch.int64)
    for i, v in enumerate(views):
        slots[i, :len(v)] = torch.from_numpy(v)
    lens = torch.tensor([len(v) for v in views])
    ref_out, ref_mass = decode_reference(q[:len(views)].cpu(), kv[0].cpu(), slots, lens, 0.125)
    assert rel_err(out[:len(views)].cpu(), ref_out) < 1e-5
    assert rel_err(mass[:len(views)].cpu(), ref_mass) < 1e-5


def test_graph_replays_after_relocation_without_recapture():
    rng = np.random.default_rng(0)
    kv = torch.randn(1, SLOTS, 2, KVH, D, device="cuda")
    q = torch.randn(B, H, D, device="cuda")
    bufs = InputBuffers(max_tokens=B, max_seqs=B, max_view_len=WIDTH, device="cuda")
    views = [np.sort(rng.choice(512, n, replace=False)) for n in (90, 40, 7, 64)]
    step(bufs, views)
    mass = torch.zeros(B, WIDTH, device="cuda")
    run = lambda: ops.decode_attention(q, kv[0], bufs.view_slots, bufs.view_lens, 0.125, mass,
                                       backend="triton")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):            # compile and warm up outside the capture
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    addresses = (bufs.view_slots.data_ptr(), bufs.view_lens.data_ptr())

    ex = RelocationExecutor(kv)
    for round_ in range(3):                  # relocate, rewrite the views in place, replay
        src = views[0][:20]
        dst = np.arange(600 + 20 * round_, 620 + 20 * round_)
        event = ex.submit(torch.from_numpy(src), torch.from_numpy(dst))
        while not event.query():
            pass
        views[0] = np.concatenate([dst, views[0][20:]])     # apply_moves: new slots, same order
        views = views[:4 - round_]                            # fewer rows: the rest is padding
        step(bufs, views)
        ex.pre_attention()
        mass.zero_()
        graph.replay()
        check(out, mass, q, kv, views)
        assert (bufs.view_slots.data_ptr(), bufs.view_lens.data_ptr()) == addresses
        assert (bufs.view_slots[len(views):] == -1).all()
        assert (bufs.view_lens[len(views):] == 0).all()
