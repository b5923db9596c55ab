"""Sizing the CUDA KV pool, checked on the CPU: the accounting of _num_gpu_blocks against a fake
torch.cuda memory API (the profiled peak, memory outside torch, the runner's buffers), and the
profiling forward's steps (first chunks and the largest continued chunk over a long context)."""
from types import SimpleNamespace

import pytest
import torch

from vllm.worker import worker as worker_mod
from vllm.worker.cuda_graph_runner import CudaGraphRunner
from vllm.worker.input_buffers import InputBuffers
from vllm.worker.model_runner import profile_forward, profile_steps
from vllm.worker.worker import Worker, runner_buffer_bytes

MIB = 1 << 20


def test_runner_buffer_bytes_is_what_the_runner_allocates():
    """The exact bytes of InputBuffers as the CUDA runner lays them out (staged: device buffers,
    the view table and the patch staging area), and the mass tables (CudaGraphRunner's and a
    step's decode mass)."""
    t, s, w = 48, 5, 37
    buffers = InputBuffers(t, s, w, "cpu", staging=2)     # the CUDA layout, on CPU tensors
    held = sum(v.numel() * v.element_size() for v in buffers._dev.values()) + \
        buffers.view_slots.numel() * buffers.view_slots.element_size()
    mass = torch.zeros(s, w, dtype=torch.float32)          # a step's decode mass
    assert runner_buffer_bytes(t, s, w, graphs=False) == held + mass.nbytes
    kv = torch.zeros(1, 8, 2, 1, 4)
    graph_mass = CudaGraphRunner(None, kv, buffers, s, eager=True).mass
    assert runner_buffer_bytes(t, s, w, graphs=True) == held + mass.nbytes + graph_mass.nbytes


def _fake_worker(enforce_eager: bool, world_size: int = 1, block_bytes: int = 2 * MIB):
    w = Worker.__new__(Worker)
    w.config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8192, max_model_len=131072,
                                         max_num_seqs=64),
        cache_config=SimpleNamespace(gpu_memory_utilization=0.9),
        model_config=SimpleNamespace(enforce_eager=enforce_eager))
    w.tp = SimpleNamespace(world_size=world_size)
    w.model = object()
    w.gpu_memory_profile = None
    w.block_bytes = lambda: block_bytes
    return w


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_gpu_block_count_includes_the_runner_buffers(monkeypatch, enforce_eager):
    gib = 1 << 30
    total, free, scratch = 80 * gib, 60 * gib, 3 * gib
    max_alloc, alloc = 18 * gib + 123 * MIB, 17 * gib     # peak and live, torch's allocator
    calls = []
    fake = dict(empty_cache=lambda: None, reset_peak_memory_stats=lambda: calls.append("reset"),
                synchronize=lambda: None, max_memory_allocated=lambda: max_alloc,
                mem_get_info=lambda: (free, total), memory_allocated=lambda: alloc)
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)

    def fake_profile(model, num_tokens, max_model_len, num_seqs):
        calls.append((num_tokens, max_model_len, num_seqs))
        return scratch
    monkeypatch.setattr(worker_mod, "profile_forward", fake_profile)

    w = _fake_worker(enforce_eager)
    blocks = w._num_gpu_blocks()
    assert calls == ["reset", (8192, 131072, 64)]
    grid = 64 * 131072
    chunk = 8192 + 2 * 64                                # patch_chunk
    buffers = 8 * (3 * 8192 + 64 + 2 * chunk + grid) + 4 * grid * (1 if enforce_eager else 2)
    peak = max_alloc - scratch
    outside = total - free - alloc
    assert blocks == (int(total * 0.9) - peak - outside - buffers) // (2 * MIB)
    assert w.gpu_memory_profile == {"total": total, "peak": peak, "outside": outside,
                                    "buffers": buffers}
    # without the buffers it would have promised more blocks than fit
    assert blocks < worker_mod.kv_blocks_for_memory(total, peak + outside, 0.9, 2 * MIB)


def test_gpu_block_count_no_graph_mass_with_tensor_parallelism(monkeypatch):
    for name, fn in dict(empty_cache=lambda: None, reset_peak_memory_stats=lambda: None,
                         synchronize=lambda: None, max_memory_allocated=lambda: 0,
                         mem_get_info=lambda: (1 << 36, 1 << 36),
                         memory_allocated=lambda: 0).items():
        monkeypatch.setattr(torch.cuda, name, fn)
    monkeypatch.setattr(worker_mod, "profile_forward", lambda *a: 0)
    w = _fake_worker(enforce_eager=False, world_size=2)
    w._num_gpu_blocks()
    assert w.gpu_memory_profile["buffers"] == runner_buffer_bytes(8192, 64, 131072, graphs=False)


@pytest.mark.parametrize("num_tokens,max_model_len", [(16, 64), (70, 32), (24, 24)])
def test_profile_steps_include_the_largest_continued_chunk(num_tokens, max_model_len):
    first, cont = profile_steps(num_tokens, max_model_len, torch.device("cpu"))
    for step in (first, cont):   # both steps carry num_tokens tokens, spans tile them
        assert len(step["positions"]) == len(step["slot_mapping"]) == num_tokens
        assert [s.q_start for s in step["spans"]][0] == 0
        assert sum(s.q_end - s.q_start for s in step["spans"]) == num_tokens
    assert all(s.mask is None and len(s.kv_slots) <= max_model_len for s in first["spans"])
    q = min(num_tokens, max_model_len)
    chunk = cont["spans"][0]
    assert (chunk.q_start, chunk.q_end, len(chunk.kv_slots)) == (0, q, max_model_len)
    assert chunk.mask.shape == (q, max_model_len)
    # the chunk's queries are the view's last q logical ids; query p sees keys <= p
    assert cont["positions"][:q].tolist() == list(range(max_model_len - q, max_model_len))
    assert chunk.mask.sum(1).tolist() == list(range(max_model_len - q + 1, max_model_len + 1))
    assert cont["slot_mapping"][:q].tolist() == chunk.kv_slots[-q:].tolist()
    scratch_slots = max(num_tokens, max_model_len + num_tokens - q)
    assert int(cont["slot_mapping"].max()) < scratch_slots
    assert all(int(s.kv_slots.max()) < scratch_slots for st in (first, cont) for s in st["spans"])


def test_profile_forward_runs_a_continued_chunk_with_column_sums(tiny_llama):
    from vllm import LLM
    model = LLM(tiny_llama, num_gpu_blocks_override=8).llm_engine.model
    cfg, seen = model.config, []
    real_forward = model.forward

    def spy(input_ids, positions, kv, meta):
        seen.append([(s.q_end - s.q_start, len(s.kv_slots), s.mask is not None,
                      s.colsum is not None) for s in meta.prefills])
        return real_forward(input_ids, positions, kv, meta)
    model.forward = spy
    try:
        slot_bytes = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
        short = profile_forward(model, num_tokens=16, max_model_len=32, num_seqs=4)
        steps_short, seen[:] = list(seen), []
        long = profile_forward(model, num_tokens=16, max_model_len=96, num_seqs=4)
    finally:
        del model.forward
    assert (short, long) == (32 * slot_bytes, 96 * slot_bytes)   # grows with max_model_len
    assert steps_short == [[(16, 16, False, False)], [(16, 16, False, True)],
                           [(16, 32, True, False)], [(16, 32, True, True)]]
    assert seen[-1] == [(16, 96, True, True)]
