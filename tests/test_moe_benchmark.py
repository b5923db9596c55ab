"""benchmark_moe.py in smoke form: a tiny random Qwen3-MoE (hidden 64, 4 experts, 2 per token)
built, converted by llama.cpp's convert_hf_to_gguf.py (the tests skip without it) and run through
the script's main() at batch 1 and 2 with a few tokens, the JSON's rows checked: the engine's,
transformers', and the llama.cpp columns (ABBA turns, per-pair ratios, targets) against a
stand-in llama-batched-bench; then llama-quantize and llama-batched-bench for real where
LLAMACPP_DIR/bin has them (skipped otherwise); the gpt-oss-20b layout the capacity part uses."""
import json
import os
import shutil
import stat
import sys
import textwrap

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import benchmark_hybrid_capacity as hyb  # noqa: E402
import benchmark_moe as bench  # noqa: E402
from tests.test_families_benchmark import FAKE_BENCH  # noqa: E402

LLAMACPP = os.environ.get("LLAMACPP_DIR", "/work/llamacpp")
ROW_KEYS = ("format", "batch", "engine_tok_s", "engine_s", "engine_rounds_tok_s")
PEER_KEYS = ("llamacpp_tok_s", "llamacpp_decode_tok_s", "vs_llamacpp", "vs_llamacpp_min",
             "vs_llamacpp_rounds", "target", "moonshot", "meets_target", "meets_moonshot")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The tiny checkpoint and its F32 GGUF, made once for the module."""
    pytest.importorskip("gguf")
    if not os.path.isfile(bench.CONVERTER):
        pytest.skip(f"llama.cpp's converter is not at {bench.CONVERTER} (set LLAMA_CPP_SRC)")
    try:
        bench.common.tokenizer_for(None)
    except FileNotFoundError as e:
        pytest.skip(f"the tokenizer comes from the default model: {e}")
    path = str(tmp_path_factory.mktemp("moe-work"))
    hf = bench.checkpoint(path, "tiny", 2, 0)
    bench.gguf_file(path, hf, "f32", None, 1)
    return path


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """The engine's GGUF conversion goes to a cache of its own; the compiled kernels are the
    usual ones. The script's LLM(file) gets a 64 MiB KV pool (zeroing the default 2 GiB takes
    seconds)."""
    import functools
    import vllm
    from vllm import envs
    monkeypatch.setattr(vllm, "LLM", functools.partial(vllm.LLM, kv_cache_memory=64 << 20))
    kernels = envs.VLLM_CACHE_ROOT / "cpu_kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "cpu_kernels").symlink_to(kernels)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))


def _run(monkeypatch, workdir, out, *argv):
    threads = torch.get_num_threads()
    monkeypatch.setattr(sys, "argv", [
        "benchmark_moe.py", "--parts", "decode", "--shape", "tiny", "--workdir", workdir,
        "--prompt-len", "8", "--new-tokens", "4", "--threads", "1", "--out", str(out), *argv])
    try:
        bench.main()
    finally:
        torch.set_num_threads(threads)
    assert (out / "benchmark_moe_decode.png").stat().st_size > 0
    data = json.loads((out / "benchmark_moe_decode.json").read_text())
    for key in ("cpu", "isa", "machine", "table", "engines", "formats", "batches", "prompt_len",
                "new_tokens", "rounds", "threads", "targets", "files", "llamacpp"):
        assert key in data, key
    assert data["cpu"] and data["isa"] in data["table"]
    for row in data["rows"]:
        assert all(key in row for key in ROW_KEYS), row
        assert row["engine_tok_s"] > 0 and all(t > 0 for t in row["engine_rounds_tok_s"])
    return data


def test_rows_of_engine_transformers_and_a_stand_in_peer(workdir, tmp_path, monkeypatch):
    llamacpp = tmp_path / "llamacpp"
    (llamacpp / "bin").mkdir(parents=True)
    binary = llamacpp / "bin" / "llama-batched-bench"
    binary.write_text(textwrap.dedent(FAKE_BENCH.format(python=sys.executable)))
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    data = _run(monkeypatch, workdir, tmp_path / "out", "--formats", "f32", "--batches", "1", "2",
                "--hf-batches", "2", "--rounds", "2", "--llamacpp", str(llamacpp))
    assert [(r["format"], r["batch"]) for r in data["rows"]] == [("f32", 1), ("f32", 2)]
    assert data["engines"]["f32"]["quantization"] == "gguf"
    assert data["files"]["f32"].endswith("model-F32.gguf")
    assert len(data["llamacpp"]["formats"]["f32"]["commands"]) == 4      # 2 rounds x 2 batches
    assert data["hf_batches"] == [2] and "hf_tok_s" not in data["rows"][0]
    hf = data["rows"][1]
    assert hf["hf_tok_s"] > 0 and hf["vs_hf"] == pytest.approx(hf["hf_s"] / hf["engine_s"])
    for row in data["rows"]:
        assert all(key in row for key in PEER_KEYS), row
        assert row["llamacpp_tok_s"] == pytest.approx(50.0, rel=1e-3)     # the stand-in's
        pairs = [ours / 50.0 for ours in row["engine_rounds_tok_s"]]
        assert row["vs_llamacpp_rounds"] == pytest.approx(pairs, rel=1e-3)
        assert row["vs_llamacpp_min"] == pytest.approx(min(pairs), rel=1e-3)
        target, moonshot = bench.families.TARGETS.get(row["batch"], (None, None))
        assert (row["target"], row["moonshot"]) == (target, moonshot)
        assert row["meets_target"] == (None if target is None else row["vs_llamacpp"] >= target)


@pytest.mark.skipif(not all(os.access(os.path.join(LLAMACPP, "bin", b), os.X_OK)
                            for b in ("llama-batched-bench", "llama-quantize")),
                    reason=f"no llama.cpp binaries in {LLAMACPP}/bin (set LLAMACPP_DIR)")
def test_real_llamacpp_quantizes_and_runs_q4_0(workdir, tmp_path, monkeypatch):
    own = tmp_path / "work"                             # the module's F32 file stays
    shutil.copytree(workdir, own)
    data = _run(monkeypatch, str(own), tmp_path / "out", "--formats", "q4_0", "--batches", "1",
                "--hf-batches", "--rounds", "1", "--llamacpp", LLAMACPP)
    row = data["rows"][0]
    assert row["format"] == "q4_0" and row["llamacpp_tok_s"] > 0 and row["vs_llamacpp"] > 0
    assert (own / "model-Q4_0.gguf").exists()
    assert not (own / "model-F32.gguf").exists()        # the intermediate, dropped


def test_gpt_oss_20b_layout_groups_its_full_layers():
    model = hyb.shape_dir("gpt-oss-20b", 1.0)
    one, groups = hyb.layout(model, True, 13296), hyb.layout(model, False, 13296)
    page = 2 * 8 * 64 * 2                               # K + V, 8 KV heads x 64, bf16
    assert one["token_bytes"] == 24 * page and one["sliding_blocks"] == 0
    assert groups["token_bytes"] == 12 * page           # 12 full layers of 24
    assert groups["sliding_blocks"] == 128 // 16 + 1    # one subgroup of 12, window 128
