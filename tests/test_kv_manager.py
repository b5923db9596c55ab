"""The KV owner under the serving features users turn on together (issue: one KV owner).

Each test pins one behaviour that main got wrong before the KV manager: prefix caching with hole
filling and with evicted contexts, cache hits that skipped scored queries, SnapKV's and TOVA's
prefill query windows, preemption of a request that outgrew the pool, finish reasons, kv_stats
after preemption, and the cached blocks vToken used to overwrite.
"""
import numpy as np
import pytest
import torch

from tests.conftest import random_prompts
from tests.kernel_refs import key_statistic_reference
from vllm import LLM, SamplingParams
from vllm.core.eviction import SnapKVPolicy, TOVAPolicy
from vllm.core.request_kv import RequestKV
from vllm.config import KVEvictionConfig

MODES = ["none", "vtoken", "vtoken-fill"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def engine(model, **kwargs):
    kwargs.setdefault("kv_check_invariants", True)
    kwargs.setdefault("kv_eviction_log", True)
    kwargs.setdefault("kv_min_tokens", 0)
    kwargs.setdefault("num_gpu_blocks_override", 256)
    kwargs.setdefault("block_size", 8)
    return LLM(model, **kwargs).llm_engine


def run(eng, prompts, params, max_steps=5000):
    """Requests one after another on the same engine (so later ones can hit the cache);
    -> (outputs, their sequences' KV states). Fails instead of hanging."""
    outs, kvs = [], []
    for i, p in enumerate(prompts):
        rid = f"r{len(eng.kv.seqs)}-{i}-{id(p)}"
        eng.add_request(rid, {"prompt_token_ids": p}, params)
        kvs.append(eng.kv.requests[eng.requests[rid].seqs[0].seq_id])
        done = None
        for _ in range(max_steps):
            for o in eng.step():
                done = o if o.finished else done
            if not eng.has_unfinished_requests():
                break
        assert done is not None, "the engine did not finish the request"
        outs.append(done)
    eng.check_invariants()
    assert eng.kv.bm.num_free_blocks == eng.kv.num_blocks
    return outs, kvs


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def logs(kvs):
    return [[a.tolist() for a in k.eviction_log] for k in kvs]


# ---- items 1, 2, 5: prefix caching under eviction -------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["streamingllm", "tova", "snapkv", "h2o"])
def test_chat_follow_up_same_with_and_without_prefix_cache(tiny_llama, policy, mode):
    """Turn 1, then turn 2 = turn-1 prompt + answer + new words. The follow-up's tokens and
    evictions must not depend on the prefix cache: cached blocks hold only K/V computed before
    the first eviction (never hole-filled or relocated ones), and hits never skip a query the
    policy scores with."""
    first = random_prompts(1, seed=21, lo=70, hi=71)[0]
    args = dict(kv_eviction_policy=policy, kv_reclamation=mode, kv_frag_threshold=0.0,
                kv_budget_tokens=40)
    results = {}
    for caching in (False, True):
        eng = engine(tiny_llama, enable_prefix_caching=caching, **args)
        (turn1,), _ = run(eng, [first], greedy(40))
        follow = first + turn1.outputs[0].token_ids + random_prompts(1, seed=22, lo=9, hi=10)[0]
        outs, kvs = run(eng, [follow], greedy(24))
        results[caching] = (tokens(outs), logs(kvs), eng.get_kv_stats())
    assert results[True][:2] == results[False][:2]
    hits = results[True][2]["prefix_cache_hit_blocks"]
    if policy == "h2o":            # H2O scores every prompt query: no hit may skip one
        assert hits == 0
    else:                          # the turn-1 prompt blocks (computed before any eviction)
        assert hits >= 1


@pytest.mark.parametrize("mode", MODES)
def test_cached_prompt_blocks_survive_relocation(tiny_llama, mode):
    """Back-to-back requests with one prompt: vToken must not overwrite the first one's cached
    prompt blocks with relocated or hole-filled tokens, so the second hits as often as under
    Naive-Evict, and decides the same evictions as the first."""
    prompt = random_prompts(1, seed=23, lo=96, hi=97)[0]
    eng = engine(tiny_llama, enable_prefix_caching=True, kv_eviction_policy="tova",
                 kv_reclamation=mode, kv_frag_threshold=0.0)
    outs, kvs = run(eng, [prompt, prompt], greedy(48))
    assert tokens(outs)[0] == tokens(outs)[1] and logs(kvs)[0] == logs(kvs)[1]
    assert eng.get_kv_stats()["prefix_cache_hit_blocks"] == (len(prompt) - 1) // 8
    if mode == "vtoken":
        assert eng.get_kv_stats()["relocation_events"] > 0


def test_cache_invariant_catches_a_written_cached_block(tiny_llama):
    """--kv-check-invariants notices a cached block whose bytes no longer match its hash."""
    eng = engine(tiny_llama, enable_prefix_caching=True, kv_eviction_policy="streamingllm",
                 kv_budget_tokens=16)
    eng.add_request("a", {"prompt_token_ids": random_prompts(1, seed=3, lo=40, hi=41)[0]},
                    greedy(8))
    eng.step()
    seq = eng.requests["a"].seqs[0]
    tt = eng.kv.token_table
    assert eng.kv.bm.pool.hashed[eng.kv.requests[seq.seq_id].block_ids[0]]
    slots = tt.all_slots(seq.seq_id)
    slots[[1, 2]] = slots[[2, 1]]          # two tokens of a cached block swap places
    with pytest.raises(AssertionError, match="prefix-cache entry"):
        eng.check_invariants()


# ---- item 4: the policies' prefill query windows ---------------------------------------------------
def hf_attention_colsum(model_dir, prompt, queries: int) -> np.ndarray:
    """Column sums of the last `queries` prompt queries' attention, over layers and heads."""
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                           attn_implementation="eager")
    with torch.no_grad():
        att = hf(torch.tensor([prompt]), output_attentions=True).attentions
    return sum(a[0, :, -queries:].sum(dim=(0, 1)) for a in att).numpy()


@pytest.mark.parametrize("chunk", [None, 24])        # whole prompt / chunked prefill
@pytest.mark.parametrize("policy", ["snapkv", "tova"])
def test_prefill_scores_only_the_policys_query_window(tiny_llama, policy, chunk):
    prompt = random_prompts(1, seed=31, lo=80, hi=81)[0]
    cfg = KVEvictionConfig(policy=policy, eviction_ratio=0.5, min_tokens=0)
    window = cfg.snapkv_window if policy == "snapkv" else 1
    colsum = hf_attention_colsum(tiny_llama, prompt, window)
    cls = SnapKVPolicy if policy == "snapkv" else TOVAPolicy
    expect = cls(cfg, "ref", 4).on_prefill(np.arange(len(prompt)), colsum, len(prompt))
    kwargs = dict(max_num_batched_tokens=chunk) if chunk else {}
    eng = engine(tiny_llama, kv_eviction_policy=policy, kv_eviction_ratio=0.5, **kwargs)
    _, (kv,) = run(eng, [prompt], greedy(1))
    assert kv.eviction_log[0].tolist() == expect.tolist()


# ---- items 3, 7, 8: preemption of a request that outgrew the pool -----------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["streamingllm", "h2o"])
def test_preempted_request_longer_than_the_pool_is_recomputed_in_chunks(tiny_llama, mode, policy):
    """Three requests whose logical length (40 + 120) exceeds the whole pool (8 blocks of 8):
    eviction bounds each one; small prefill chunks admit them early, so preemption strikes;
    a re-prefill longer than the pool must evict as it goes."""
    eng = engine(tiny_llama, num_gpu_blocks_override=8, kv_eviction_policy=policy,
                 kv_budget_tokens=24, kv_reclamation=mode, kv_frag_threshold=0.0,
                 max_num_batched_tokens=16)
    prompts = random_prompts(3, seed=41, lo=40, hi=41)
    for i, p in enumerate(prompts):
        eng.add_request(f"q{i}", {"prompt_token_ids": p}, greedy(120))
    finals = {}
    for _ in range(3000):
        for o in eng.step():
            if o.finished:
                finals[o.request_id] = o
        if not eng.has_unfinished_requests():
            break
    assert len(finals) == 3, "the engine hung"
    assert eng.scheduler.num_preemptions > 0
    for o in finals.values():
        c = o.outputs[0]
        assert c.finish_reason in ("length", "kv_cache_exhausted")
        st = o.kv_stats          # one admission's figures: nothing counted twice
        assert st["live_tokens"] + st["evicted_tokens"] == len(o.prompt_token_ids) + \
            len(c.token_ids) - 1
    assert all(o.outputs[0].finish_reason == "length" for o in finals.values())
    assert any(o.metrics["num_preemptions"] for o in finals.values())
    assert eng.kv.bm.num_free_blocks == eng.kv.num_blocks


@pytest.mark.parametrize("policy,mode,n", [("none", "none", 2), ("random", "none", 2),
                                           ("scissorhands", "vtoken", 3)])
def test_preempted_request_waits_until_its_whole_prefill_fits(tiny_llama, policy, mode, n):
    """Requests that each need most of the pool (10 blocks of 8; 40 + 30 tokens, or their
    live half under eviction): one preempted is not admitted again beside the others on a
    16-token chunk that the next chunk would preempt again (Native, Naive-Evict: blocks only
    grow; vToken with Scissorhands: the others grow back into what a drop freed); it waits for
    its whole prefill to fit. Preemptions: at most one a request (they were 10-13). Tokens as
    with a roomy pool (no eviction); every block back."""
    prompts = random_prompts(n, seed=43, lo=40, hi=41)
    kwargs = dict(kv_eviction_policy=policy, kv_eviction_ratio=0.5, kv_reclamation=mode,
                  max_num_batched_tokens=16)
    eng = engine(tiny_llama, num_gpu_blocks_override=10, **kwargs)
    for i, p in enumerate(prompts):
        eng.add_request(f"q{i}", {"prompt_token_ids": p}, greedy(30 if n == 2 else 40))
    finals, steps = {}, 0
    while eng.has_unfinished_requests() and steps < 1000:
        finals.update((o.request_id, o) for o in eng.step() if o.finished)
        steps += 1
    assert all(len(finals[f"q{i}"].outputs[0].token_ids) == (30 if n == 2 else 40)
               for i in range(n))
    if policy == "none":          # (random eviction draws again in a recompute)
        want, _ = run(engine(tiny_llama, **kwargs), prompts, greedy(30))
        assert [finals[f"q{i}"].outputs[0].token_ids for i in range(2)] == \
            [o.outputs[0].token_ids for o in want]
    assert eng.scheduler.num_preemptions <= n
    assert eng.kv.bm.num_free_blocks == eng.kv.num_blocks


def test_start_up_warns_when_max_model_len_exceeds_the_pool(tiny_llama, caplog):
    with caplog.at_level("WARNING"):
        engine(tiny_llama, num_gpu_blocks_override=4)
    assert "exceeds the KV pool" in caplog.text


def test_eviction_log_is_opt_in(tiny_llama):
    eng = engine(tiny_llama, kv_eviction_policy="h2o", kv_eviction_log=False)
    _, (kv,) = run(eng, random_prompts(1, seed=5, lo=60, hi=61), greedy(8))
    assert kv.eviction_log is None and kv.kv_stats["evicted_tokens"] > 0


def test_every_block_is_usable_under_vtoken(tiny_llama):
    """Relocation never allocates, so no block is held back as headroom: a prompt that needs the
    whole pool is admitted (it used to be refused for want of one block)."""
    eng = engine(tiny_llama, num_gpu_blocks_override=4, kv_eviction_policy="h2o",
                 kv_reclamation="vtoken", kv_budget_tokens=16)
    outs, _ = run(eng, [random_prompts(1, seed=8, lo=32, hi=33)[0]], greedy(16))
    assert outs[0].outputs[0].finish_reason == "length"
    assert eng.kv.bm.peak_used == 4


def key_statistic_steps(eng, seq, steps: int):
    """Decode steps of a request over budget whose policy reads a key statistic: each step asks
    for no attention statistics and hands the policy its view's statistic. Yields (view ids,
    their slots as the step read them) after each step."""
    tt, kv = eng.kv.token_table, eng.kv.requests[seq.seq_id]
    for _ in range(steps):
        new = seq.num_tokens - 1
        view = np.append(tt.live_ids(seq.seq_id), new)
        before = tt.live_slots(seq.seq_id).copy()     # no relocation here: they stay put
        req = eng.kv.score_request([(seq, 1)])
        assert not req.decode and not req.prefill_from
        eng.step()
        assert kv.policy.score_ids.tolist() == view.tolist()
        yield view, torch.from_numpy(np.append(before, tt.slots(seq.seq_id, new, new + 1)))


@pytest.mark.parametrize("policy,kind", [("knorm", "norm"), ("keydiff", "similarity")])
def test_key_score_policies_read_the_cached_keys(tiny_llama, policy, kind):
    """K-norm's ||k|| and KeyDiff's cos(k, mean unit key) are computed over the step's view from
    the cache (mean over layers and KV heads), only on steps where the request is over budget;
    no attention statistics are asked for; the largest score goes."""
    eng = engine(tiny_llama, kv_eviction_policy=policy, kv_budget_tokens=24,
                 kv_reclamation="none")
    eng.add_request("k", {"prompt_token_ids": random_prompts(1, seed=62, lo=60, hi=61)[0]},
                    greedy(12))
    seq = eng.requests["k"].seqs[0]
    tt, kv = eng.kv.token_table, eng.kv.requests[seq.seq_id]
    eng.step()                                            # the prompt: evicts down to 24
    assert kv.kv_stats["evicted_tokens"] == 36 and len(kv.policy.score_ids) == 60
    for view, slots in key_statistic_steps(eng, seq, 4):
        want = key_statistic_reference(eng.kv_caches.double(), slots, kind)
        assert np.allclose(kv.policy.score, want, atol=1e-5)
        gone = np.setdiff1d(view, tt.live_ids(seq.seq_id))
        assert len(gone) == 1 and gone[0] == view[np.argmax(kv.policy.score[:-1])]
    # under budget the statistic is never computed
    eng2 = engine(tiny_llama, kv_eviction_policy=policy, kv_budget_tokens=500)
    eng2.add_request("k", {"prompt_token_ids": random_prompts(1, seed=62, lo=60, hi=61)[0]},
                     greedy(3))
    kv2 = eng2.kv.requests[eng2.requests["k"].seqs[0].seq_id]
    for _ in range(3):
        eng2.step()
    assert len(kv2.policy.score_ids) == 0


def hf_masked_logprobs(model_dir, prompt, visible: np.ndarray) -> torch.Tensor:
    """Log-probs of prompt[1:] from transformers when query i sees key j iff visible[i, j]."""
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                           attn_implementation="eager")
    mask = torch.zeros(1, 1, *visible.shape)
    mask[0, 0][~torch.from_numpy(visible)] = torch.finfo(torch.float32).min
    with torch.no_grad():
        logits = hf(torch.tensor([prompt]), attention_mask=mask).logits[0]
    lp = torch.log_softmax(logits.float(), -1)
    return lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "keydiff"])
def test_streamed_prompt_evicts_per_chunk_and_matches_transformers(tiny_llama, policy):
    """--kv-prefill-chunk 16: the policy runs at prompt positions 16, 32, ... (fixed, whatever
    the step's token budget cuts), so the prompt never holds more than budget + 16 live tokens.
    Teacher-forced log-probs of every prompt token equal transformers' with exactly the evicted
    keys masked from every later query (two prompts batched, chunks cut by a 24-token budget)."""
    eng = engine(tiny_llama, kv_eviction_policy=policy, kv_budget_tokens=40,
                 kv_prefill_chunk=16, max_num_batched_tokens=24, kv_reclamation="vtoken",
                 kv_frag_threshold=0.0)
    prompts = random_prompts(2, seed=71, lo=100, hi=120)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    seqs = []
    for i, p in enumerate(prompts):
        eng.add_request(f"s{i}", {"prompt_token_ids": p}, params)
        seqs.append(eng.requests[f"s{i}"].seqs[0])
    kvs = [eng.kv.requests[s.seq_id] for s in seqs]   # kept: the engine drops them at the end
    evicted_at = [dict() for _ in prompts]           # logical id -> tokens computed at eviction
    seen = [0, 0]
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
        for k, seq in enumerate(seqs):
            log = kvs[k].eviction_log or []
            for batch in log[seen[k]:]:
                assert seq.num_computed_tokens % 16 == 0 or \
                    seq.num_computed_tokens >= len(prompts[k]), "evicted off a chunk boundary"
                evicted_at[k].update({int(j): seq.num_computed_tokens for j in batch})
            seen[k] = len(log)
            if seq.num_computed_tokens and not seq.is_finished:
                live = eng.kv.token_table.num_live(seq.seq_id)
                assert live <= 40 + 16
    for k, p in enumerate(prompts):
        assert len(evicted_at[k]) >= len(p) - 40
        visible = np.tril(np.ones((len(p), len(p)), bool))
        for j, t in evicted_at[k].items():
            visible[t:, j] = False
        want = hf_masked_logprobs(tiny_llama, p, visible)
        out = outs[f"s{k}"]
        got = torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], p[1:])])
        assert torch.allclose(got, want, atol=1e-4), policy


# ---- the KV state's lifetime: one RequestKV per live sequence, none leaked ------------------------
@pytest.mark.parametrize("mode", MODES)
def test_kv_state_lives_exactly_as_long_as_its_request(tiny_llama, mode):
    """A sequence's RequestKV exists from add_request until its request's final output is
    delivered (its kv_stats are in it) or the request is aborted. Through preemptions (a small
    pool), aborts of waiting and running requests and the samples of n = 2 requests finishing
    apart, the KV manager holds exactly the unfinished requests' sequences after every step
    (check_invariants), and nothing once all are done."""
    eng = engine(tiny_llama, num_gpu_blocks_override=12, kv_eviction_policy="h2o",
                 kv_budget_tokens=40, kv_reclamation=mode, max_num_batched_tokens=32)
    prompts = random_prompts(8, seed=91, lo=30, hi=50)
    # temperature 1 over a near-uniform vocabulary: each step stops a sample with p ~ 1/4
    pair = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=40,
                          stop_token_ids=list(range(3, 3 + 128)))
    seen_apart, finals = False, {}
    for i, p in enumerate(prompts):
        eng.add_request(f"q{i}", {"prompt_token_ids": p}, pair if i % 3 == 0 else greedy(40))
    assert set(eng.kv.requests) == {s.seq_id for st in eng.requests.values() for s in st.seqs}
    eng.abort_request("q7")                          # still waiting
    for step in range(3000):
        if step == 6:
            running = eng.scheduler.running[0].request_id
            eng.abort_request(running)               # holding KV
            finals[running] = None
        for o in eng.step():
            if o.finished:
                finals[o.request_id] = o
                assert "blocks_at_finish" in o.kv_stats   # read before the drop
        for st in eng.requests.values():             # a finished sample keeps its RequestKV
            done = [s for s in st.seqs if s.is_finished]
            seen_apart |= 0 < len(done) < len(st.seqs)
            assert all(s.seq_id in eng.kv.requests and s.seq_id not in eng.kv.seqs
                       for s in done)
        eng.check_invariants()                       # RequestKVs == the live sequences
        if not eng.has_unfinished_requests():
            break
    assert len(finals) == 7 and eng.scheduler.num_preemptions > 0 and seen_apart
    assert not eng.kv.requests and not eng.kv.seqs and len(eng.kv.token_table) == 0
    assert eng.kv.bm.num_free_blocks == eng.kv.num_blocks


def test_preemption_resets_the_admission_state_and_keeps_the_request_state():
    """RequestKV.reset_for_recompute: blocks, cache counts, policy state and figures go (the
    re-prefill starts over); the config, prefix hashes and an opted-in log's on/off stay."""
    cfg = KVEvictionConfig(policy="h2o", min_tokens=0)
    kv = RequestKV("s", cfg, block_ids=[3, 4], num_cached_blocks=1, shared_blocks={3},
                   block_hashes=[11, 12], clean_tokens=9, policy=object(), prefill_end=20,
                   policy_ran=True, prefill_colsum=np.ones(20, np.float32),
                   eviction_log=[np.arange(2)], kv_stats={"evicted_tokens": 2})
    kv.reset_for_recompute()
    assert (kv.block_ids, kv.num_cached_blocks, kv.shared_blocks, kv.clean_tokens, kv.policy,
            kv.prefill_colsum, kv.kv_stats, kv.eviction_log) == ([], 0, set(), None, None, None,
                                                                 {}, [])
    assert kv.kv_config is cfg and kv.block_hashes == [11, 12]
    assert kv.prefill_end == 20 and kv.policy_ran      # set again at the next admission
    off = RequestKV("t", cfg)
    off.reset_for_recompute()
    assert off.eviction_log is None
