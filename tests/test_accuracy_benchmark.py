"""benchmarks/benchmark_accuracy.py's scoring, on the tiny model: Native's teacher-forced
perplexity equals transformers', KL from Native is 0 for Native and positive under eviction, and
the KV footprint of an evicting variant is below Native's; the KV dtype axis scores fp8 against
float32-KV Native, with and without eviction, in KV bytes."""
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.conftest import random_prompts

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import benchmark_accuracy as bench  # noqa: E402


def test_teacher_forced_scores(tiny_llama):
    import transformers
    text = random_prompts(1, seed=91, lo=200, hi=201)[0]
    args = SimpleNamespace(step_tokens=256, seed=0, kv_gib=0.01, chunk=32)
    rows = bench.run_perplexity(tiny_llama, args, text, bench.variants(["h2o", "keydiff"],
                                                                       ["r0.5", "64"]))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([text])).logits[0].float(), -1)
    nll = -logp[torch.arange(len(text) - 1), torch.tensor(text[1:])].mean()
    native = rows[0]
    assert native["policy"] == "none" and native["kl"] == 0.0 and native["kv_x"] == 1.0
    assert np.isclose(native["ppl"], float(nll.exp()), rtol=1e-4)
    for r in rows[1:]:
        assert r["evicted"] > 0 and r["kl"] > 0 and r["kv_x"] < 0.9, r
    # the same policy at the same budget footprint: H2O and KeyDiff hold alike (vToken repacks)
    by = {(r["policy"], r["budget"]): r["kv_x"] for r in rows}
    assert abs(by["h2o", "64"] - by["keydiff", "64"]) < 0.15


def test_pareto_frontier():
    pts = [(0.3, 40.0), (0.5, 26.0), (0.6, 30.0), (0.8, 25.0), (0.8, 27.0)]
    assert bench.pareto(pts, lower_is_better=True) == [(0.3, 40.0), (0.5, 26.0), (0.8, 25.0)]
    acc = [(0.3, 0.5), (0.5, 0.4), (0.6, 0.9), (0.9, 0.9)]
    assert bench.pareto(acc, lower_is_better=False) == [(0.3, 0.5), (0.6, 0.9)]


def test_kv_dtype_axis(tiny_llama):
    """fp8 rows, Native and evicting, scored against float32-KV Native: fp8 Native holds the
    same blocks in a quarter of the bytes, close to float32 (KL bounds as
    test_kv_cache_dtype.test_fp8_logits_close_to_fp32); an evicting fp8 row holds the blocks of
    its float32 twin at a quarter of the bytes."""
    text = random_prompts(1, seed=91, lo=200, hi=201)[0]
    args = SimpleNamespace(step_tokens=256, seed=0, kv_gib=0.01, chunk=32)
    rows = bench.run_perplexity(tiny_llama, args, text, bench.variants(["tova"], ["64"]),
                                ["fp8_e5m2", "float32", "fp8_e4m3", "bfloat16"])
    assert [(r["kv_dtype"], r["policy"]) for r in rows] == [
        ("float32", "none"), ("float32", "tova"), ("fp8_e5m2", "none"), ("fp8_e5m2", "tova"),
        ("fp8_e4m3", "none"), ("fp8_e4m3", "tova"), ("bfloat16", "none"), ("bfloat16", "tova")]
    by = {(r["kv_dtype"], r["policy"]): r for r in rows}
    ref = by["float32", "none"]
    bf16 = by["bfloat16", "none"]
    assert bf16["bytes_x"] == 0.5 and 0 < bf16["kl"] < 1e-3
    assert ref["kl"] == 0.0 and ref["kv_x"] == ref["bytes_x"] == 1.0
    for dtype, bound in (("fp8_e4m3", 0.03), ("fp8_e5m2", 0.1)):
        native, tova = by[dtype, "none"], by[dtype, "tova"]
        assert native["kv_x"] == 1.0 and native["bytes_x"] == 0.25 and native["evicted"] == 0
        assert 0 < native["kl"] < bound and abs(np.log(native["ppl"] / ref["ppl"])) < 0.05
        assert tova["evicted"] > 0 and tova["kl"] > native["kl"]
        assert tova["bytes_x"] == pytest.approx(tova["kv_x"] / 4)
        assert tova["kv_x"] == pytest.approx(by["float32", "tova"]["kv_x"], abs=0.05)
    # the summary names the cheapest combination that keeps quality, dtype included
    keys = [dict(r, length=512, accuracy=0.9 if r["kv_dtype"] == "fp8_e5m2" else 1.0)
            for r in rows if r["kv_dtype"] != "bfloat16"]
    rows = [r for r in rows if r["kv_dtype"] != "bfloat16"]
    best = {r["policy"]: r for r in bench.summary(rows, keys)}
    assert best["Native"]["passkey=Native: KV bytes x"] == "0.25 (-, fp8_e4m3)"
    assert best["tova"]["passkey=Native: KV bytes x"].endswith("(64, fp8_e4m3)")
    lowest = min((r for r in rows if r["kv_dtype"] != "float32" and r["policy"] == "none"),
                 key=lambda r: r["ppl"])
    assert best["Native"]["ppl<=1.05x: KV bytes x"] == f"0.25 (-, {lowest['kv_dtype']})"


def test_passkey_kv_dtype_axis(tiny_llama):
    """Passkey cells per KV dtype, Native's reference from float32 KV: fp8-only runs still run
    it (accuracy is near 0 on the random model; the bookkeeping is what is checked)."""
    from vllm.model_executor.gguf_loader import resolve_model
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(resolve_model(tiny_llama))
    args = SimpleNamespace(step_tokens=256, seed=0, kv_gib=0.01, chunk=32, trials=2)
    rows = bench.run_passkey(tiny_llama, args, tok, 96, bench.variants(["h2o"], ["32"]),
                             ["fp8_e4m3"])
    assert [(r["kv_dtype"], r["policy"]) for r in rows] == [
        ("float32", "none"), ("fp8_e4m3", "none"), ("fp8_e4m3", "h2o")]
    assert [r["bytes_x"] for r in rows[:2]] == [1.0, 0.25] and rows[1]["kv_x"] == 1.0
    assert rows[2]["kv_x"] < 0.9 and rows[2]["trials"] == 2
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        bench.run_passkey(tiny_llama, args, tok, 96, bench.variants(["h2o"], ["32"]), ["int4"])


def test_a_json_from_when_the_reference_was_auto_reads_as_float32():
    old = {"kv_cache_dtypes": ["auto", "fp8_e4m3"],
           "perplexity": [{"kv_dtype": "auto", "policy": "none"},
                          {"kv_dtype": "fp8_e4m3", "policy": "none"}]}
    new = bench.upgrade(old)
    assert new["kv_cache_dtypes"] == ["float32", "fp8_e4m3"]
    assert [bench.is_reference(r) for r in new["perplexity"]] == [True, False]
    assert bench.kv_dtype_of({"policy": "none"}) == "float32"        # before the dtype axis


def test_native_runs_once_whatever_the_budgets():
    assert bench.variants(["none", "tova"], ["256", "512"]) == [
        ("none", "-"), ("tova", "256"), ("tova", "512")]
    assert bench.variants(["none"], ["256", "512"]) == [("none", "-")]


def test_ppl_change_is_per_text_against_that_texts_native():
    """Two texts whose Native perplexities differ: each row against its own text's Native
    (+1% and +4%), the mean geometric, then the range."""
    native = {0: 20.0, 1: 30.0}
    rows = [{"ppl": 20.2, "text": 0}, {"ppl": 31.2, "text": 1}]
    assert bench.ppl_change(rows, native) == "+2.49 (+1.00 .. +4.00)"


def test_long_generation_teacher_forced(tiny_llama):
    """(e): Native's decoded perplexity equals transformers' over the continuation, KL 0; under
    scope generated an evicting variant keeps the prompt (budget counts generated tokens) and
    holds less KV; the interval changes when, not whether, it evicts."""
    import transformers
    text = random_prompts(1, seed=92, lo=120, hi=121)[0]
    prompt, cont = text[:40], text[40:]
    args = SimpleNamespace(step_tokens=256, seed=0, kv_gib=0.01, longgen_kv_dtype="float32")
    todo = bench.gen_variants(["h2o", "random"], [16], ["all", "generated"], [1, 8], 2)
    assert len(todo) == 1 + 2 * 2 + 2 * 2 * 2          # random twice per cell
    rows, _ = bench.run_long_generation(tiny_llama, args, prompt, cont, todo)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([text])).logits[0].float(), -1)
    pos = torch.arange(len(prompt) - 1, len(text) - 1)
    nll = -logp[pos, torch.tensor(cont)].mean()
    native = rows[0]
    assert native["policy"] == "none" and native["kl"] == 0.0 and native["kv_x"] == 1.0
    assert np.isclose(native["ppl"], float(nll.exp()), rtol=1e-4)
    by = {(r["policy"], r["scope"], r["interval"], r["draw"]): r for r in rows[1:]}
    for r in rows[1:]:
        assert r["evicted"] > 0 and r["kl"] > 0 and r["kv_x"] < 1.0, r
    # scope generated holds the 40-token prompt besides the budget: more KV than scope all
    assert by["h2o", "generated", 1, 0]["kv_x"] > by["h2o", "all", 1, 0]["kv_x"]
    # peaks in 16-token blocks: Native's 120 tokens fill 8; scope all holds the 40-token prompt
    # once (3), scope generated the prompt + 16 + the new token (4) and slots not yet repacked
    assert native["peak_x"] == 1.0
    assert 3 / 8 <= by["h2o", "all", 1, 0]["peak_x"] < by["h2o", "generated", 1, 0]["peak_x"]
    assert 4 / 8 <= by["h2o", "generated", 1, 0]["peak_x"] < 1.0
    assert by["random", "all", 1, 0]["kl"] != by["random", "all", 1, 1]["kl"]     # two draws
