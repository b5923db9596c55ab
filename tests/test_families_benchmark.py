"""benchmark_families.py in smoke form: a tiny random Gemma 3 (tests.conftest.build_family_model)
run through the script's main() with --quick, one batch size and a few tokens, and the JSON it
writes checked; then the --llamacpp path (ABBA turns, per-pair ratios, targets) on a tiny Gemma 3
GGUF against a stand-in llama-batched-bench that prints a fixed table."""
import json
import os
import stat
import sys
import textwrap

import pytest
import torch

from tests.conftest import build_family_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import benchmark_families as bench  # noqa: E402
import common  # noqa: E402


def _run(monkeypatch, *argv):
    threads = torch.get_num_threads()
    monkeypatch.setattr(sys, "argv", ["benchmark_families.py", *argv])
    try:
        bench.main()
    finally:
        torch.set_num_threads(threads)


def _check_rows(data, batches, hf=True):
    assert [r["batch"] for r in data["rows"]] == batches
    for row in data["rows"]:
        assert row["engine_tok_s"] > 0 and row["engine_s"] > 0
        assert all(t > 0 for t in row["engine_rounds_tok_s"])
        if hf:
            assert row["hf_tok_s"] > 0 and row["vs_hf"] > 0
    for key in ("cpu", "isa", "machine", "table", "kernel_plan", "quantization", "prompt_len",
                "new_tokens", "rounds", "threads", "targets"):
        assert key in data, key
    assert data["cpu"] and data["isa"] in data["table"]


def test_quick_run_on_a_tiny_gemma3_writes_json_and_png(tmp_path, monkeypatch):
    model = build_family_model(str(tmp_path / "gemma3"), "gemma3")
    out = tmp_path / "out"
    _run(monkeypatch, "--model", model, "--quick", "--batches", "2", "--prompt-len", "12",
         "--new-tokens", "4", "--threads", "1", "--out", str(out))
    data = json.loads((out / "benchmark_families_gemma3.json").read_text())
    assert (out / "benchmark_families_gemma3.png").stat().st_size > 0
    _check_rows(data, [2])
    assert data["benchmark"] == "benchmark_families_gemma3"
    assert (data["prompt_len"], data["new_tokens"], data["rounds"]) == (12, 4, 1)
    assert data["llamacpp"] is None and "vs_llamacpp" not in data["rows"][0]
    assert data["quantization"] == "none" and data["weights"] == "float32"
    assert common.RESULTS != str(out)               # --out does not stick to common


FAKE_BENCH = """\
#!{python}
import sys
args = sys.argv[1:]
if "--version" in args:
    print("version: 1 (fake)"); sys.exit(0)
get = lambda flag: args[args.index(flag) + 1]
pp, tg, t = int(get("-npp")), int(get("-ntg")), get("-t")
print(f"main: n_kv_max = {{get('-c')}}, n_batch = 2048, n_ubatch = 512, n_threads = {{t}}")
print("system_info: n_threads = " + t + " | AVX2 = 1 |")
print("|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |")
print("|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|")
for b in map(int, get("-npl").split(",")):
    t_s = b * tg / 50.0                     # 50 generated tokens/s incl. prefill
    t_pp = t_s / 10                         # prefill a tenth of it, decode the rest
    print(f"| {{pp}} | {{tg}} | {{b}} | {{b * (pp + tg)}} | {{t_pp:.4f}} | {{b * pp / t_pp:.2f}} | "
          f"{{t_s - t_pp:.4f}} | {{b * tg / (t_s - t_pp):.2f}} | {{t_s:.4f}} | "
          f"{{b * (pp + tg) / t_s:.2f}} |")
"""


def test_llamacpp_path_pairs_rounds_with_a_stand_in_peer(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    import transformers
    from gguf_kquants import write_family_gguf
    from vllm.kernels.quant_kernels import Q8_0
    src = build_family_model(str(tmp_path / "gemma3"), "gemma3")
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    types = {f"model.layers.{i}.{name}.weight": Q8_0 for i in range(model.config.num_hidden_layers)
             for name in ("self_attn.q_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    gguf = write_family_gguf(str(tmp_path / "tiny-gemma3.gguf"), "gemma3", model.config,
                             model.state_dict(), types)
    llamacpp = tmp_path / "llamacpp"
    (llamacpp / "bin").mkdir(parents=True)
    binary = llamacpp / "bin" / "llama-batched-bench"
    binary.write_text(textwrap.dedent(FAKE_BENCH.format(python=sys.executable)))
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    # the GGUF's conversion goes to a cache of its own; the compiled kernels are the usual ones
    from vllm import envs
    kernels = envs.VLLM_CACHE_ROOT / "cpu_kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "cpu_kernels").symlink_to(kernels)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    calls = []
    run = bench.throughput.run_llamacpp
    monkeypatch.setattr(bench.throughput, "run_llamacpp",
                        lambda *a, **k: calls.append(a[2]) or run(*a, **k))
    out = tmp_path / "out"
    _run(monkeypatch, "--model", gguf, "--batches", "1", "2", "--prompt-len", "8",
         "--new-tokens", "4", "--rounds", "2", "--threads", "1", "--llamacpp", str(llamacpp),
         "--no-hf", "--out", str(out))
    data = json.loads((out / "benchmark_families_tiny-gemma3.json").read_text())
    _check_rows(data, [1, 2], hf=False)
    assert data["quantization"] == "gguf" and data["gguf"] == gguf
    # which format wins is timed at load on this host: the tiny model may drop its blocks
    assert data["weights"].startswith(("GGUF blocks", "float32 at every batch size"))
    assert calls == [[1], [1], [2], [2]]            # two rounds per batch, one batch per call
    assert data["llamacpp"]["version"] == "version: 1 (fake)"
    assert len(data["llamacpp"]["commands"]) == 4
    for row in data["rows"]:
        assert row["llamacpp_tok_s"] == pytest.approx(50.0, rel=1e-3)
        assert row["llamacpp_decode_tok_s"] == pytest.approx(50.0 / 0.9, rel=1e-2)
        pairs = [ours / 50.0 for ours in row["engine_rounds_tok_s"]]
        assert row["vs_llamacpp_rounds"] == pytest.approx(pairs, rel=1e-3)
        assert row["vs_llamacpp_min"] == pytest.approx(min(pairs), rel=1e-3)
        assert row["target"] == bench.TARGETS.get(row["batch"], (None,))[0]
        assert row["meets_target"] in (None, row["vs_llamacpp"] >= (row["target"] or 0))
