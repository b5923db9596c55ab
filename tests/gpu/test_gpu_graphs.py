"""On CUDA: CUDA graphs for decode. A captured decode-attention graph keeps replaying after
relocation (views rewritten in place, no recapture); a replayed decode step equals the
eager forward over the same static buffers; and the engine with graphs (the default) gives the
same greedy tokens as --enforce-eager, Native and H2O + vToken (the attention-mass variant),
with padded buckets replayed. Skipped without CUDA."""
import numpy as np
import pytest
import torch

from tests.conftest import random_prompts
from tests.kernel_refs import decode_reference, rel_err
from vllm import LLM, SamplingParams
from vllm.kernels import ops
from vllm.worker.cuda_graph_runner import CudaGraphRunner
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
        event = ex.submit(round_, torch.from_numpy(src), torch.from_numpy(dst))
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


GREEDY = [SamplingParams(temperature=0, max_tokens=12 + 6 * i, ignore_eos=True) for i in range(6)]
EVICT = dict(kv_eviction_policy="h2o", kv_eviction_ratio=0.5, kv_min_tokens=0,
             kv_reclamation="vtoken", kv_check_invariants=True)


def engine(model, enforce_eager, **kw):
    return LLM(model, device="cuda", dtype="float32", max_num_seqs=6, num_gpu_blocks_override=96,
               enforce_eager=enforce_eager, **kw)


def test_replay_equals_the_eager_forward_on_the_static_buffers(tiny_llama):
    """Same kernels, same static inputs: a replayed bucket equals calling the model directly."""
    llm = engine(tiny_llama, enforce_eager=True)
    eng = llm.llm_engine
    prompts = random_prompts(3, seed=4, lo=20, hi=40)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), {"prompt_token_ids": p}, GREEDY[0])
    eng.step()                                                # all three prompts, first tokens
    sched = eng.scheduler.schedule()
    assert [n for _, n in sched.scheduled] == [1, 1, 1]      # a decode-only step
    step, _ = eng.input_builder.build(sched.scheduled, eng.kv.score_request(sched.scheduled))
    inp = eng.runner.prepare_inputs(step)
    graphs = CudaGraphRunner(eng.model, eng.kv_caches, eng.runner.buffers, 6)
    eager = CudaGraphRunner(eng.model, eng.kv_caches, eng.runner.buffers, 6, eager=True)
    assert graphs.accepts(inp) and graphs.bucket(inp.meta, 3) == 4
    with torch.inference_mode():
        a = eager.run(inp)
        graphs.capture_all(progress=False)                     # every bucket, both variants
        b = graphs.run(inp)                                    # replays
        c = graphs.run(inp)                                    # replays again
    assert graphs.replays == 2 and not graphs.disabled
    assert sorted(graphs.graphs) == [(g, m) for g in (1, 2, 4, 6) for m in (False, True)]
    assert a.shape[0] == 3 and torch.equal(b, c)
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)   # same kernels on the same inputs
    eng.abort_request([str(i) for i in range(3)])


@pytest.mark.parametrize("evict", [False, True], ids=["native", "h2o-vtoken"])
def test_engine_graphs_match_enforce_eager(tiny_llama, evict):
    prompts = random_prompts(6, seed=3, lo=20, hi=60)
    kw = EVICT if evict else {}
    outs = {}
    for eager in (True, False):
        # views of at most 120 slots: graphs (full width) and eager steps (this step's width)
        # both get one split of the decode kernel, so their sums run in the same order
        llm = engine(tiny_llama, enforce_eager=eager, max_model_len=120, **kw)
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        outs[eager] = [o.outputs[0].token_ids for o in res]
        graphs = llm.llm_engine.runner.graphs
        if eager:
            assert graphs is None
        else:
            # captured at start-up: every bucket, with and without the mass; the batch shrinks
            # 6 -> 1 through buckets 6, 4 (batch 3: padded), 2, 1, all replayed
            assert sorted(graphs.graphs) == [(g, m) for g in (1, 2, 4, 6) for m in (False, True)]
            assert not graphs.disabled and {m for _, m in graphs.runs} == {evict}
            assert graphs.replays == sum(graphs.runs.values()) > 0
        if evict:
            llm.llm_engine.check_invariants()
            assert llm.get_kv_stats()["relocation_events"] > 0
    assert outs[False] == outs[True]
