#!/usr/bin/env bash
# The vToken paper's evaluation on this machine, one command: every figure and table (Figs. 7-12,
# Tables 1-2, the token table's bytes per token), then one results page, docs/results.md (each
# table, its PNG under docs/img/results/, the CPU and its ISA flags, the date, this command).
# The real engine runs at CPU scale (the default model); the capacity frontier runs the simulated
# executor (--load-format simulate) at the paper's shapes; figures that need a GPU say so on the
# page, and run here only where nvidia-smi lists one (benchmarks/gpu_check.sh).
#
#   bash benchmarks/run_paper.sh --quick             # ~25 min on a quiet 2-core CPU
#   bash benchmarks/run_paper.sh --full              # (the default) the scripts' full settings
#   bash benchmarks/run_paper.sh --smoke             # tiny random model, minutes: the plumbing
#   bash benchmarks/run_paper.sh --quick --dry-run   # the steps, their budgets and commands
#   bash benchmarks/run_paper.sh --quick --only capacity overhead   # some steps; the page is
#                                                    # rewritten from every result in the run
# Options: --runs N (serving scans per policy and workload, for the run-to-run spread: 2, --full
# 3; each variant's server is started once and scanned N times), --threads N (torch threads of
# every step; default all cores), --no-timeout (no step is stopped past its budget: a busy host).
#
# Each step prints its wall time against its budget (--quick: the estimate on a quiet 2-core
# host; a step past twice its budget is stopped and marked timeout, the others go on). Results:
# the scripts write benchmarks/results/<name>.json and .png as always; each step then copies its
# own into benchmarks/results/paper/ (the serving scans as serving_<workload>_<policy>),
# with steps.tsv (status, seconds and the host's load average as it started, per step), and
# benchmarks/paper_results.py turns that folder into the page.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=full DRY= ONLY= RUNS= NO_TIMEOUT= THREADS=${THREADS:-$(nproc)} ARGS="$*"
while [ $# -gt 0 ]; do
  case $1 in
    --quick|--full|--smoke) MODE=${1#--} ;;
    --dry-run) DRY=1 ;;
    --no-timeout) NO_TIMEOUT=1 ;;
    --runs) RUNS=$2; shift ;;
    --threads) THREADS=$2; shift ;;
    --only) while [ $# -gt 1 ] && [[ $2 != --* ]]; do ONLY="$ONLY $2"; shift; done ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "run_paper.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
RESULTS=benchmarks/results
RUN=$RESULTS/paper
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
start=$SECONDS

# ---- settings per mode: each step's flags and budget (s; none under --full) -------------------
CAP_VARIANTS="--variants Native Naive-Evict vToken"
SERVING_POLICIES="random h2o scissorhands"
case $MODE in
  quick)
    RECLAMATION="--quick --policies h2o scissorhands random --num-prompts 4"
    # the SLA rule's two variants (Native is in --full's scans); C 1, 2, 4 with C_ref 2
    SERVING="--quick --variants Naive-Evict vToken"
    CAP_LLAMA="--simulate --quick $CAP_VARIANTS"
    CAP_QWEN="--simulate --shape qwen2.5-14b --quick $CAP_VARIANTS"
    # every variant but the Native control (its noise floor is in --full's)
    OVERHEAD="--quick --concurrency 16 48 --repeats 1 --variants indirection naive vtoken force-sync"
    SENSITIVITY="--quick --concurrency 4"
    PREFIX="--quick"
    QUALITY="--quick --policies h2o scissorhands random --num-prompts 6"
    # as measured on a quiet 2-core AMD EPYC (AVX2), ~10% over: ~1,400 s in all (serving: a
    # workload's three policies)
    B_RECL=90 B_SERVING=490 B_LLAMA=100 B_QWEN=30 B_OVERHEAD=170 B_SENS=90 B_PREFIX=110
    B_QUALITY=50 ;;
  full)
    RECLAMATION="" SERVING="" CAP_LLAMA="--simulate" CAP_QWEN="--simulate --shape qwen2.5-14b"
    OVERHEAD="--concurrency 16 48" SENSITIVITY="" PREFIX="" QUALITY=""
    B_RECL=0 B_SERVING=0 B_LLAMA=0 B_QWEN=0 B_OVERHEAD=0 B_SENS=0 B_PREFIX=0 B_QUALITY=0 ;;
  smoke)    # the tiny random model and the smallest inputs: every step end to end, no meaning
    RECLAMATION="--quick --model tiny --policies h2o --num-prompts 2"
    SERVING="--quick --model tiny --levels 1 2 --c-ref 2 --per-client 1"
    SERVING_POLICIES=h2o
    CAP_LLAMA="--simulate --scale 0.03 $CAP_VARIANTS"
    CAP_QWEN="--simulate --shape qwen2.5-14b --scale 0.03 $CAP_VARIANTS"
    OVERHEAD="--quick --model tiny --concurrency 2 4 --repeats 1"
    SENSITIVITY="--quick --model tiny --concurrency 2"
    PREFIX="--quick --model tiny --degrees 1 2 --num-requests 4"
    QUALITY="--quick --model tiny --policies h2o --num-prompts 2"
    B_RECL=120 B_SERVING=120 B_LLAMA=120 B_QWEN=120 B_OVERHEAD=120 B_SENS=120 B_PREFIX=120
    B_QUALITY=120 ;;
esac
RUNS=${RUNS:-$([ $MODE = full ] && echo 3 || echo 2)}
T="--threads $THREADS"

if [ -z "$DRY" ]; then
  [ -z "$ONLY" ] && rm -rf "$RUN"
  mkdir -p "$RUN"
  [ -f "$RUN/steps.tsv" ] || printf 'step\tfigure\tstatus\tseconds\tbudget\tload\tcommand\n' \
    >"$RUN/steps.tsv"
  for name in $ONLY; do           # a step run again replaces what it left before
    awk -F'\t' -v s="$name" '$1 != s' "$RUN/steps.tsv" >"$RUN/steps.tsv.tmp"
    mv "$RUN/steps.tsv.tmp" "$RUN/steps.tsv"
    [ "$name" = serving ] && rm -f "$RUN"/serving_*
  done
  echo "run_paper.sh $ARGS: $MODE settings, $THREADS threads, results in $RUN"
else
  echo "run_paper.sh $ARGS ($MODE settings; dry run: nothing runs)"
  printf '%-14s %-38s %7s  %s\n' step figure budget command
fi

BUDGET_SUM=0 FAILED=0
wanted() { [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]; }

# collect NAME [AS]: copy results/NAME.json and .png into the run folder (as AS), if the step
# that just ran wrote them (newer than its marker)
collect() {
  local f ext
  for ext in json png; do
    f=$RESULTS/$1.$ext
    if [ -f "$f" ] && [ "$f" -nt "$RUN/.marker" ]; then cp "$f" "$RUN/${2:-$1}.$ext"; fi
  done
}

# run_step NAME FIGURE BUDGET COLLECT CMD...: run CMD (stopped past 2 x BUDGET s; 0: never),
# print its wall time against its budget, record it in steps.tsv, then `collect` each of the
# space-separated names in COLLECT
run_step() {
  local name=$1 figure=$2 budget=$3 names=$4 rc t0 status load
  shift 4
  [ "$name" = gpu ] || BUDGET_SUM=$((BUDGET_SUM + budget))
  if [ -n "$DRY" ]; then
    printf '%-14s %-38s %6ss  %s\n' "$name" "$figure" "$budget" "$*"
    return 0
  fi
  echo "== $name ($figure): budget $budget s, $((SECONDS - start)) s elapsed"
  echo "   $*"
  touch "$RUN/.marker"
  sleep 1                         # a file written this second is newer than the marker
  load=$(cut -d' ' -f1 /proc/loadavg)      # other work on the host as the step starts
  t0=$SECONDS
  timeout --kill-after=15 $([ -n "$NO_TIMEOUT" ] && echo 0 || echo $((2 * budget))) "$@"
  rc=$?
  status=$(case $rc in 0) echo ok ;; 124|137) echo timeout ;; *) echo "failed (rc $rc)" ;; esac)
  [ $rc = 0 ] || FAILED=$((FAILED + 1))
  for n in $names; do collect "$n"; done
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$figure" "$status" "$((SECONDS - t0))" \
    "$budget" "$load" "$*" >>"$RUN/steps.tsv"
  echo "== $name: $status in $((SECONDS - t0)) s (budget $budget s)"
}

# ---- the steps ---------------------------------------------------------------------------------
if wanted token_table; then
  run_step token_table "token table bytes per token" 20 benchmark_token_table \
    $PY benchmarks/benchmark_token_table.py
fi

if wanted reclamation; then
  run_step reclamation "Fig. 7 utilization, retained blocks" $B_RECL benchmark_reclamation \
    $PY benchmarks/benchmark_reclamation.py $RECLAMATION $T
fi

if wanted serving; then
  # benchmark_serving.py picks the workload with --dataset-name; one without the flag runs its
  # LongBench-style workload only: then ShareGPT is left out and the page says so
  DATASETS="sharegpt longbench" DS_FLAG=1
  if [ -z "$DRY" ] && ! $PY benchmarks/benchmark_serving.py --help 2>/dev/null \
      | grep -q -- --dataset-name; then
    echo "== serving: benchmark_serving.py has no --dataset-name: LongBench-style only"
    DATASETS=longbench DS_FLAG=
  fi
  for ds in $DATASETS; do
    # one server per variant, started once for the workload (--repeats: scanned in turns); the
    # policies scanned one after another on them, each request naming its own
    names=$(for policy in $SERVING_POLICIES; do printf 'serving_%s_%s ' $ds $policy; done)
    run_step serving "Fig. 8 SLA frontier ($ds)" $B_SERVING "$names" \
      $PY benchmarks/benchmark_serving.py --policy $SERVING_POLICIES \
      ${DS_FLAG:+--dataset-name $ds} --repeats "$RUNS" --out serving_$ds $SERVING $T
  done
fi

if wanted capacity; then
  run_step capacity "Figs. 9-10 capacity, Llama-3.1-8B" $B_LLAMA benchmark_capacity_sim \
    $PY benchmarks/benchmark_capacity.py $CAP_LLAMA $T
  run_step capacity "Figs. 9-10 capacity, Qwen2.5-14B" $B_QWEN \
    benchmark_capacity_sim_qwen2.5-14b $PY benchmarks/benchmark_capacity.py $CAP_QWEN $T
fi

if wanted overhead; then
  run_step overhead "Fig. 11 overhead, force-sync ablation" $B_OVERHEAD benchmark_overhead \
    $PY benchmarks/benchmark_overhead.py $OVERHEAD $T
fi

if wanted sensitivity; then
  run_step sensitivity "Fig. 12 sensitivity" $B_SENS benchmark_sensitivity \
    $PY benchmarks/benchmark_sensitivity.py $SENSITIVITY --workloads longbench sharegpt $T
fi

if wanted prefix_sharing; then
  run_step prefix_sharing "Table 1 prefix sharing" $B_PREFIX benchmark_prefix_sharing \
    $PY benchmarks/benchmark_prefix_sharing.py $PREFIX --policy h2o --kv-evict-scope generated $T
fi

if wanted quality; then
  run_step quality "Table 2 quality" $B_QUALITY benchmark_quality \
    $PY benchmarks/benchmark_quality.py $QUALITY $T
fi

if wanted gpu; then
  if [ -n "$DRY" ] || nvidia-smi -L >/dev/null 2>&1; then
    run_step gpu "GPU forms (Figs. 8, 9-10, 11)" 540 "" env OUT="$RUN/gpu" \
      GPU_CHECK_SKIP="test_kernels test_engine test_graphs test_gpu_other" \
      bash benchmarks/gpu_check.sh
  else
    echo "== gpu: no GPU here (nvidia-smi lists none): the page says which figures need one"
    printf 'gpu\tGPU forms (Figs. 8, 9-10, 11)\tskipped (no GPU)\t0\t0\t-\t%s\n' \
      "bash benchmarks/gpu_check.sh" >>"$RUN/steps.tsv"
  fi
fi

if [ -n "$DRY" ]; then
  printf '%-14s %-38s %7s  %s\n' results docs/results.md "" \
    "$PY benchmarks/paper_results.py --run-dir $RUN --mode $MODE"
  if [ $MODE = full ]; then echo "budgets: none under --full (no step is stopped)"
  else echo "budgets: $BUDGET_SUM s in all without the gpu step"; fi
  exit 0
fi
echo "== results page ($((SECONDS - start)) s elapsed)"
$PY benchmarks/paper_results.py --run-dir "$RUN" --mode $MODE \
  --command "bash benchmarks/run_paper.sh $ARGS" --threads "$THREADS" || FAILED=$((FAILED + 1))
echo "== run_paper.sh: done in $((SECONDS - start)) s (budgets: $BUDGET_SUM s without gpu);" \
  "$FAILED step(s) failed or timed out"
[ "$FAILED" = 0 ]
