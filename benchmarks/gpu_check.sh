#!/usr/bin/env bash
# One script for a lent GPU machine (one H200: about 8 minutes): the CUDA relocation op's build,
# the GPU tests, the engine on CUDA, graphs vs eager, then the decode, relocation, capacity and
# SLA benchmarks. Runs from the source tree (PYTHONPATH=.), installs nothing, needs no network,
# and imports no server module (no fastapi/uvicorn there).
#
#   bash benchmarks/gpu_check.sh      # -> $OUT (device tool) or benchmarks/results:
#                                     #    gpu_check.json (everything) and gpu_check.log
#   GPU_CHECK_CPU_DRY_RUN=1 bash benchmarks/gpu_check.sh    # the flow on a CPU: benchmarks on
#                                     # their toy config, GPU steps failing or skipped (~1 min)
#
# Every step runs under its own timeout, capped by what is left of GPU_CHECK_BUDGET seconds
# (default 470); a failed, timed-out or skipped step is recorded in the JSON and the next one
# runs. The capacity frontier (feasibility, not speed) runs in the background beside the tests
# until CAPACITY_DEADLINE s (default 290) at most; the timed benchmarks (relocation, decode) run
# alone after it; the SLA scan takes what is left. Benchmarks save after every measurement, so
# a step cut by its timeout still reports what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
RESULTS=${OUT:-benchmarks/results}
BUDGET=${GPU_CHECK_BUDGET:-470}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$RESULTS"
DEV=cuda QUICK=
if [ -n "${GPU_CHECK_CPU_DRY_RUN:-}" ]; then DEV=cpu QUICK=--quick; fi
LOG="$RESULTS/gpu_check.log"
: >"$LOG"
start=$SECONDS

# step NAME TIMEOUT CMD...: run CMD under min(TIMEOUT, budget left), log it, record the outcome
STEPLOG=$LOG
step() {
  local name=$1 limit=$2 left rc t0
  shift 2
  left=$((BUDGET - (SECONDS - start)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    echo "== $name: skipped (budget spent)" | tee -a "$STEPLOG"
    printf '%s\tskipped\t0\t0\n' "$name" >>"$WORK/steps.tsv"
    return
  fi
  echo "== $name (timeout ${limit} s, $((SECONDS - start)) s elapsed)" | tee -a "$STEPLOG"
  t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$STEPLOG"
  rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" >>"$WORK/steps.tsv"
  echo "== $name: rc $rc in $((SECONDS - t0)) s" | tee -a "$STEPLOG"
}

# background_step NAME TIMEOUT CMD...: step in the background, its output in its own log
background_step() {
  (STEPLOG="$WORK/$1.log"; step "$@" >/dev/null) &
  BG_PID=$!
  echo "== $1: started in the background (pid $BG_PID)" | tee -a "$LOG"
}

# pytest with a JUnit report per step (counted into the JSON): $(junit NAME)
PYTEST="$PY -m pytest -q -p no:cacheprovider"
junit() { echo "--junitxml=$WORK/junit-$1.xml"; }

step env 30 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader;
  $PY -c 'import torch, triton, transformers; print(torch.__version__, torch.version.cuda,
  triton.__version__, transformers.__version__, torch.cuda.get_device_name())'"
step build_relocate_op 240 $PY -c "
import logging, time; logging.basicConfig(level=logging.INFO)
from vllm import cuda_kernels
t0 = time.perf_counter(); ok = cuda_kernels.load_relocate_op()
print('relocate op built and loaded' if ok else 'relocate op build FAILED',
      f'{time.perf_counter() - t0:.1f} s')
raise SystemExit(0 if ok else 1)"
CAPACITY_DEADLINE=${CAPACITY_DEADLINE:-290}
background_step capacity $((CAPACITY_DEADLINE - (SECONDS - start))) \
  $PY benchmarks/benchmark_gpu_decode.py --device $DEV $QUICK --parts capacity \
  --out "$WORK/capacity.json"
step test_kernels 150 $PYTEST $(junit kernels) tests/gpu/test_gpu_kernels.py \
  tests/gpu/test_gpu_executor.py tests/test_kernels.py
if [ -f tests/gpu/test_gpu_engine.py ]; then
  step test_engine 120 $PYTEST $(junit engine) tests/gpu/test_gpu_engine.py
else
  echo "== test_engine: tests/gpu/test_gpu_engine.py missing" | tee -a "$LOG"
  printf 'test_engine\tmissing\t0\t0\n' >>"$WORK/steps.tsv"
fi
step test_graphs 90 $PYTEST $(junit graphs) tests/gpu/test_gpu_graphs.py
others=$(ls tests/gpu/test_*.py | grep -vE 'test_gpu_(kernels|executor|engine|graphs)\.py' || true)
if [ -n "$others" ]; then step test_gpu_other 60 $PYTEST $(junit other) $others; fi
echo "== waiting for capacity ($((SECONDS - start)) s elapsed)" | tee -a "$LOG"
wait "$BG_PID"
cat "$WORK/capacity.log" >>"$LOG" 2>/dev/null
tail -n 15 "$WORK/capacity.log" 2>/dev/null
# relocation first: it takes ~20 s, so a slow decode part can no longer squeeze it out of the budget
step relocation 60 $PY benchmarks/benchmark_relocation.py --device $DEV --repeats 30 \
  ${QUICK:+--slots 2048 --tokens 16 256} --out-dir "$WORK"
step decode 180 $PY benchmarks/benchmark_gpu_decode.py --device $DEV $QUICK --parts decode \
  --out "$WORK/gpu_decode.json"
step sla 150 $PY benchmarks/benchmark_gpu_decode.py --device $DEV $QUICK --parts sla \
  --out "$WORK/capacity.json"

# one JSON: the steps, the test counts, every benchmark's figures and the issue's targets
$PY - "$WORK" "$RESULTS/gpu_check.json" "$((SECONDS - start))" "$DEV" <<'EOF' 2>&1 | tee -a "$LOG"
import glob, json, os, sys
import xml.etree.ElementTree as ET
work, path, seconds, dev = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
steps = []
for line in open(os.path.join(work, "steps.tsv")):
    name, rc, secs, limit = line.rstrip("\n").split("\t")
    status = {"0": "ok", "124": "timeout", "137": "timeout"}.get(rc, rc if not rc.isdigit()
                                                               else "failed")
    steps.append({"name": name, "status": status, "rc": rc, "seconds": int(secs),
                  "timeout": int(limit)})
out = {"seconds": seconds, "steps": steps, "tests": {}}
for f in sorted(glob.glob(os.path.join(work, "junit-*.xml"))):
    suite = ET.parse(f).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    bad = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
           if c.find("failure") is not None or c.find("error") is not None]
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    n["passed"] = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    out["tests"][os.path.basename(f)[6:-4]] = {**n, "failed_tests": bad}
def load(name):
    try:
        with open(os.path.join(work, name)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None
bench, cap = load("gpu_decode.json") or {}, load("capacity.json") or {}
out.update({k: bench.get(k, cap.get(k)) for k in ("device", "dtype", "model", "graphs", "torch")})
out.update({"decode": bench.get("decode"), "capacity": cap.get("capacity"), "sla": cap.get("sla")})
out["benchmark_seconds"] = {**(bench.get("seconds") or {}), **(cap.get("seconds") or {})}
out["relocation"] = load(f"relocation_{dev}.json")
dec, cap, rel = out["decode"] or {}, out["capacity"] or {}, out["relocation"] or {}
b16 = dec.get("16", {})
targets = {
    "decode_vs_transformers_batch16": b16.get("ratios", {}).get("vToken / transformers"),
    "indirection_overhead_batch16": b16.get("indirection_overhead"),
    "relocation_share_of_d2d_min_ge256": min(
        (rel.get("headline") or {}).get("cuda" if dev == "cuda" else "torch", {}).values(),
        default=None),
    "capacity_vtoken_vs_native": cap.get("vToken_vs_Native"),
}
must = {"decode_vs_transformers_batch16": lambda v: v >= 3,
        "indirection_overhead_batch16": lambda v: v < 0.01,
        "relocation_share_of_d2d_min_ge256": lambda v: v >= 0.5,
        "capacity_vtoken_vs_native": lambda v: v >= 0.6}
out["targets"] = {k: {"value": v, "must_met": None if v is None else bool(must[k](v))}
                  for k, v in targets.items()}
with open(path, "w") as fh:
    json.dump(out, fh, indent=1, default=float)
print(json.dumps({"steps": {s["name"]: s["status"] for s in steps}, "targets": out["targets"],
                  "tests": {k: {x: v[x] for x in ("passed", "failures", "errors", "skipped")}
                            for k, v in out["tests"].items()}}, indent=1))
print(f"gpu_check: wrote {path} in {seconds} s")
EOF
