"""benchmark_capacity.py: the stall count, the frontier search, fp8 sizing in bytes, and a small
simulated trial end to end (Native cannot hold what vToken holds; a roomy pool copies nothing
under pressure)."""
import os
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import benchmark_capacity as cap  # noqa: E402
import common  # noqa: E402


class Row:
    """A request as held_rows reads it (hashable: `before` is keyed by the request)."""
    def __init__(self, computed: int):
        self.num_computed_tokens = computed
        self.is_finished = False


def held(pairs, waiting=0, max_tokens=3, max_seqs=8):
    """pairs: (computed before, tokens the step gave) per running request, in order."""
    running = [Row(b + n) for b, n in pairs]
    before = {s: b for s, (b, _) in zip(running, pairs)}
    queue = [Row(0) for _ in range(waiting)]
    return cap.held_rows(running, before, queue, max_tokens, max_seqs, len(running))


def test_a_row_left_out_while_budget_remained_is_held():
    # a, c decode, b and d left out, 2 of 3 tokens spent: both were held for blocks
    assert held([(100, 1), (100, 0), (100, 1), (100, 0)]) == 2
    # c's prefill chunk spent the budget: b was held, d only ran out of budget
    assert held([(100, 1), (100, 0), (50, 2), (100, 0)]) == 1
    assert held([(100, 1), (100, 1), (100, 1)]) == 0


def test_waiting_requests_count_only_when_the_step_had_room_for_them():
    assert held([(100, 1)], waiting=3) == 3
    assert held([(100, 1), (10, 2)], waiting=3) == 0             # budget spent
    assert held([(100, 1)], waiting=3, max_seqs=1) == 0          # no sequence slot


def test_frontier_is_the_largest_passing_c_from_any_guess():
    for guess in (1, 10, 37, 38, 60, 200):
        calls = []

        def run(c):
            calls.append(c)
            return {"passed": c <= 37, "pool_peak": 10 * c, "pool_blocks": 400,
                    "stalled_row_steps": int(c > 37), "preemptions": 0, "max_resident": c,
                    "seconds": 0.0}
        c, tried = cap.frontier(run, guess, 80, lambda m: None, "t")
        assert c == 37 and tried[37]["passed"] and not tried[38]["passed"]
        assert len(calls) == len(set(calls)) <= 12
    always = {"passed": True, "pool_peak": 1, "pool_blocks": 1, "seconds": 0.0}
    assert cap.frontier(lambda c: dict(always, c=c), 3, 5, lambda m: None, "t")[0] == 5
    never = {"passed": False, "stalled_row_steps": 1, "preemptions": 0, "pool_peak": 1,
             "pool_blocks": 1, "max_resident": 0, "seconds": 0.0}
    assert cap.frontier(lambda c: never, 4, 5, lambda m: None, "t")[0] == 0


def test_fp8_blocks_come_from_bytes_per_block():
    llama8b = SimpleNamespace(num_hidden_layers=32, num_key_value_heads=8, head_dim=128,
                              hidden_size=4096, num_attention_heads=32)
    assert cap.block_bytes(llama8b, 2) == 2 << 20            # bf16: 2 MiB per 16 tokens
    assert cap.block_bytes(llama8b, 1, 1) == 64 << 10        # fp8: 64 KiB per token
    assert cap.blocks_in_bytes(5427, 2, 1) == 10854          # bf16 pool -> fp8 blocks
    real = {"base_block_bytes": 368640, "fp8_factor": (2, 1)}       # the default model, bf16
    kw, blocks = cap.fp8_sizing(real, 120)
    assert kw == {"kv_cache_memory": 120 * 368640, "kv_cache_dtype": "fp8"} and blocks == 240
    sim = {"fp8_factor": (2, 1)}
    assert cap.fp8_sizing(sim, 678) == ({"num_gpu_blocks_override": 1356}, 1356)


def test_real_setup_sizes_fp8_against_the_kv_dtype_auto_gives():
    """A float32 checkpoint's baseline pool is float32 (fp8: 4x the blocks in its bytes)."""
    args = SimpleNamespace(model="tiny", prompt_len=None, output_len=None, budgets=None,
                           quick=True)
    setup = cap.real_setup(args)
    assert "float32 KV baseline" in setup["label"] and setup["fp8_factor"] == (4, 1)
    cfg = __import__("transformers").AutoConfig.from_pretrained(setup["model"])
    assert setup["base_block_bytes"] == cap.block_bytes(cfg, 4)


def test_packed_references():
    # paper setup: 4,032 + 12,288 tokens, H2O 0.5 -> 8,160 live = 510 blocks packed; the
    # tail (15 newest tokens at the last step) costs one more
    assert cap.packed_blocks(16320) == 510 and cap.tail_packed_blocks(16320) == 511
    assert cap.packed_blocks(255) == 8 and cap.tail_packed_blocks(255) == 9
    assert cap.tail_packed_blocks(2040) == 65
    assert all(cap.tail_packed_blocks(t) in (cap.packed_blocks(t), cap.packed_blocks(t) + 1)
               for t in range(40, 600))


@pytest.fixture(scope="module")
def sim():
    """32 + 96 tokens at the Llama-3.1-8B shape: 8 blocks a request in full, 4 packed."""
    model = common.sim_config_dir()
    work = [(w[:32], 96) for w, _ in common.synthetic(12, 32, 96, 32000, 0, sigma=1e-9)]
    return model, work, dict(load_format="simulate", max_model_len=160)


def test_simulated_trial_native_stops_where_vtoken_goes_on(sim):
    model, work, extra = sim
    native = dict(extra, num_gpu_blocks_override=40, kv_eviction_policy="none")
    assert cap.trial(model, native, work, 5)["passed"]              # 5 x 8 = 40 blocks
    over = cap.trial(model, native, work, 6)
    assert not over["passed"] and over["stalled_row_steps"] + over["preemptions"] > 0
    vtoken = dict(extra, num_gpu_blocks_override=40, **cap.eviction("vtoken"))
    t = cap.trial(model, vtoken, work, 8, token_bytes=1)
    assert t["passed"] and t["stalled_row_steps"] == 0 and t["max_resident"] == 8
    assert t["bytes_copied"] == t["relocated_tokens"] > 0


def test_a_roomy_pool_makes_no_pressure_plans(sim):
    model, work, extra = sim
    vtoken = dict(extra, num_gpu_blocks_override=200, **cap.eviction("vtoken"))
    t = cap.trial(model, vtoken, work, 4, stop_early=False)
    assert t["passed"] and t["pressure_relocations"] == 0


def test_roomy_blocks_hold_every_request_at_once():
    """common.roomy_blocks, the pool of the benchmarks that count blocks (reclamation,
    sensitivity, prefix sharing, quality, overhead): every request at its full length plus a
    block each, at once, so all of them run together and nothing is preempted."""
    from vllm import LLM
    work = [(list(range(100, 100 + n)), out) for n, out in ((40, 24), (17, 9), (64, 32))]
    assert common.roomy_blocks(work, 16) == (4 + 1) + (2 + 1) + (6 + 1) + 8
    assert common.roomy_blocks(work, 32, extra_tokens=33) == (2 + 1) + (1 + 1) + (3 + 1) + 2 + 8
    llm = LLM(common.tiny_model_dir(layers=2, hidden=64), max_num_seqs=len(work), seed=0,
              num_gpu_blocks_override=common.roomy_blocks(work), kv_eviction_policy="none")
    m = common.measure(llm, work)
    assert [len(o.outputs[0].token_ids) for o in m["outs"]] == [n for _, n in work]
    assert llm.llm_engine.get_kv_stats()["preemptions"] == 0
    # all three resident together: at 8 tokens each (the shortest's last step) 3 + 2 + 5 blocks
    assert m["pool_blocks_peak"] == 3 + 2 + 5
