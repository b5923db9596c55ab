"""The results page of benchmarks/run_paper.sh: the run folder's JSON (each benchmark script's own
output, copied there by run_paper.sh) -> docs/results.md, one section per figure or table of the
paper's evaluation, each with its table and PNG (copied to docs/img/results/, linked relatively),
the CPU and its ISA flags, the date and the command. A result that is missing says so in its
section (the step's status from steps.tsv), so a partial run still gives a whole page.

    python benchmarks/paper_results.py --run-dir benchmarks/results/paper --mode quick
"""
import argparse
import csv
import datetime
import glob
import json
import os
import re
import shutil
import statistics
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = ("random", "h2o", "scissorhands")
WORKLOADS = ("sharegpt", "longbench")
WORKLOAD_NAMES = {"sharegpt": "ShareGPT", "longbench": "LongBench-style"}
# the paper's Llama-3.1-8B gains at C_sel (vToken / Naive-Evict - 1); Scissorhands: a range
# over both models
PAPER_SLA = {("sharegpt", "random"): "+37.0%", ("longbench", "random"): "+35.9%",
             ("sharegpt", "h2o"): "+12.5%", ("longbench", "h2o"): "+5.7%",
             ("sharegpt", "scissorhands"): "+33.3% to +103.7%",
             ("longbench", "scissorhands"): "+33.3% to +103.7%"}
# the paper's frontiers (Native, Naive-Evict, vToken) by paper budget, per shape
PAPER_CAPACITY = {"llama-3.1-8b": {5427: (5, 5, 8), 11519: (11, 11, 22)},
                  "qwen2.5-14b": {3261: (3, 3, 6)}}
MODES = {"full": "", "quick": ": small inputs, a few runs; compare variants within a row, not "
                             "with the paper's absolute numbers",
         "smoke": ": the tiny random model and the smallest inputs, a check of the pipeline; "
                  "the numbers mean nothing"}
SECTIONS = [  # (key, heading); a heading's anchor is its slug (slug())
    ("fig7", "Fig. 7: memory utilization and retained blocks"),
    ("fig8", "Fig. 8: SLA-constrained throughput frontier"),
    ("fig9", "Figs. 9-10: capacity frontier and block demand"),
    ("fig11", "Fig. 11: overhead and the async versus force-sync ablation"),
    ("fig12", "Fig. 12: sensitivity"),
    ("table1", "Table 1: prefix sharing"),
    ("table2", "Table 2: quality"),
    ("token-table", "Token table bytes per token"),
    ("gpu", "Figures that need a GPU"),
]


# ---- inputs ------------------------------------------------------------------------------------
def load(path: str) -> Optional[Dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def steps(run_dir: str) -> List[Dict]:
    try:
        with open(os.path.join(run_dir, "steps.tsv")) as f:
            return list(csv.DictReader(f, delimiter="\t"))
    except OSError:
        return []


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> Dict[str, str]:
    """The CPU's model name and whether it has avx512f, avx2, amx (amx_tile)."""
    try:
        text = open(cpuinfo).read()
    except OSError:
        text = ""
    name = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    flags = set((re.search(r"^flags\s*:\s*(.*)$", text, re.M) or [None, ""])[1].split())
    return {"cpu": name.group(1).strip() if name else "unknown",
            "avx512f": "yes" if "avx512f" in flags else "no",
            "avx2": "yes" if "avx2" in flags else "no",
            "amx": "yes" if "amx_tile" in flags else "no", "cores": str(os.cpu_count())}


def serving_runs(run_dir: str) -> Dict[tuple, List[Dict]]:
    """serving_<workload>_<policy>[_run<k>].json -> {(workload, policy): [scan, ...]}, a scan
    being {"sla_s", "summary"}. The filename names the workload and policy (the script's JSON
    may not); a JSON of several scans (benchmark_serving.py --repeats: "runs") gives each."""
    out: Dict[tuple, List[Dict]] = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "serving_*.json"))):
        m = re.match(r"serving_([a-z]+)_(\w+?)(_run\d+)?\.json$", os.path.basename(path))
        data = load(path)
        if m and data:
            scans = data.get("runs") or [data]
            out.setdefault((m.group(1), m.group(2)), []).extend(
                {"sla_s": r.get("sla_s"), "summary": r.get("summary", []),
                 "args": data.get("args", {}), "_png": path[:-5] + ".png"} for r in scans)
    return out


# ---- formatting --------------------------------------------------------------------------------
def fmt(v, spec: str = "") -> str:
    if v is None or v == "":
        return "-"
    if spec:
        return format(v, spec)
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def md_table(rows: Sequence[Dict], cols: Sequence,
             heads: Optional[Sequence[str]] = None) -> List[str]:
    """cols: key names, or (key, format spec) pairs."""
    cols = [c if isinstance(c, tuple) else (c, "") for c in cols]
    heads = heads or [c for c, _ in cols]
    lines = ["| " + " | ".join(heads) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c), s) for c, s in cols) + " |" for r in rows]
    return lines + [""]


def slug(heading: str) -> str:
    """A heading's anchor as mkdocs (python-markdown's toc) and GitHub both make it, for the
    headings here (no '/' or '&': those two differ)."""
    text = re.sub(r"[^\w\s-]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def pct(ratio: Optional[float]) -> Optional[str]:
    return None if ratio is None else f"{100 * (ratio - 1):+.1f}%"


class Page:
    """The page's lines, and its PNGs copied next to it."""

    def __init__(self, run_dir: str, img_dir: str, out: str):
        self.run_dir, self.img_dir, self.lines = run_dir, img_dir, []
        self.rel = os.path.relpath(img_dir, os.path.dirname(os.path.abspath(out)))

    def add(self, *lines: str) -> None:
        self.lines += lines

    def image(self, png: str, caption: str, name: Optional[str] = None) -> None:
        """Copy `png` (a path, or a name in the run folder) and link it; a missing one is said."""
        src = png if os.path.isabs(png) or os.path.exists(png) else os.path.join(
            self.run_dir, png)
        if not os.path.exists(src):
            self.add(f"*(no plot: {os.path.basename(png)} was not written)*", "")
            return
        name = name or os.path.basename(src)
        os.makedirs(self.img_dir, exist_ok=True)
        shutil.copyfile(src, os.path.join(self.img_dir, name))
        self.add(f"![{caption}]({self.rel}/{name})", "")

    def missing(self, what: str, step: str, status: Dict[str, str]) -> None:
        self.add(f"**Not measured in this run**: {what} is missing (step `{step}`: "
                 f"{status.get(step, 'not run')}).", "")


# ---- sections ----------------------------------------------------------------------------------
def fig7(page: Page, d: Optional[Dict], status: Dict[str, str]) -> None:
    page.add("Paper (Llama-3.1-8B, Mistral-7B on an H100): vToken raises mean memory utilization "
             "by 21.88% / 21.67% and cuts retained blocks per request by 27.2%-72.3% against "
             "Naive-Evict, on every workload and policy. Here: the default model on this CPU, "
             "same prompts, policy and ratio per pair; blocks per request are a time average "
             "over each request's decode steps, utilization = live tokens / allocated slots.", "")
    if not d:
        return page.missing("benchmark_reclamation.json", "reclamation", status)
    rows = d["rows"]
    page.add(*md_table(rows, ["workload", "policy", ("naive_blocks", ".1f"),
                              ("vtoken_blocks", ".1f"), ("block_reduction_%", ".1f"),
                              ("ideal_final", ".1f"), ("naive_util", ".3f"),
                              ("vtoken_util", ".3f"), ("util_gain_pp", "+.1f")],
                       ["workload", "policy", "Naive-Evict blocks/req", "vToken blocks/req",
                        "block reduction %", "ideal at finish", "Naive-Evict util",
                        "vToken util", "util gain (pp)"]))
    red = [r["block_reduction_%"] for r in rows]
    page.add(f"Retained blocks: {min(red):.1f}%-{max(red):.1f}% fewer with vToken; utilization "
             f"+{statistics.mean(r['util_gain_pp'] for r in rows):.1f} percentage points on "
             f"average ({d.get('model', '')}).", "")
    page.image("benchmark_reclamation.png", "Fig. 7: blocks per request and utilization")


def serving_summary(run: Dict) -> Dict:
    """One scan -> C_sel, tok/s and p95 of Naive-Evict and vToken, and their ratio."""
    by = {s["variant"]: s for s in run.get("summary", [])}
    key = next((k for s in by.values() for k in s if k.endswith("_sel")), "C_sel")
    nv, vt = by.get("Naive-Evict", {}), by.get("vToken", {})
    ratio = vt["tok_s"] / nv["tok_s"] if vt.get("tok_s") is not None and nv.get("tok_s") \
        else None                        # vToken at 0 tok/s (its requests failed): -100%
    p95 = vt["p95_s"] / nv["p95_s"] if vt.get("p95_s") and nv.get("p95_s") else None
    args = run.get("args") or {}
    return {"naive_sel": nv.get(key), "vtoken_sel": vt.get(key), "naive_tok_s": nv.get("tok_s"),
            "vtoken_tok_s": vt.get("tok_s"), "ratio": ratio, "p95_ratio": p95,
            "sla_s": run.get("sla_s"), "c_ref": args.get("c_ref"),
            "levels": " ".join(map(str, args.get("levels") or [])) or None}


SLA_TARGET = 1.15      # vToken's tok/s at C_sel over Naive-Evict's, every policy and workload


def fig8_rows(runs: Dict[tuple, List[Dict]]) -> List[Dict]:
    rows = []
    for wl in WORKLOADS:
        for policy in POLICIES:
            each = [serving_summary(r) for r in runs.get((wl, policy), [])]
            ratios = [s["ratio"] for s in each if s["ratio"] is not None]
            row = {"workload": WORKLOAD_NAMES[wl], "policy": policy, "runs": len(each),
                   "paper": PAPER_SLA[(wl, policy)]}
            if ratios:
                row.update({"gain_x": statistics.mean(ratios),
                            "gain": pct(statistics.mean(ratios)),
                            "spread": f"{pct(min(ratios))} .. {pct(max(ratios))}",
                            "per_run": ", ".join(pct(x) for x in ratios)})
            if each:
                s = each[0]
                row.update({"c_ref": s["c_ref"], "levels": s["levels"],
                            "C_sel": f"{fmt(s['naive_sel'])} / {fmt(s['vtoken_sel'])}",
                            "tok_s": f"{fmt(s['naive_tok_s'], '.1f')} / "
                                     f"{fmt(s['vtoken_tok_s'], '.1f')}",
                            "p95": pct(s["p95_ratio"]), "sla": fmt(s["sla_s"], ".2f")})
            rows.append(row)
    return rows


def fig8(page: Page, runs: Dict[tuple, List[Dict]], status: Dict[str, str]) -> None:
    page.add("Target rule (the paper's): SLA = 1.05 x Naive-Evict's p95 request latency at the "
             "reference concurrency C_ref; C_sel = each variant's highest-throughput concurrency "
             "whose p95 meets the SLA; reported: vToken's output tok/s at its C_sel against "
             "Naive-Evict's at its C_sel, per policy and workload, over repeated scans (the "
             "spread is the lowest and highest of the runs). Paper (H100, C_ref = 8): "
             "Llama-3.1-8B +18.9% on average, Random +37.0% (ShareGPT) / +35.9% (LongBench), "
             "H2O +12.5% / +5.7%, Scissorhands +33.3% to +103.7% (both models). Here: "
             "`benchmark_serving.py` on the default model, one api_server per variant with the "
             "same KV block budget (per workload; the policies scanned in turn on them, each "
             "request naming its own), closed-loop clients; C_sel, tok/s and p95 columns are the "
             "first run's (Naive-Evict / vToken).", "")
    if not runs:
        return page.missing("serving_*.json", "serving", status)
    rows = fig8_rows(runs)
    page.add(*md_table(rows, ["workload", "policy", "runs", "gain", "spread",
                                         "per_run", "levels", "c_ref", "sla", "C_sel", "tok_s",
                                         "p95", "paper"],
                       ["workload", "policy", "runs", "vToken vs Naive-Evict tok/s at C_sel",
                        "spread (min .. max)", "each run", "C scanned", "C_ref", "SLA (s)",
                        "C_sel (Naive / vToken)", "tok/s (Naive / vToken)",
                        "vToken p95 vs Naive", "paper"]))
    met = [r for r in rows if r.get("gain_x") is not None and r["gain_x"] >= SLA_TARGET]
    short = [f"{r['workload']} {r['policy']} ({r.get('gain', 'not measured')})" for r in rows
             if r not in met]
    page.add(f"Target vToken >= {SLA_TARGET:.2f}x Naive-Evict at C_sel (the mean of the runs) "
             f"for each policy on both workloads: {len(met)} of {len(rows)} met"
             + (f"; short: {', '.join(short)}." if short else "."), "")
    for wl in WORKLOADS:
        if not any(k[0] == wl for k in runs):
            page.add(f"{WORKLOAD_NAMES[wl]}: not measured (benchmark_serving.py run without "
                     f"`--dataset-name {wl}`, or it failed; see the steps).", "")
    for (wl, policy), rs in sorted(runs.items()):
        page.image(rs[0]["_png"], f"Fig. 8: {wl} {policy}", f"serving_{wl}_{policy}.png")


CAPACITY = [("benchmark_capacity_sim", "llama-3.1-8b", "Llama-3.1-8B shape, simulated"),
            ("benchmark_capacity_sim_qwen2.5-14b", "qwen2.5-14b", "Qwen2.5-14B shape, simulated"),
            ("benchmark_capacity", None, "default model, real engine on this CPU")]
VARIANTS = ("Native", "Naive-Evict", "vToken")


def capacity_rows(d: Dict, shape: Optional[str]) -> List[Dict]:
    scale = (d.get("setup") or {}).get("scale") or 1.0
    paper = PAPER_CAPACITY.get(shape, {})
    rows = []
    for r in d["rows"]:
        pb = next((b for b in paper if round(b * scale) == r["budget"]), None)
        row = {"budget": r["budget"], "paper_budget": pb, "ideal": r.get("ideal"),
               "ratio": r.get("vToken / Native"),
               "paper": "/".join(map(str, paper[pb])) if pb else None}
        for v in VARIANTS:
            c = r.get(v)
            row[v] = None if c is None else f"{c}{'+' if r.get(f'{v} at cap') else ''}"
            row[f"{v} blocks"] = r.get(f"{v} blocks/req")
        rows.append(row)
    return rows


def fig9(page: Page, data: Dict[str, Optional[Dict]], status: Dict[str, str]) -> None:
    page.add("The highest concurrency C whose C requests all stay resident and finish without "
             "preemption or a stalled step under a fixed KV block budget (H2O, ratio 0.5, block "
             "16). Paper (H100): Llama-3.1-8B, LongBench prompts + 12,288 output tokens: "
             "Native / Naive-Evict 5, vToken 8 at 5,427 blocks (+60%); 11, 11, 22 at 11,519; "
             "Qwen2.5-14B, 8,192 output tokens, 3,261 blocks: 3, 3, 6 (2x). Target here: vToken "
             ">= 2x Native at the Qwen2.5-14B shape. The simulated executor (`--load-format "
             "simulate`) runs the real scheduler, block manager, token tables, policy and "
             "planner with synthetic attention statistics at the paper's shapes; lengths and "
             "budgets are scaled together by the run's scale, so the frontiers compare with the "
             "paper's. Fig. 10's mechanism is the blocks per request at each frontier: full "
             "retention needs ceil(L / 16), a packed H2O request ceil(R(L) / 16).", "")
    for name, shape, label in CAPACITY:
        d = data.get(name)
        if not d:
            if shape:
                page.missing(f"{name}.json ({label})", "capacity", status)
            continue
        setup = d.get("setup") or {}
        page.add(f"**{label}** (scale {fmt(setup.get('scale'))}: prompt "
                 f"{fmt(setup.get('prompt_len'))} + output {fmt(setup.get('output_len'))} tokens, "
                 f"{fmt(d.get('full_blocks'))} blocks a request in full, "
                 f"{fmt(d.get('ideal_blocks'))} packed):", "")
        rows = capacity_rows(d, shape)
        page.add(*md_table(rows, ["budget", "paper_budget", *VARIANTS, "ideal", ("ratio", ".2f"),
                                  "paper", *[(f"{v} blocks", ".1f") for v in VARIANTS]],
                           ["KV blocks", "paper blocks", *VARIANTS, "ideal (packed)",
                            "vToken / Native", "paper (Native/Naive/vToken)",
                            *[f"{v} peak blocks/req" for v in VARIANTS]]))
        if shape == "qwen2.5-14b":
            ratio = rows[0]["ratio"] if rows else None
            met = "not measured" if ratio is None else "met" if ratio >= 2 else "NOT met"
            page.add(f"Target vToken >= 2x Native at the Qwen2.5-14B shape: {fmt(ratio, '.2f')}x"
                     f" ({met}).", "")
        page.image(f"{name}.png", f"Fig. 9: {label}")
    page.add("'+' = the search's cap (the workload's request count), not a failure.", "")


def overhead_ablation(rows: List[Dict]) -> List[Dict]:
    """Per C: the ratios Fig. 11 reads (indirection vs Native, vToken and force-sync vs
    Naive-Evict), beside the control's noise floor."""
    def kind(name: str) -> str:       # "vToken force-sync (H2O)" -> "vToken force-sync"
        return name if name == "Native (control)" else name.split(" (")[0]
    out = []
    for c in sorted({r["C"] for r in rows}):
        by = {kind(r["variant"]): r for r in rows if r["C"] == c}

        def ratio(a, b, key):
            return by[a][key] / by[b][key] if a in by and b in by and by[b][key] else None
        out.append({"C": c,
                    "indirection": pct(ratio("indirection-only", "Native", "step_ms_median")),
                    "control": pct(ratio("Native (control)", "Native", "step_ms_median")),
                    "vt_tok": pct(ratio("vToken", "Naive-Evict", "tok_s")),
                    "vt_p95": pct(ratio("vToken", "Naive-Evict", "step_ms_p95")),
                    "sync_tok": pct(ratio("vToken force-sync", "vToken", "tok_s")),
                    "sync_p95": pct(ratio("vToken force-sync", "vToken", "step_ms_p95"))})
    return out


def fig11(page: Page, d: Optional[Dict], status: Dict[str, str]) -> None:
    page.add("Paper (H100, Llama-3.1-8B, LongBench, H2O, C = 16 and 48): indirection alone "
             "(hooks on, nothing evicted) changes throughput and p95 by under 1% against "
             "Native; planning dominates the CPU-side cost per relocation event (a); with "
             "async copies no synchronization wait shows, the force-sync ablation blocks per "
             "event (b); async reclamation beats Naive-Evict on throughput and decode p95 at "
             "both C (c). Here: the default model on this CPU, all variants stepped in turn in "
             "one process. On a CPU the copy is synchronous either way, so force-sync and "
             "async should match here: (b) and the copy/decode overlap need a GPU (below).", "")
    if not d:
        return page.missing("benchmark_overhead.json", "overhead", status)
    rows = d["rows"]
    page.add(*md_table(rows, ["C", "variant", ("tok_s", ".1f"), ("tok_s_vs_native", ".3f"),
                              ("step_ms_median", ".2f"), ("step_ms_p95", ".2f"),
                              ("step_vs_native", ".3f"), ("hook_share_%", ".2f")],
                       ["C", "variant", "tok/s", "tok/s vs Native", "step ms (median)",
                        "step ms (p95)", "step vs Native", "vToken hooks % of step"]))
    page.add("(a) Reclamation cost per relocation event (planner includes the per-step "
             "eligibility checks; copy = launch and accounting); (b) the time the engine waited "
             "on copies per event:", "")
    page.add(*md_table([r for r in rows if r.get("relocation_events")],
                       ["C", "variant", ("relocation_events", ".1f"),
                        ("planner_ms_per_event", ".3f"),
                        ("copy_ms_per_event", ".3f"), ("rewrite_ms_per_event", ".3f"),
                        ("blocked_ms_per_event", ".3f")],
                       ["C", "variant", "events", "planner ms", "copy ms", "table rewrite ms",
                        "(b) blocked on the copy, ms"]))
    page.add("(b, c) Ratios (step time median for indirection and its control; tok/s and "
             "decode-step p95 for the rest):", "")
    page.add(*md_table(overhead_ablation(rows),
                       ["C", "indirection", "control", "vt_tok", "vt_p95", "sync_tok",
                        "sync_p95"],
                       ["C", "indirection-only vs Native (target < 1%)",
                        "Native control vs Native (noise)", "vToken vs Naive-Evict tok/s",
                        "vToken vs Naive-Evict p95", "force-sync vs async tok/s",
                        "force-sync vs async p95"]))
    page.image("benchmark_overhead.png", "Fig. 11: step time and reclamation cost")


def fig12(page: Page, d: Optional[Dict], status: Dict[str, str]) -> None:
    page.add("One factor at a time around block 16 / eviction ratio 0.5 / fragmentation "
             "threshold 0.25, H2O with vToken, fixed concurrency; retained KV capacity = "
             "retained blocks x block size, each normalised to the default per workload. "
             "Paper: block 32 best, 48 trades capacity for speed; ratio 0.3 -> 0.7 cuts "
             "capacity and raises throughput; the threshold matters little.", "")
    if not d:
        return page.missing("benchmark_sensitivity.json", "sensitivity", status)
    page.add(*md_table(d["rows"], ["workload", "factor", "value", ("retained_slots", ".1f"),
                                   ("capacity_norm", ".3f"), ("tok_s", ".1f"),
                                   ("tok_s_norm", ".3f"), ("p95_ms", ".2f"),
                                   ("p95_norm", ".3f"), "relocations"],
                       ["workload", "factor", "value", "retained slots", "capacity (norm.)",
                        "tok/s", "tok/s (norm.)", "p95 step ms", "p95 (norm.)",
                        "relocations"]))
    missing = [w for w in WORKLOADS if w not in {r["workload"] for r in d["rows"]}]
    if missing:
        page.add(f"Not in this run: {', '.join(WORKLOAD_NAMES[w] for w in missing)}.", "")
    page.image("benchmark_sensitivity.png", "Fig. 12: sensitivity")


def table1(page: Page, d: Optional[Dict], status: Dict[str, str]) -> None:
    page.add("Shared prefix + private suffix per request in groups of `degree`, prefix caching "
             "on for both variants, H2O under `--kv-evict-scope generated` (the prompt is kept "
             "and takes every cache hit; generated tokens beyond the budget are evicted), "
             "invariant checks on. Paper (Llama-3.1-8B, 8K + 8K tokens): at degrees 2, 4, 8 "
             "every shared-prefix candidate is skipped, every check passes, and vToken holds "
             "28.6%-42.2% fewer blocks than Naive-Evict.", "")
    if not d:
        return page.missing("benchmark_prefix_sharing.json", "prefix_sharing", status)
    args = d.get("args", {})
    page.add(f"Policy {args.get('policy')}, scope {args.get('kv_evict_scope', 'all')}, budget "
             f"{fmt(d.get('budget'))} tokens; {d.get('model', '')}.", "")
    page.add(*md_table(d["rows"], ["degree", ("naive_blocks", ".1f"), ("vtoken_blocks", ".1f"),
                                   ("reduction_%", ".1f"), "hit_blocks", "shared_skipped",
                                   "relocations", "invariants", "identical_outputs"],
                       ["degree", "Naive-Evict blocks (time avg)", "vToken blocks",
                        "reduction %", "prefix-cache hit blocks", "shared blocks skipped",
                        "relocations", "invariants (Naive/vToken)", "identical outputs"]))
    page.image("benchmark_prefix_sharing.png", "Table 1: prefix sharing")


def table2(page: Page, d: Optional[Dict], status: Dict[str, str]) -> None:
    page.add("Naive-Evict and vToken apply the same eviction decisions, so their greedy outputs "
             "should be token-identical (vToken only moves where KV bytes live; the paper's "
             "invariants I1/I2, checked on every step of the vToken runs); ROUGE-L F1 against "
             "Native (full KV) is the policy's own quality cost.", "")
    if not d:
        return page.missing("benchmark_quality.json", "quality", status)
    page.add(*md_table(d["rows"], ["policy", "identical_pairs", ("rougeL_naive_vs_native", ".3f"),
                                   ("rougeL_vtoken_vs_native", ".3f"),
                                   ("mean_paired_diff", "+.4f"), "relocation_events"],
                       ["policy", "identical pairs", "ROUGE-L Naive-Evict vs Native",
                        "ROUGE-L vToken vs Native", "mean paired difference",
                        "relocation events (I1/I2 checked)"]))
    page.image("benchmark_quality.png", "Table 2: quality")


def token_table(page: Page, d: Optional[Dict], status: Dict[str, str]) -> None:
    page.add("Per request, the token table holds an int32 slot and a bool liveness flag per "
             "logical token (vllm/core/token_table.py), capacity doubling as it grows; bytes "
             "per token = the arrays' nbytes / tokens, and that as a share of the KV bytes one "
             "token takes in the pool (every layer's K and V). The paper: O(L) per sequence, "
             "independent of layers and heads.", "")
    if not d:
        return page.missing("benchmark_token_table.json", "token_table", status)
    kv = d.get("kv_bytes_per_token", {})
    page.add("KV bytes per token: " + ", ".join(f"{m} {b:,}" for m, b in kv.items()) + ".", "")
    page.add(*md_table(d["rows"], ["case", "tokens", "capacity", "table_bytes",
                                   ("bytes_per_token", ".2f"),
                                   ("view_bytes_per_live_token", ".1f"),
                                   *[(f"% of {m}", ".4f") for m in kv]],
                       ["case", "tokens", "entries allocated", "table bytes",
                        "table bytes/token", "attention view bytes/live token",
                        *[f"% of KV/token, {m}" for m in kv]]))
    page.image("benchmark_token_table.png", "Token table bytes per token")


GPU_FIGURES = [
    ("Fig. 8", "the SLA scan at the paper's model shape (bf16, CUDA graphs)",
     "gpu_check.sh step `sla` (benchmark_gpu_decode.py --parts sla)"),
    ("Figs. 9-10", "the capacity frontier on the real GPU engine (1/4 scale, dummy weights)",
     "gpu_check.sh steps `capacity`, `capacity_naive`"),
    ("Fig. 11 (b, c)", "async relocation copies overlapping decode vs --kv-reclaim-force-sync, "
     "throughput and p95 vs Naive-Evict at C = 16 and 48",
     "gpu_check.sh step `overhead` (benchmark_overhead.py --device cuda, random weights, "
     "policy random)"),
    ("Fig. 11", "indirection overhead at batch 16 (< 1%), the relocation copy kernel's rate",
     "gpu_check.sh steps `decode`, `relocation`"),
]


def gpu(page: Page, run_dir: str, status: Dict[str, str]) -> None:
    page.add("On this CPU the relocation copy is synchronous and there are no CUDA graphs, so "
             "these figures' GPU forms run in `benchmarks/gpu_check.sh` on a lent GPU (one "
             "script, ~9 min; run_paper.sh runs it as its `gpu` step where nvidia-smi lists a "
             "GPU). The CPU sections above are their CPU forms.", "")
    page.add(*md_table([{"fig": f, "what": w, "where": s} for f, w, s in GPU_FIGURES],
                       ["fig", "what", "where"], ["figure", "needs a GPU for", "GPU form"]))
    res = load(os.path.join(run_dir, "gpu", "gpu_check.json"))
    if not res:
        page.add(f"GPU run: {status.get('gpu', 'not run')}.", "")
        return
    page.add(f"GPU run: {res.get('device')}, {res.get('seconds')} s of a {res.get('budget')} s "
             f"budget.", "")
    page.add(*md_table([{"target": k, **t} for k, t in (res.get("targets") or {}).items()],
                       ["target", "value", "must", "must_met"]))
    over = load(os.path.join(run_dir, "gpu", "gpu_check", "overhead_gpu.json"))
    if over:
        page.add(f"Fig. 11 (b, c) on the GPU ({over.get('model', '')}):", "")
        page.add(*md_table(overhead_ablation(over["rows"]), ["C", "vt_tok", "vt_p95",
                                                             "sync_tok", "sync_p95"],
                           ["C", "vToken vs Naive-Evict tok/s", "vToken vs Naive-Evict p95",
                            "force-sync vs async tok/s", "force-sync vs async p95"]))
        page.add(*md_table([r for r in over["rows"] if r.get("relocation_events")],
                           ["C", "variant", ("relocation_events", ".1f"),
                            ("copy_ms_per_event", ".3f"), ("blocked_ms_per_event", ".3f")],
                           ["C", "variant", "events", "copy launch ms", "blocked on the copy, ms"]))
        page.image(os.path.join(run_dir, "gpu", "gpu_check", "overhead_gpu.png"),
                   "Fig. 11 on the GPU")


# ---- the page ----------------------------------------------------------------------------------
def header(page: Page, args, step_rows: List[Dict], machine: str) -> None:
    cpu = cpu_flags()
    date = args.date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    page.add("# Results: the vToken paper's evaluation on this machine", "",
             "Written by `benchmarks/paper_results.py` from the run folder of "
             "`benchmarks/run_paper.sh`; rerun that command to reproduce this page.", "",
             *([f"> **Note:** {args.note}", ""] if args.note else []),
             f"- Command: `{args.command}` ({args.mode} settings{MODES[args.mode]})",
             f"- Date: {date}",
             f"- CPU: {cpu['cpu']}, {cpu['cores']} cores; avx512f {cpu['avx512f']}, avx2 "
             f"{cpu['avx2']}, amx {cpu['amx']}" + (f"; {args.threads} torch threads"
                                                   if args.threads else ""),
             f"- Engine: {machine or 'see each script JSON'}",
             "- GPU: " + ("none (the figures that need one say so)" if not os.path.exists(
                 os.path.join(args.run_dir, "gpu", "gpu_check.json")) else "see the GPU section"),
             "")
    page.add("Sections: " + ", ".join(f"[{h}](#{slug(h)})" for _, h in SECTIONS), "")
    if step_rows:
        total = sum(int(r.get("seconds") or 0) for r in step_rows)
        page.add(f"Steps (wall seconds against each step's budget, {total} s in all; load = "
                 f"the host's 1-minute load average as the step started, which counts the "
                 f"step before it too: on a {cpu['cores']}-core host, a load well above "
                 f"{cpu['cores']} means other work ran beside the run):", "")
        page.add(*md_table(step_rows, ["step", "figure", "status", "seconds", "budget",
                                       "load"]))


def write(args) -> str:
    run = args.run_dir
    step_rows = steps(run)
    status: Dict[str, str] = {}
    for r in step_rows:       # a step that ran several times (serving): any failure shows
        if status.get(r["step"], "ok") == "ok":
            status[r["step"]] = r["status"]
    data = {os.path.basename(p)[:-5]: load(p) for p in glob.glob(os.path.join(run, "*.json"))}
    machine = next((d.get("machine") for d in data.values() if d and d.get("machine")), "")
    page = Page(run, args.img_dir, args.out)
    header(page, args, step_rows, machine)
    bodies = {
        "fig7": lambda: fig7(page, data.get("benchmark_reclamation"), status),
        "fig8": lambda: fig8(page, serving_runs(run), status),
        "fig9": lambda: fig9(page, data, status),
        "fig11": lambda: fig11(page, data.get("benchmark_overhead"), status),
        "fig12": lambda: fig12(page, data.get("benchmark_sensitivity"), status),
        "table1": lambda: table1(page, data.get("benchmark_prefix_sharing"), status),
        "table2": lambda: table2(page, data.get("benchmark_quality"), status),
        "token-table": lambda: token_table(page, data.get("benchmark_token_table"), status),
        "gpu": lambda: gpu(page, run, status),
    }
    for key, heading in SECTIONS:
        page.add(f"## {heading}", "")
        bodies[key]()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(page.lines).rstrip() + "\n")
    return args.out


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", default=os.path.join(ROOT, "benchmarks", "results", "paper"))
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "results.md"))
    p.add_argument("--img-dir", default=os.path.join(ROOT, "docs", "img", "results"))
    p.add_argument("--mode", default="full", choices=list(MODES))
    p.add_argument("--command", default="bash benchmarks/run_paper.sh")
    p.add_argument("--threads", default=None)
    p.add_argument("--date", default=None, help="default: now (UTC)")
    p.add_argument("--note", default=None, help="a line at the top of the page (the run's "
                                                  "conditions, say)")
    return p.parse_args(argv)


if __name__ == "__main__":
    print(f"wrote {write(parse())}")
