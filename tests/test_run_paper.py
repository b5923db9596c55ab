"""benchmarks/run_paper.sh and its results page: the writer (benchmarks/paper_results.py) turns
small synthetic result JSONs into a page with every figure's and table's section, its PNG copied and
linked relatively, the SLA target rule with the run-to-run spread and the capacity target; a run
with nothing in it still gives every section, each saying what is missing; `run_paper.sh --quick
--dry-run` lists every figure and table within the 30-minute budget; the token table's bytes per
token are its arrays' nbytes over its tokens; the Qwen2.5-14B shape's config."""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import paper_results as pr  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"        # the writer only copies the file


def put(run, name, data, png=True):
    with open(os.path.join(run, f"{name}.json"), "w") as f:
        json.dump(data, f)
    if png:
        with open(os.path.join(run, f"{name}.png"), "wb") as f:
            f.write(PNG)


def serving(naive_tok_s, vtoken_tok_s, policy):
    """benchmark_serving.py's JSON, as it writes it (no workload name in it)."""
    return {"args": {"policy": policy, "c_ref": 4, "levels": [2, 4, 8]}, "sla_s": 2.0,
            "rows": [], "summary": [
        {"variant": "Naive-Evict", "C_sel": 4, "tok_s": naive_tok_s, "p95_s": 1.9},
        {"variant": "vToken", "C_sel": 8, "tok_s": vtoken_tok_s, "p95_s": 1.5},
        {"variant": "Native", "C_sel": 2, "tok_s": 50.0, "p95_s": 1.0}]}


def capacity(native, vtoken, budget, scale):
    return {"setup": {"scale": scale, "prompt_len": 1024, "output_len": 1024},
            "full_blocks": 128, "ideal_blocks": 64,
            "rows": [{"budget": budget, "ideal": budget // 64, "Native": native,
                      "Naive-Evict": native, "vToken": vtoken,
                      "vToken / Native": vtoken / native, "Native blocks/req": 128.0,
                      "Naive-Evict blocks/req": 120.0, "vToken blocks/req": 66.0}]}


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    run = str(run)
    put(run, "benchmark_reclamation", {"model": "m", "rows": [
        {"workload": "sharegpt", "policy": "h2o", "naive_blocks": 6.5, "vtoken_blocks": 4.0,
         "block_reduction_%": 38.2, "ideal_final": 5.3, "naive_util": 0.46,
         "vtoken_util": 0.74, "util_gain_pp": 28.3}]})
    for wl in pr.WORKLOADS:
        for policy in pr.POLICIES:
            for k, vt in ((1, 110.0), (2, 130.0)):
                put(run, f"serving_{wl}_{policy}_run{k}", serving(100.0, vt, policy))
    put(run, "benchmark_capacity_sim", capacity(5, 8, 678, 0.125))
    put(run, "benchmark_capacity_sim_qwen2.5-14b", capacity(3, 6, 408, 0.125))
    over = [{"C": c, "variant": v, "tok_s": t, "step_ms_median": s, "step_ms_p95": 1.2 * s,
             "tok_s_vs_native": 1.0, "step_vs_native": 1.0, "hook_share_%": 0.5,
             "relocation_events": 3 if "vToken" in v else 0, "planner_ms_per_event": 0.2,
             "copy_ms_per_event": 0.05, "rewrite_ms_per_event": 0.01}
            for c in (16, 48) for v, t, s in (
                ("Native", 100.0, 10.0), ("indirection-only", 99.5, 10.05),
                ("Naive-Evict (H2O)", 90.0, 11.0), ("vToken (H2O)", 95.0, 10.5),
                ("vToken force-sync (H2O)", 94.0, 10.6), ("Native (control)", 100.2, 9.98))]
    put(run, "benchmark_overhead", {"rows": over})
    put(run, "benchmark_sensitivity", {"rows": [
        {"workload": wl, "factor": "block_size", "value": 16, "retained_slots": 100.0,
         "capacity_norm": 1.0, "tok_s": 10.0, "tok_s_norm": 1.0, "p95_ms": 5.0,
         "p95_norm": 1.0, "relocations": 4} for wl in pr.WORKLOADS]})
    put(run, "benchmark_prefix_sharing", {"args": {"policy": "h2o",
                                                   "kv_evict_scope": "generated"},
                                          "budget": 48, "rows": [
        {"degree": 2, "naive_blocks": 40.0, "vtoken_blocks": 30.0, "reduction_%": 25.0,
         "hit_blocks": 16, "shared_skipped": 8, "relocations": 5, "invariants": "pass/pass",
         "identical_outputs": True}]})
    put(run, "benchmark_quality", {"rows": [
        {"policy": "h2o", "identical_pairs": "6/6", "rougeL_naive_vs_native": 0.8,
         "rougeL_vtoken_vs_native": 0.8, "mean_paired_diff": 0.0, "relocation_events": 12}]})
    put(run, "benchmark_token_table", {"kv_bytes_per_token": {"default (bfloat16)": 23040},
                                       "rows": [{"case": "1024 tokens, prefill",
                                                 "tokens": 1024, "capacity": 1024,
                                                 "table_bytes": 5120, "bytes_per_token": 5.0,
                                                 "view_bytes_per_live_token": 16.0,
                                                 "% of default (bfloat16)": 0.0217}]})
    with open(os.path.join(run, "steps.tsv"), "w") as f:
        f.write("step\tfigure\tstatus\tseconds\tbudget\tload\tcommand\n"
                "capacity\tFigs. 9-10\tok\t100\t150\t0.12\tpython x\n"
                "gpu\tGPU forms\tskipped (no GPU)\t0\t0\t-\tbash benchmarks/gpu_check.sh\n")
    return run


def write(run, tmp_path, **kw):
    out = tmp_path / "docs" / "results.md"
    args = pr.parse(["--run-dir", run, "--out", str(out), "--img-dir",
                     str(tmp_path / "docs" / "img" / "results"), "--mode", "quick",
                     "--command", "bash benchmarks/run_paper.sh --quick", "--date", "D"])
    pr.write(args)
    return out.read_text()


def test_every_section_with_its_table_and_plot(run_dir, tmp_path):
    page = write(run_dir, tmp_path)
    for _, heading in pr.SECTIONS:
        assert f"## {heading}" in page
    assert "Not measured" not in page
    assert "`bash benchmarks/run_paper.sh --quick`" in page and "Date: D" in page
    assert "| capacity | Figs. 9-10 | ok | 100 | 150 | 0.12 |" in page
    assert re.search(r"CPU: .*avx512f (yes|no), avx2 (yes|no), amx (yes|no)", page)
    links = re.findall(r"!\[[^]]*\]\(([^)]+)\)", page)
    assert len(links) >= 8 + 6                 # every script's plot, one per serving pair
    for link in links:
        assert link.startswith("img/results/"), link        # relative to docs/results.md
        assert (tmp_path / "docs" / link).exists()
    # the SLA rule and, per policy and workload, the mean gain with the run-to-run spread
    assert "SLA = 1.05 x Naive-Evict's p95" in page
    assert page.count("| +20.0% | +10.0% .. +30.0% | +10.0%, +30.0% | 2 4 8 | 4 | 2.00 | "
                      "4 / 8 |") == 6
    assert "Target vToken >= 2x Native at the Qwen2.5-14B shape: 2.00x (met)" in page
    assert "for each policy on both workloads: 6 of 6 met." in page
    assert "| 408 | 3261 | 3 | 3 | 6 |" in page            # budget, paper's, the frontiers
    assert "| 678 | 5427 | 5 | 5 | 8 |" in page
    assert "| 16 | +0.5% | -0.2% | +5.6% | -4.5% | -1.1% | +1.0% |" in page   # Fig. 11 ratios


def test_section_links_are_the_anchors_mkdocs_makes(run_dir, tmp_path):
    page = write(run_dir, tmp_path)
    for _, heading in pr.SECTIONS:
        assert f"(#{pr.slug(heading)})" in page
    toc = pytest.importorskip("markdown.extensions.toc")
    assert all(toc.slugify(h, "-") == pr.slug(h) for _, h in pr.SECTIONS)


def test_an_empty_run_still_gives_every_section(tmp_path):
    run = tmp_path / "empty"
    run.mkdir()
    page = write(str(run), tmp_path)
    for _, heading in pr.SECTIONS:
        assert f"## {heading}" in page
    assert page.count("**Not measured in this run**") == 9    # two capacity shapes, no GPU
    assert "GPU run: not run." in page


def test_a_scan_without_a_feasible_naive_point_has_no_ratio():
    run = serving(None, 120.0, "h2o")
    s = pr.serving_summary(run)
    assert s["ratio"] is None and s["vtoken_sel"] == 8
    rows = pr.fig8_rows({("longbench", "h2o"): [run, serving(100.0, 120.0, "h2o")]})
    row = next(r for r in rows if r["policy"] == "h2o" and r["workload"] == "LongBench-style")
    assert row["runs"] == 2 and row["gain"] == "+20.0%" and row["per_run"] == "+20.0%"


def test_a_json_of_several_scans_counts_each(tmp_path):
    """benchmark_serving.py --repeats writes its scans under "runs"; the file still names the
    workload and policy (serving_<workload>_<policy>, a _run<k> suffix allowed)."""
    one = serving(100.0, 150.0, "random")
    one["runs"] = [{"sla_s": 2.0, "summary": serving(100.0, v, "random")["summary"]}
                   for v in (150.0, 110.0)]
    put(str(tmp_path), "serving_sharegpt_random_run1", one)
    put(str(tmp_path), "serving_sharegpt_random", serving(100.0, 130.0, "random"))
    runs = pr.serving_runs(str(tmp_path))
    assert list(runs) == [("sharegpt", "random")] and len(runs[("sharegpt", "random")]) == 3
    row = pr.fig8_rows(runs)[0]
    assert row["gain"] == "+30.0%" and row["spread"] == "+10.0% .. +50.0%"


def test_dry_run_lists_every_figure_and_table_within_budget():
    run = subprocess.run(["bash", "benchmarks/run_paper.sh", "--quick", "--dry-run"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    for figure in ("Fig. 7", "Figs. 9-10 capacity, Llama-3.1-8B",
                   "Figs. 9-10 capacity, Qwen2.5-14B", "Fig. 11", "Fig. 12", "Table 1",
                   "Table 2", "token table bytes per token", "GPU forms", "docs/results.md"):
        assert figure in out, figure
    for wl in pr.WORKLOADS:      # one step a workload: its servers scan every policy in turn
        flags = f"--policy {' '.join(pr.POLICIES)} --dataset-name {wl}"
        lines = [ln for ln in out.splitlines() if flags in ln]
        assert len(lines) == 1, wl
        assert f"Fig. 8 SLA frontier ({wl})" in lines[0]
        assert "--repeats 2" in lines[0]                       # two scans: the spread
    assert "--concurrency 16 48" in out and "--kv-evict-scope generated" in out
    assert "--shape qwen2.5-14b" in out and "--workloads longbench sharegpt" in out
    total = int(re.search(r"budgets: (\d+) s", out).group(1))
    # --quick: the step budgets as measured on a quiet 2-core AVX2 host, within 30 minutes
    assert total <= 1800, total


def test_token_table_bytes_per_token_are_its_arrays_nbytes():
    import benchmark_token_table as btt
    for prompt, output in ((1000, 0), (300, 700), (4032, 12288)):
        tt = btt.grown_table(prompt, output, ratio=0.5)
        e = tt._entries["r"]
        assert btt.table_bytes(tt, "r") == e.slot.nbytes + e.live.nbytes
        assert e.slot.dtype.itemsize == 4 and e.live.dtype.itemsize == 1
        r = btt.measure(prompt, output)
        assert r["tokens"] == prompt + output == tt.length("r")
        assert r["bytes_per_token"] == (e.slot.nbytes + e.live.nbytes) / (prompt + output)
        assert 5.0 <= r["bytes_per_token"] <= 10.0             # capacity at most doubles
    assert btt.measure(1000, 0)["bytes_per_token"] == 5.0       # registered at once: exact
    assert btt.measure(4032, 12288)["view_bytes_per_live_token"] == 16.0


def test_qwen_shape_and_its_paper_setup():
    import transformers

    import benchmark_capacity as cap
    import common
    path = common.sim_config_dir(None, "qwen2.5-14b")
    hf = transformers.AutoConfig.from_pretrained(path)
    assert hf.architectures == ["Qwen2ForCausalLM"] and hf.vocab_size == 152064
    assert (hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads,
            hf.num_key_value_heads, hf.head_dim, hf.intermediate_size,
            hf.max_position_embeddings, hf.rope_parameters["rope_theta"]) == (
                48, 5120, 40, 8, 128, 13824, 32768, 1e6)
    assert cap.block_bytes(hf, 2, 1) == 2 * 48 * 8 * 128 * 2     # bf16 K + V per token
    prompt, output, (budget,) = cap.PAPER_SETUPS["qwen2.5-14b"]
    full, packed = -(-(prompt + output) // cap.BLOCK), cap.packed_blocks(prompt + output)
    assert budget // full == 3 and budget // packed == 6        # the paper's Native 3, vToken 6
