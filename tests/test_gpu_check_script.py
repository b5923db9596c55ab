"""benchmarks/gpu_check.sh is ready to run in one call on the GPU machine: its shell parses, every
Python entry point it runs imports on a machine without fastapi/uvicorn/xformers (that image has
none) and without CUDA, and its flow holds: run on CPU with $PY a fake interpreter that answers
each step in milliseconds (recording the order and what was saved when it was called), the
headline figures come first, each saved into gpu_check.json before the next step starts, and the
summary is printed at the end even when steps time out or the run is interrupted. The real flow
on a CPU: GPU_CHECK_CPU_DRY_RUN=1 (minutes)."""
import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
ENTRY_POINTS = ["benchmarks/benchmark_gpu_decode.py", "benchmarks/benchmark_relocation.py"]
TEST_MODULES = ["tests.gpu.test_gpu_kernels", "tests.gpu.test_gpu_executor",
                "tests.gpu.test_gpu_graphs", "tests.gpu.test_gpu_engine", "tests.test_kernels"]
HEADLINE = ["env", "relocate_op", "capacity", "decode", "relocation"]


def test_script_parses_and_names_existing_files():
    run = subprocess.run(["bash", "-n", "benchmarks/gpu_check.sh"], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    script = open(SCRIPT).read()
    for path in ENTRY_POINTS + ["tests/gpu/test_gpu_kernels.py", "tests/gpu/test_gpu_graphs.py",
                                "tests/gpu/test_gpu_executor.py", "tests/test_kernels.py"]:
        assert path in script and os.path.exists(os.path.join(ROOT, path)), path
    assert "pip install" not in script and "setup.py" not in script     # nothing installed


def test_entry_points_import_without_server_packages():
    code = (
        "import runpy, sys, importlib\n"
        "for name in ('fastapi', 'uvicorn', 'xformers'):\n"
        "    sys.modules[name] = None          # as on the GPU image: importing them fails\n"
        f"for path in {ENTRY_POINTS!r}:\n"
        "    runpy.run_path(path, run_name='not_main')\n"
        f"for mod in {TEST_MODULES!r}:\n"
        "    importlib.import_module(mod)\n"
        "import vllm.kernels.cuda_kernels, vllm.worker.cuda_graph_runner\n"
        "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


# ---- the flow, with a fake interpreter ---------------------------------------------------------
FAKE = """\
#!{python}
# A stand-in for python in gpu_check.sh: answers each step at once with plausible figures,
# and logs, per call, what it was asked and which figures gpu_check.json held at that moment.
import json, os, sys, time
argv = sys.argv[1:]
if argv[:1] == ["-"]:                                   # the summary: the real interpreter
    os.execv({python!r}, [{python!r}] + argv)
parts = os.path.join(os.environ["OUT"], "gpu_check")

def arg(name, default=None):
    return argv[argv.index(name) + 1] if name in argv else default

if argv[:1] == ["-c"]:
    kind = "relocate_op" if "load_relocate_op" in argv[1] else "env"
elif argv[:2] == ["-m", "pytest"]:
    kind = "pytest:" + next(a for a in argv if a.startswith("--junitxml=")).rsplit("-", 1)[1][:-4]
elif argv[0].endswith("benchmark_relocation.py"):
    kind = "relocation"
else:
    kind = arg("--parts")
    if kind == "capacity":
        kind += ":" + " ".join(argv[argv.index("--capacity-variants") + 1:argv.index("--out")])
try:
    with open(os.path.join(os.environ["OUT"], "gpu_check.json")) as f:
        saved = {{k: t["value"] for k, t in json.load(f)["targets"].items()}}
except (OSError, ValueError):
    saved = None
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({{"kind": kind, "pid": os.getpid(), "saved": saved,
                         "files": sorted(os.listdir(parts))}}) + "\\n")

def merge(path, update):
    out = {{}}
    if os.path.exists(path):
        with open(path) as f:
            out = json.load(f)
    for k, v in update.items():
        out[k] = {{**out.get(k, {{}}), **v}} if isinstance(v, dict) else v
    with open(path, "w") as f:
        json.dump(out, f)

slow = json.loads(os.environ.get("FAKE_SLOW", "{{}}"))
if kind == "relocate_op":
    with open(argv[-1], "w") as f:
        json.dump({{"backend": "prebuilt", "seconds": 0.01}}, f)
elif kind == "capacity:Native vToken":
    merge(arg("--out"), {{"device": "fake H200", "torch": "2.11",
                         "capacity": {{"Native": 5, "vToken": 9, "vToken_vs_Native": 0.8}}}})
elif kind == "capacity:Naive-Evict":
    merge(arg("--out"), {{"capacity": {{"Naive-Evict": 5}}}})
elif kind == "decode":
    merge(arg("--out"), {{"decode": {{"16": {{"Native": {{"tok_s": 1}}}}}}}})       # a first run
    time.sleep(slow.get("decode", 0))
    merge(arg("--out"), {{"decode": {{"16": {{"ratios": {{"vToken / transformers": 3.5}},
                                             "indirection_overhead": 0.004}}}}}})
elif kind == "relocation":
    with open(os.path.join(arg("--out-dir"), "relocation_cuda.json"), "w") as f:
        json.dump({{"headline": {{"cuda": {{"256": 0.7, "1024": 0.9}}}}}}, f)
elif kind == "sla":
    merge(arg("--out"), {{"sla": {{"levels": [5, 9]}}}})
elif kind.startswith("pytest:"):
    with open(next(a for a in argv if a.startswith("--junitxml="))[11:], "w") as f:
        f.write('<testsuite tests="3" failures="0" errors="0" skipped="1">'
                '<testcase classname="t" name="a"/></testsuite>')
print("fake", kind, "done")
"""


@pytest.fixture
def fake_run(tmp_path):
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "out"
    out.mkdir()
    log = tmp_path / "calls.jsonl"

    def start(budget=300, min_step=1, slow=None):
        env = {**os.environ, "PY": str(fake), "OUT": str(out), "FAKE_LOG": str(log),
               "GPU_CHECK_BUDGET": str(budget), "GPU_CHECK_MIN_STEP": str(min_step),
               "FAKE_SLOW": json.dumps(slow or {})}
        env.pop("GPU_CHECK_CPU_DRY_RUN", None)
        return subprocess.Popen(["bash", SCRIPT], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def calls():
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def result():
        with open(out / "gpu_check.json") as f:
            return json.load(f)
    return start, calls, result


def test_headline_first_each_saved_before_the_next_step(fake_run):
    start, calls, result = fake_run
    proc = start()
    stdout, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, stdout[-3000:]
    kinds = [c["kind"] for c in calls()]
    assert kinds[:5] == ["env", "relocate_op", "capacity:Native vToken", "decode",
                         "relocation"], kinds
    rest = kinds[5:]
    assert rest[-1] == "sla" and sorted(rest[:-1]) == sorted(
        ["capacity:Naive-Evict", "pytest:kernels", "pytest:engine", "pytest:graphs",
         "pytest:other"]), kinds
    by = {c["kind"]: c for c in calls()}
    # saved the moment each headline step ends: gpu_check.json holds it when the next one starts
    assert by["decode"]["saved"]["capacity_vtoken_vs_native"] == 0.8
    assert by["decode"]["saved"]["decode_vs_transformers_batch16"] is None
    assert by["relocation"]["saved"]["decode_vs_transformers_batch16"] == 3.5
    assert by["capacity:Naive-Evict"]["saved"]["relocation_share_of_d2d_min_ge256"] == 0.7
    assert "capacity.json" in by["decode"]["files"]
    assert "gpu_decode.json" in by["relocation"]["files"]
    res = result()
    assert {s["name"]: s["status"] for s in res["steps"]} == {
        "env": "ok", "relocate_op": "ok", "capacity": "ok", "decode": "ok", "relocation": "ok",
        "capacity_naive": "ok", "test_kernels": "ok", "test_engine": "ok", "test_graphs": "ok",
        "test_gpu_other": "ok", "sla": "ok"}
    assert all(t["must_met"] for t in res["targets"].values())
    assert res["capacity"]["Naive-Evict"] == 5 and res["capacity"]["vToken"] == 9
    assert res["relocation_kernel"] == "prebuilt" and res["sla"] == {"levels": [5, 9]}
    assert res["tests"]["kernels"]["passed"] == 2
    summary = stdout[stdout.index("==== gpu_check summary"):]
    assert len(summary.splitlines()) <= 30                               # one screen
    assert "capacity_vtoken_vs_native" in summary and "+80%" in summary and "3.50x" in summary


def test_a_step_past_the_budget_times_out_and_the_summary_still_prints(fake_run):
    start, calls, result = fake_run
    t0 = time.monotonic()
    proc = start(budget=15, min_step=2, slow={"decode": 120})
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout[-3000:]
    assert time.monotonic() - t0 < 60                      # the budget bounds the run
    res = result()
    status = {s["name"]: s["status"] for s in res["steps"]}
    assert status["capacity"] == "ok" and status["decode"] == "timeout"
    assert status["sla"] == "skipped"
    assert res["targets"]["capacity_vtoken_vs_native"]["must_met"] is True
    assert res["targets"]["decode_vs_transformers_batch16"]["value"] is None
    assert res["decode"]["16"]["Native"] == {"tok_s": 1}  # what it saved before the cut
    assert "==== gpu_check summary" in stdout and "not measured" in stdout


def test_sigterm_stops_the_running_step_and_prints_the_summary(fake_run):
    start, calls, result = fake_run
    proc = start(slow={"decode": 120})
    deadline = time.monotonic() + 120
    while not any(c["kind"] == "decode" for c in calls()):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 20 and proc.returncode == 143, stdout[-3000:]
    decode_pid = next(c["pid"] for c in calls() if c["kind"] == "decode")
    time.sleep(0.5)
    assert not _alive(decode_pid), "the interrupted step's process still runs"
    res = result()
    status = {s["name"]: s["status"] for s in res["steps"]}
    assert status["capacity"] == "ok" and status["decode"] == "interrupted"
    assert "sla" not in status
    assert res["targets"]["capacity_vtoken_vs_native"]["value"] == 0.8
    assert "==== gpu_check summary" in stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:              # a zombie is not running
        return f.read().split(")")[-1].split()[0] != "Z"


def test_budget_and_timeouts_fit_the_device_call():
    """Default budget + the kill grace + the summary stay under ~540 s (the device tool's
    command limit is 600 s); the headline steps' timeouts fit inside the budget together, so
    each gets its whole timeout even if all of them run to it."""
    script = open(SCRIPT).read()
    assert "BUDGET=${GPU_CHECK_BUDGET:-520}" in script and "--kill-after=10" in script
    head = [int(line.split()[2]) for line in script.splitlines()
            if line.startswith("fg_step ") and line.split()[1] in HEADLINE]
    assert len(head) == 5 and sum(head) <= 520, head    # each gets its full timeout if need be
    order = [line.split()[1] for line in script.splitlines()
             if line.startswith(("fg_step ", "background_step "))]
    assert order[:5] == HEADLINE and order[5] == "capacity_naive" and order[-1] == "sla", order
