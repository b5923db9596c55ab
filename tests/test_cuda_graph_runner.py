"""CudaGraphRunner's CPU-testable part: bucket choice, padding through the static buffers and
slicing of results, run in its eager mode (the model called directly on the full-size static
buffers at the padded batch size, exactly what a graph replays). Greedy tokens must be identical
to the unpadded eager engine, with and without the attention-mass variant, on the C kernels, the
torch path and the Triton kernels (interpreted). Capture and replay themselves: tests/gpu."""
import os

import pytest
import torch

if not torch.cuda.is_available():   # before any triton kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.conftest import random_prompts  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.kernels import ops  # noqa: E402
from vllm.attention.backend import AttentionMetadata, PrefillSpan  # noqa: E402
from vllm.worker.cuda_graph_runner import CudaGraphRunner, bucket_for, capture_sizes  # noqa: E402


def test_capture_sizes_follow_upstream_and_end_at_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(256)[-3:] == [240, 248, 256] and len(capture_sizes(256)) == 35


@pytest.mark.parametrize("batch,bucket", [(1, 1), (3, 4), (4, 4), (5, 8), (17, 20), (20, 20),
                                          (21, None), (0, None)])
def test_bucket_is_the_smallest_size_that_fits(batch, bucket):
    assert bucket_for(batch, capture_sizes(20)) == bucket


MAX_SEQS = 6      # buckets 1, 2, 4, 6: batches 3 and 5 run padded
EVICT = dict(kv_eviction_policy="h2o", kv_eviction_ratio=0.5, kv_min_tokens=0,
             kv_reclamation="vtoken", kv_check_invariants=True)


def generate(model, prompts, params, graphs: bool, **kw):
    llm = LLM(model, max_num_seqs=MAX_SEQS, num_gpu_blocks_override=64, **kw)
    eng = llm.llm_engine
    runner = None
    if graphs:
        runner = eng.runner.graphs = CudaGraphRunner(eng.model, eng.kv_caches, eng.runner.buffers,
                                                     MAX_SEQS, eager=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if kw.get("kv_check_invariants"):
        eng.check_invariants()
    return [o.outputs[0].token_ids for o in outs], runner, llm.get_kv_stats()


@pytest.mark.parametrize("backend", [None, "torch", "triton"])
@pytest.mark.parametrize("evict", [False, True], ids=["native", "h2o-vtoken"])
def test_padded_bucket_decode_is_token_identical(tiny_llama, backend, evict):
    triton_steps = backend == "triton"
    if triton_steps and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need the Triton interpreter (set before triton is imported)")
    n = 4 if triton_steps else MAX_SEQS       # the interpreter is slow: fewer, shorter requests
    prompts = random_prompts(n, seed=3, lo=20, hi=50)
    # staggered lengths: the batch shrinks 6 -> 1 (4 -> 1), through padded buckets 5 -> 6, 3 -> 4
    params = [SamplingParams(temperature=0, max_tokens=(3 if triton_steps else 6) + 4 * i,
                             ignore_eos=True) for i in range(n)]
    kw = EVICT if evict else {}
    with ops.forced_backend(backend):
        plain, _, _ = generate(tiny_llama, prompts, params, graphs=False, **kw)
        padded, runner, stats = generate(tiny_llama, prompts, params, graphs=True, **kw)
    assert padded == plain
    runs = runner.stats()["runs"]
    assert set(runs) == {(g, evict) for g in ([1, 2, 4, 6] if n == MAX_SEQS else [1, 2, 4])}
    assert runner.replays == 0 and not runner.graphs          # eager mode: nothing captured
    if evict:
        assert stats["relocation_events"] > 0                 # copies ran between the steps


def test_runner_takes_decode_only_steps_up_to_its_largest_bucket(tiny_llama):
    llm = LLM(tiny_llama, max_num_seqs=MAX_SEQS, num_gpu_blocks_override=64)
    eng = llm.llm_engine
    runner = CudaGraphRunner(eng.model, eng.kv_caches, eng.runner.buffers, 4, eager=True)
    assert runner.sizes == [1, 2, 4]
    span = PrefillSpan(0, 3, torch.arange(3), None)
    meta = lambda b, prefills=(): AttentionMetadata(  # noqa: E731
        torch.arange(b), b, torch.zeros(b, 1, dtype=torch.int64), torch.ones(b), list(prefills))
    assert runner.bucket(meta(2), 2) == 2 and runner.bucket(meta(3), 3) == 4
    assert runner.bucket(meta(1, [span]), 4) is None          # a prompt chunk in the step
    assert runner.bucket(meta(0, [span]), 3) is None
    assert runner.bucket(meta(5), 5) is None                  # past the largest bucket
    for i, p in enumerate(random_prompts(5, seed=1, lo=5, hi=9)):
        eng.add_request(str(i), {"prompt_token_ids": p},
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.step()                                                # the prompts (and first tokens)
    sched = eng.scheduler.schedule()                          # a decode step of 5 rows
    assert [n for _, n in sched.scheduled] == [1] * 5
    build = eng.input_builder.build
    assert not runner.accepts(eng.runner.prepare_inputs(build(sched.scheduled)[0]))
    inp = eng.runner.prepare_inputs(build(sched.scheduled[:3])[0])
    assert runner.accepts(inp)
    hidden = runner.run(inp)
    assert hidden.shape == (3, eng.model.config.hidden_size)  # the real rows only
    assert runner.runs == {(4, False): 1}
    assert eng.runner.buffers.view_lens[3:].eq(0).all()       # row 4 of bucket 4: padding
    assert eng.runner.buffers.slot_mapping[3:].eq(-1).all()
    eng.abort_request([str(i) for i in range(5)])


class FakeCuda:
    """torch.cuda's stream and graph calls as _capture makes them, on CPU: streams are names,
    a graph records its capture, capture number `fail_at` raises in capture_end (as a capture
    invalidated by a host sync does)."""

    def __init__(self, monkeypatch, fail_at=None):
        self.current, self.fail_at, self.begins, self.pools = "main", fail_at, [], []
        fake = self

        class Stream:
            def __init__(self):
                self.name = f"side{len(fake.begins)}"

            def wait_stream(self, other):
                pass

        class Graph:
            def capture_begin(self, pool=None, capture_error_mode=None):
                assert fake.current != "main" and capture_error_mode == "thread_local"
                fake.begins.append((fake.current, pool))

            def capture_end(self):
                if len(fake.begins) == fake.fail_at:
                    raise RuntimeError("CUDA error: operation not permitted when stream is "
                                       "capturing")

        main = Stream()
        main.name = "main"
        calls = dict(current_stream=lambda: main if fake.current == "main" else fake.current,
                     set_stream=lambda s: setattr(fake, "current", s.name if s is main else s),
                     Stream=Stream, CUDAGraph=Graph, synchronize=lambda: None,
                     empty_cache=lambda: None, mem_get_info=lambda: (0, 0),
                     graph_pool_handle=lambda: fake.pools.append(object()) or fake.pools[-1])
        for name, fn in calls.items():
            monkeypatch.setattr(torch.cuda, name, fn)


def capturing_runner(tiny_llama):
    llm = LLM(tiny_llama, max_num_seqs=MAX_SEQS, num_gpu_blocks_override=64)
    eng = llm.llm_engine
    runner = CudaGraphRunner(eng.model, eng.kv_caches, eng.runner.buffers, MAX_SEQS)
    runner.eager = False                  # as on CUDA: capture_all captures
    return llm, runner


def test_capture_all_captures_every_bucket_at_start_up(tiny_llama, monkeypatch, capsys):
    """Both variants of every bucket, largest first, one pool, a progress line; the stream is
    the caller's again after each capture; the padding-only capture writes no KV."""
    llm, runner = capturing_runner(tiny_llama)
    fake = FakeCuda(monkeypatch)
    kv_before = llm.llm_engine.kv_caches.clone()
    runner.capture_all()
    order = [(g, m) for g in (6, 4, 2, 1) for m in (False, True)]
    assert list(runner.graphs) == order and not runner.disabled
    assert len(fake.pools) == 1 and all(pool is fake.pools[0] for _, pool in fake.begins)
    assert len(fake.begins) == len(order) and fake.current == "main"
    assert torch.equal(llm.llm_engine.kv_caches, kv_before)
    assert "Capturing CUDA graphs" in capsys.readouterr().err
    runner.capture_all()                  # once only
    assert len(fake.begins) == len(order)


def test_a_failed_capture_restores_the_stream_and_turns_graphs_off(tiny_llama, monkeypatch,
                                                                  caplog):
    prompts = random_prompts(4, seed=5, lo=10, hi=30)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm, runner = capturing_runner(tiny_llama)
    plain = [o.outputs[0].token_ids for o in
             llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    fake = FakeCuda(monkeypatch, fail_at=3)
    with caplog.at_level("WARNING", logger="vllm.worker.cuda_graph_runner"):
        runner.capture_all(progress=False)
    assert fake.current == "main" and runner.disabled and not runner.graphs
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "CUDA graphs are off" in warnings[0].getMessage()
    llm.llm_engine.runner.graphs = runner
    again = [o.outputs[0].token_ids for o in
             llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert again == plain and not runner.runs       # every step ran eagerly
