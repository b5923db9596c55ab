#!/usr/bin/env bash
# One script for a lent GPU machine (one H200, under ~9 minutes): the headline GPU figures first,
# each saved the moment it is measured, then the GPU tests and the rest as the budget allows.
# Runs from the source tree (PYTHONPATH=.), installs nothing, needs no network, and imports no
# server module (no fastapi/uvicorn there).
#
#   bash benchmarks/gpu_check.sh      # -> $OUT (device tool) or benchmarks/results:
#                                     #    gpu_check.json, gpu_check.log, gpu_check/ (per step)
#   GPU_CHECK_CPU_DRY_RUN=1 bash benchmarks/gpu_check.sh    # the flow on a CPU: benchmarks on
#                                     # their toy config, GPU steps failing or skipped (minutes)
#
# The order (every step under its own timeout, capped by what is left of GPU_CHECK_BUDGET s,
# default 520; a step that would get under GPU_CHECK_MIN_STEP s, default 20, is skipped, and so
# is each step GPU_CHECK_SKIP names, e.g. GPU_CHECK_SKIP="relocation test_kernels"):
#   env, relocate_op   the GPU, versions; which relocation kernel loads (prebuilt, jit or none)
#   capacity           headline 1: the Native and vToken frontiers -> capacity_vtoken_vs_native
#   decode             headline 2: batch 16 Native, vToken, transformers first -> vs transformers
#                      (then the other batches, the indirection rounds, Naive-Evict)
#   relocation         headline 3: the CUDA kernel's share of the device-to-device copy rate
#   capacity_naive     the Naive-Evict frontier, in the background (feasibility, not speed) beside
#   test_*             the GPU tests (kernels, engine, graphs, the rest of tests/gpu)
#   sla                the SLA scan, then the fp8 KV cache's decode against bf16 KV (the
#                      decode benchmark's fp8 part), with what is left
#   overhead           only where nvidia-smi lists a GPU (or GPU_CHECK_CPU_DRY_RUN), with what is
#                      left: the paper's Fig. 11 (b, c), async relocation copies against
#                      --kv-reclaim-force-sync and Naive-Evict at C = 16 and 48
#                      (benchmark_overhead.py --device cuda, the Llama-3.1-8B layer shape, 8
#                      layers, random weights, so policy random: see its docstring)
#                      -> gpu_check/overhead_gpu.json. The paper figures' run (run_paper.sh)
#                      gives it room with GPU_CHECK_SKIP="test_kernels test_engine test_graphs
#                      test_gpu_other".
# The headline steps' timeouts add up to at most the budget, so each gets its whole timeout even
# if all of them run to it; the run ends within the budget plus a step's 10 s kill grace and the
# summary (~535 s by default; the device tool allows 600). The capacity and decode benchmarks save
# after every measurement into gpu_check/ (capacity.json, gpu_decode.json), the relocation
# benchmark when it ends (relocation_<device>.json, ~20 s), and gpu_check.json (every step's
# status, the test counts, the figures, each target's pass/fail) is rewritten after every step, so
# a run cut anywhere keeps what it measured. The one-screen summary is printed at the end, also
# after timed-out steps or on SIGINT/SIGTERM (the running steps are stopped and recorded as
# interrupted).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
RESULTS=${OUT:-benchmarks/results}
BUDGET=${GPU_CHECK_BUDGET:-520}
MIN_STEP=${GPU_CHECK_MIN_STEP:-20}
SKIP=${GPU_CHECK_SKIP:-}             # step names to leave out (a rerun of what failed)
PARTS="$RESULTS/gpu_check"
rm -rf "$PARTS"                      # this script's own folder: no stale figures from a past run
mkdir -p "$PARTS"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
DEV=cuda QUICK=
if [ -n "${GPU_CHECK_CPU_DRY_RUN:-}" ]; then DEV=cpu QUICK=--quick; fi
LOG="$RESULTS/gpu_check.log"
: >"$LOG"
: >"$PARTS/steps.tsv"
start=$SECONDS
BG_PID=

# summarize [print]: gpu_check.json from gpu_check/ (atomically); with print, the summary too
summarize() {
  $PY - "$PARTS" "$RESULTS/gpu_check.json" "$((SECONDS - start))" "$DEV" "$BUDGET" "${1:-}" \
    <<'EOF'
import glob, json, os, sys
import xml.etree.ElementTree as ET
parts, path, seconds, dev, budget, show = sys.argv[1:7]
seconds, budget = int(seconds), int(budget)
STATUS = {"0": "ok", "124": "timeout", "137": "timeout", "143": "interrupted"}
steps = []
for line in open(os.path.join(parts, "steps.tsv")):
    name, rc, secs, limit = line.rstrip("\n").split("\t")
    status = STATUS.get(rc, "failed" if rc.isdigit() else rc)
    steps.append({"name": name, "status": status, "rc": rc, "seconds": int(secs),
                  "timeout": int(limit)})
out = {"seconds": seconds, "budget": budget, "steps": steps, "tests": {}}
for f in sorted(glob.glob(os.path.join(parts, "junit-*.xml"))):
    try:
        suite = ET.parse(f).getroot()
    except ET.ParseError:                       # a run cut while pytest wrote it
        continue
    suite = suite if suite.tag == "testsuite" else suite[0]
    bad = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
           if c.find("failure") is not None or c.find("error") is not None]
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    n["passed"] = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    out["tests"][os.path.basename(f)[6:-4]] = {**n, "failed_tests": bad}
def load(name):
    try:
        with open(os.path.join(parts, name)) as fh:
            return json.load(fh)
    except (OSError, ValueError):               # absent, or being written right now
        return None
bench = load("gpu_decode.json") or {}
# capacity_sla.json: capacity.json (the headline) plus Naive-Evict and the SLA scan, when readable
cap_all = load("capacity_sla.json") or load("capacity.json") or {}
out.update({k: bench.get(k, cap_all.get(k)) for k in ("device", "dtype", "model", "graphs",
                                                      "torch")})
out["relocation_kernel"] = (load("relocate_op.json") or {}).get("backend")
out.update({"decode": bench.get("decode"), "capacity": cap_all.get("capacity"),
            "sla": cap_all.get("sla"), "fp8": cap_all.get("fp8")})
out["benchmark_seconds"] = {**(bench.get("seconds") or {}), **(cap_all.get("seconds") or {})}
out["relocation"] = load(f"relocation_{dev}.json")
over = load("overhead_gpu.json") or {}
out["overhead"] = [{k: r.get(k) for k in ("C", "variant", "tok_s", "step_ms_median",
                                          "step_ms_p95", "relocation_events")}
                   for r in over.get("rows", [])] or None
dec, cap, rel = out["decode"] or {}, out["capacity"] or {}, out["relocation"] or {}
b16 = dec.get("16", {})
targets = {
    "capacity_vtoken_vs_native": cap.get("vToken_vs_Native"),
    "decode_vs_transformers_batch16": b16.get("ratios", {}).get("vToken / transformers"),
    "relocation_share_of_d2d_min_ge256": min(
        (rel.get("headline") or {}).get("cuda" if dev == "cuda" else "torch", {}).values(),
        default=None),
    "indirection_overhead_batch16": (b16.get("indirection_overhead")
                                     if isinstance(b16.get("indirection_overhead"), float)
                                     else None),           # a dict: its error
}
MUST = {"capacity_vtoken_vs_native": (">= +60%", lambda v: v >= 0.6),
        "decode_vs_transformers_batch16": (">= 3x", lambda v: v >= 3),
        "relocation_share_of_d2d_min_ge256": (">= 50%", lambda v: v >= 0.5),
        "indirection_overhead_batch16": ("< 1%", lambda v: v < 0.01)}
out["targets"] = {k: {"value": v, "must": MUST[k][0],
                      "must_met": None if v is None else bool(MUST[k][1](v))}
                  for k, v in targets.items()}
tmp = path + ".tmp"
with open(tmp, "w") as fh:
    json.dump(out, fh, indent=1, default=float)
os.replace(tmp, path)
if show != "print":
    raise SystemExit(0)
fmt = {"capacity_vtoken_vs_native": "{:+.0%}", "decode_vs_transformers_batch16": "{:.2f}x",
       "relocation_share_of_d2d_min_ge256": "{:.0%}", "indirection_overhead_batch16": "{:+.2%}"}
print(f"\n==== gpu_check summary: {seconds} s of a {budget} s budget; {out['device'] or dev}, "
      f"torch {out['torch'] or '?'}, relocation kernel: {out['relocation_kernel'] or 'none'}")
print(f"{'target':<36}{'value':>10}  {'must':<9}met")
for k, t in out["targets"].items():
    v = "-" if t["value"] is None else fmt[k].format(t["value"])
    met = {None: "not measured", True: "yes", False: "NO"}[t["must_met"]]
    print(f"{k:<36}{v:>10}  {t['must']:<9}{met}")
fp8 = out["fp8"] or {}
for b, r in list((fp8.get("batches") or {}).items())[:1]:      # informational: no target
    ratios = ", ".join(f"{k.split()[0]} {v:.2f}x" for k, v in r.get("ratios", {}).items())
    print(f"fp8 KV decode vs {out['dtype'] or 'auto'} KV (batch {b}, {fp8.get('context')} "
          f"tokens): {ratios or 'not measured'}")
over = {(r["C"], r["variant"]): r for r in out["overhead"] or []}
for c in sorted({c for c, _ in over}):                          # informational: no target
    a, f, n = (over.get((c, v), {}).get("tok_s") for v in
               ("vToken (random)", "vToken force-sync (random)", "Naive-Evict (random)"))
    if a and f and n:
        print(f"Fig. 11 at C={c}: vToken async {a / n:.2f}x Naive-Evict tok/s, force-sync "
              f"{f / n:.2f}x")
print(f"{'step':<20}{'status':<13}{'seconds':>8}{'timeout':>9}")
for s in steps:
    print(f"{s['name']:<20}{s['status']:<13}{s['seconds']:>8}{s['timeout']:>9}")
for k, n in out["tests"].items():
    bad = ", ".join(x.rsplit("::", 1)[-1] for x in n["failed_tests"][:3])
    print(f"tests {k:<14}{n['passed']} passed, {n['failures'] + n['errors']} failed, "
          f"{n['skipped']} skipped" + (f" ({bad}{', ...' if len(n['failed_tests']) > 3 else ''})"
                                       if bad else ""))
print(f"gpu_check: wrote {path}")
EOF
}

# step NAME TIMEOUT CMD...: run CMD under min(TIMEOUT, budget left), log it, record the outcome in
# gpu_check/steps.tsv. The command runs in the background, so that SIGINT/SIGTERM reach the trap
# at once; gpu_check/.pid-NAME names it ("pid start limit") while it runs.
STEPLOG=$LOG
step() {
  local name=$1 limit=$2 left rc t0
  shift 2
  left=$((BUDGET - (SECONDS - start)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [[ " $SKIP " == *" $name "* ]] || [ "$limit" -lt "$MIN_STEP" ]; then
    echo "== $name: skipped (GPU_CHECK_SKIP or budget spent)" | tee -a "$STEPLOG"
    printf '%s\tskipped\t0\t0\n' "$name" >>"$PARTS/steps.tsv"
    return 0
  fi
  echo "== $name (timeout ${limit} s, $((SECONDS - start)) s elapsed)" | tee -a "$STEPLOG"
  t0=$SECONDS
  (
    timeout --kill-after=10 "$limit" "$@" 2>&1 &
    echo "$! $t0 $limit" >"$PARTS/.pid-$name"
    wait $!
    echo $? >"$PARTS/.rc-$name"
  ) | tee -a "$STEPLOG" &
  wait $!
  rc=$(cat "$PARTS/.rc-$name" 2>/dev/null || echo 143)
  rm -f "$PARTS/.rc-$name"
  if [ -f "$PARTS/.pid-$name" ]; then      # else the trap recorded it (interrupted)
    rm -f "$PARTS/.pid-$name"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" >>"$PARTS/steps.tsv"
  fi
  echo "== $name: rc $rc in $((SECONDS - t0)) s" | tee -a "$STEPLOG"
}

# fg_step NAME TIMEOUT CMD...: a step, then gpu_check.json rewritten with what it measured
fg_step() {
  step "$@"
  summarize
}

# background_step NAME TIMEOUT CMD...: step in the background, its output in its own log
background_step() {
  (STEPLOG="$PARTS/$1.log"; step "$@" >/dev/null) &
  BG_PID=$!
  echo "== $1: started in the background (pid $BG_PID)" | tee -a "$LOG"
}

interrupted() {
  trap - INT TERM
  echo "== interrupted at $((SECONDS - start)) s: stopping the running steps" | tee -a "$LOG"
  local f pid t0 limit
  for f in "$PARTS"/.pid-*; do
    [ -f "$f" ] || continue
    read -r pid t0 limit <"$f"
    rm -f "$f"
    printf '%s\tinterrupted\t%s\t%s\n' "${f##*/.pid-}" "$((SECONDS - t0))" "$limit" \
      >>"$PARTS/steps.tsv"
    kill -TERM "$pid" 2>/dev/null
  done
  summarize print 2>&1 | tee -a "$LOG"
  exit 143
}
trap interrupted INT TERM

# pytest with a JUnit report per step (counted into the JSON): $(junit NAME)
PYTEST="$PY -m pytest -q -p no:cacheprovider"
junit() { echo "--junitxml=$PARTS/junit-$1.xml"; }

fg_step env 30 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader;
  $PY -c 'import torch, triton, transformers; print(torch.__version__, torch.version.cuda,
  triton.__version__, transformers.__version__, torch.cuda.get_device_name())'"
fg_step relocate_op 45 $PY -c "
import json, logging, sys, time; logging.basicConfig(level=logging.INFO)
from vllm.kernels import cuda_kernels
t0 = time.perf_counter(); ok = cuda_kernels.load_relocate_op(); dt = time.perf_counter() - t0
json.dump({'backend': cuda_kernels.backend(), 'seconds': dt}, open(sys.argv[1], 'w'))
print('relocation kernel:', cuda_kernels.backend() or 'none (relocation runs Triton)',
      f'({dt:.1f} s)')
raise SystemExit(0 if ok else 1)" "$PARTS/relocate_op.json"

# ---- the headline figures, alone on the GPU ---------------------------------------------------
fg_step capacity 230 $PY benchmarks/benchmark_gpu_decode.py --device $DEV $QUICK \
  --parts capacity --capacity-variants Native vToken --out "$PARTS/capacity.json"
fg_step decode 140 $PY benchmarks/benchmark_gpu_decode.py --device $DEV $QUICK --parts decode \
  --out "$PARTS/gpu_decode.json"
fg_step relocation 60 $PY benchmarks/benchmark_relocation.py --device $DEV --repeats 30 \
  ${QUICK:+--slots 2048 --tokens 16 256} --out-dir "$PARTS"

# ---- the rest: Naive-Evict's frontier beside the tests, then the SLA scan ----------------------
cp "$PARTS/capacity.json" "$PARTS/capacity_sla.json" 2>/dev/null
background_step capacity_naive 150 $PY benchmarks/benchmark_gpu_decode.py --device $DEV \
  $QUICK --parts capacity --capacity-variants Naive-Evict --out "$PARTS/capacity_sla.json"
fg_step test_kernels 120 $PYTEST $(junit kernels) tests/gpu/test_gpu_kernels.py \
  tests/gpu/test_gpu_executor.py tests/test_kernels.py
if [ -f tests/gpu/test_gpu_engine.py ]; then
  fg_step test_engine 100 $PYTEST $(junit engine) tests/gpu/test_gpu_engine.py
else
  echo "== test_engine: tests/gpu/test_gpu_engine.py missing" | tee -a "$LOG"
  printf 'test_engine\tmissing\t0\t0\n' >>"$PARTS/steps.tsv"
fi
fg_step test_graphs 80 $PYTEST $(junit graphs) tests/gpu/test_gpu_graphs.py
others=$(ls tests/gpu/test_*.py | grep -vE 'test_gpu_(kernels|executor|engine|graphs)\.py' || true)
if [ -n "$others" ]; then fg_step test_gpu_other 100 $PYTEST $(junit other) $others; fi
echo "== waiting for capacity_naive ($((SECONDS - start)) s elapsed)" | tee -a "$LOG"
wait "$BG_PID"
cat "$PARTS/capacity_naive.log" >>"$LOG" 2>/dev/null
tail -n 8 "$PARTS/capacity_naive.log" 2>/dev/null
fg_step sla 240 $PY benchmarks/benchmark_gpu_decode.py --device $DEV $QUICK --parts sla fp8 \
  --out "$PARTS/capacity_sla.json"

# Fig. 11 (b, c) only means something where the copies run beside decode: a GPU (its CPU flow
# under GPU_CHECK_CPU_DRY_RUN, on the tiny model)
if [ "$DEV" = cpu ] || nvidia-smi -L >/dev/null 2>&1; then
  OVER=(--shape llama-3.1-8b --layers 8 --concurrency 16 48)
  [ "$DEV" = cpu ] && OVER=(--model tiny --concurrency 2 4)
  fg_step overhead 150 bash -c '"$@" && cp benchmarks/results/overhead_gpu.* "$0"/' "$PARTS" \
    $PY benchmarks/benchmark_overhead.py --device $DEV $QUICK "${OVER[@]}" --repeats 1 \
    --policy random --variants naive vtoken force-sync --out overhead_gpu
fi

trap - INT TERM
summarize print 2>&1 | tee -a "$LOG"
