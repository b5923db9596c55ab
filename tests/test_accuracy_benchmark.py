"""benchmarks/benchmark_accuracy.py's scoring, on the tiny model: Native's teacher-forced
perplexity equals transformers', KL from Native is 0 for Native and positive under eviction, and
the KV footprint of an evicting variant is below Native's."""
import os
import sys
from types import SimpleNamespace

import numpy as np
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
