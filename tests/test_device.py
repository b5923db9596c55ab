"""Device plumbing on a CPU machine: --device / --dtype auto / --gpu-memory-utilization
resolution and validation, LLM(device="cpu") against transformers, the KV pool sizing rule, the
runner's one-copy statistics path, write_kv's padding rule, and the Triton kernels reached through
the dispatch point (an engine run under TRITON_INTERPRET=1, in a subprocess)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.conftest import hf_greedy, random_prompts
from vllm import LLM, SamplingParams
from vllm.kernels import ops
from vllm.config import CacheConfig, DeviceConfig, ModelConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.worker.worker import kv_blocks_for_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


# ---- flags ---------------------------------------------------------------------------------------
def test_device_resolution_and_validation():
    assert DeviceConfig("auto").device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert DeviceConfig("cpu").torch_device == torch.device("cpu")
    with pytest.raises(ValueError, match="--device"):
        DeviceConfig("tpu")


@no_cuda
def test_cuda_without_a_gpu_names_the_flag(tiny_llama):
    with pytest.raises(ValueError, match="--device"):
        DeviceConfig("cuda")
    with pytest.raises(ValueError, match="--device"):
        LLM(tiny_llama, device="cuda")


def test_simulate_runs_on_the_cpu(tiny_llama):
    with pytest.raises(ValueError, match="--device cuda: --load-format simulate"):
        LLM(tiny_llama, load_format="simulate", device="cuda")
    llm = LLM(tiny_llama, load_format="simulate", num_gpu_blocks_override=16)   # device auto
    assert llm.llm_engine.device.type == "cpu"


def test_dtype_auto_follows_the_device():
    model = dict(model="m", tokenizer="m")
    assert ModelConfig(**model, device="cpu").dtype == "float32"
    assert ModelConfig(**model, device="cuda").dtype == "bfloat16"
    assert ModelConfig(**model, dtype="float16", device="cuda").dtype == "float16"
    with pytest.raises(ValueError, match="--dtype"):
        ModelConfig(**model, dtype="int8")


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.01])
def test_gpu_memory_utilization_is_validated(bad):
    assert CacheConfig(gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        CacheConfig(gpu_memory_utilization=bad)


def test_kv_pool_from_gpu_memory():
    gib, block = 1 << 30, 2 << 20
    assert kv_blocks_for_memory(80 * gib, 20 * gib, 0.9, block) == (72 - 20) * gib // block
    assert kv_blocks_for_memory(80 * gib, 20 * gib, 0.9, block) > \
        kv_blocks_for_memory(80 * gib, 20 * gib, 0.5, block)
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.2"):
        kv_blocks_for_memory(80 * gib, 20 * gib, 0.2, block)


def test_serve_flags_parse():
    from vllm.entrypoints.cli import make_parser
    args = make_parser().parse_args(["serve", "m", "--device", "cpu",
                                     "--gpu-memory-utilization", "0.5"])
    args.model = args.model_tag
    ea = EngineArgs.from_cli_args(args)
    assert (ea.device, ea.gpu_memory_utilization, ea.dtype) == ("cpu", 0.5, "auto")
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "m", "--device", "tpu"])


# ---- the engine on the CPU -----------------------------------------------------------------------
def test_llm_on_cpu_matches_transformers(tiny_llama):
    prompts = random_prompts(3, seed=5, lo=8, hi=40)
    llm = LLM(tiny_llama, device="cpu", num_gpu_blocks_override=64)
    eng = llm.llm_engine
    assert eng.kv_caches.device.type == "cpu" and eng.model_config.dtype == "float32"
    assert eng.model.rotary.cos.device.type == "cpu" and eng.get_engine_info()["device"] == "cpu"
    assert "rotary.cos" not in dict(eng.model.named_parameters())   # a buffer, not a weight
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_llama, prompts, 8)


def test_profiling_forward_runs_and_reports_its_scratch_cache(tiny_llama):
    """The forward that sizes the KV pool on CUDA: the largest step, spans of <= max_model_len."""
    from vllm.worker.model_runner import profile_forward
    model = LLM(tiny_llama, num_gpu_blocks_override=8).llm_engine.model
    cfg = model.config
    scratch = profile_forward(model, num_tokens=70, max_model_len=32, num_seqs=4)
    assert scratch == cfg.num_hidden_layers * 70 * 2 * cfg.num_key_value_heads * cfg.head_dim * 4


class _Done:
    def synchronize(self):
        pass


def test_statistics_read_from_one_flat_host_copy(tiny_llama):
    """On CUDA the step's decode mass and column sums come back as one flat pinned copy; split
    here (from a CPU stand-in for it), they equal the per-tensor statistics of every step."""
    llm = LLM(tiny_llama, num_gpu_blocks_override=64, max_num_batched_tokens=24,
              kv_eviction_policy="h2o", kv_min_tokens=0, kv_check_invariants=True)
    runner, checked = llm.llm_engine.runner, []
    original = runner.step_stats

    def both(inp):
        direct = original(inp)
        meta = inp.meta
        parts = ([meta.decode_mass] if meta.decode_mass is not None else []) + \
            [s.colsum for s in meta.prefills if s.colsum is not None]
        if parts:
            inp.host_stats = (torch.cat([p.reshape(-1) for p in parts]).clone(), _Done())
            flat = original(inp)
            inp.host_stats = None
            for a, b in zip(direct, flat):
                assert (a.scores is None) == (b.scores is None)
                assert a.scores is None or np.array_equal(a.scores, b.scores)
            checked.append(len(parts))
        return direct
    runner.step_stats = both
    prompts = random_prompts(3, seed=2, lo=20, hi=50)
    llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert max(checked) > 1       # a step with decode mass and column sums together


def test_bfloat16_on_cpu_with_eviction_runs(tiny_llama):
    """The torch decode path with attention mass in bf16 (what a CUDA machine without Triton
    runs): scores and probabilities in float32, values in bf16."""
    with ops.forced_backend("torch"):
        llm = LLM(tiny_llama, dtype="bfloat16", num_gpu_blocks_override=64,
                  kv_eviction_policy="h2o", kv_min_tokens=0, kv_check_invariants=True)
    out = llm.generate([{"prompt_token_ids": p} for p in random_prompts(2, seed=4, lo=20,
                                                                        hi=40)],
                       GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    assert llm.get_kv_stats()["evicted_tokens"] > 0


# ---- write_kv ------------------------------------------------------------------------------------
def test_write_kv_padding_writes_nothing():
    cache = torch.zeros(6, 2, 2, 4)
    k, v = torch.ones(4, 2, 4), 2 * torch.ones(4, 2, 4)
    ops.write_kv(cache, torch.tensor([2, -1, 0, -1]), k, v)
    assert cache[2, 0].eq(1).all() and cache[0, 1].eq(2).all()
    assert cache[[1, 3, 4, 5]].eq(0).all()                   # the last slot untouched
    ops.write_kv(cache, torch.full((4,), -1), 5 * k, 5 * v)   # all padding
    assert cache[[1, 3, 4, 5]].eq(0).all() and cache.max() == 2


# ---- Triton through the dispatch point, interpreted ----------------------------------------------
_TRITON_RUN = r"""
import collections, json, sys
from vllm import LLM, SamplingParams
from vllm.kernels import ops
from vllm.kernels import triton_decode, triton_write_kv
import torch

calls = collections.Counter()
def counted(mod, name):
    f = getattr(mod, name)
    def wrapper(*a, **k):
        calls[name + ("+mass" if name == "decode_attention" and a[5] is not None else "")] += 1
        return f(*a, **k)
    setattr(mod, name, wrapper)
counted(triton_decode, "decode_attention")
counted(triton_write_kv, "write_kv")

# the kernel alone: padding writes nothing, strided K/V rows (views of a QKV projection)
qkv = torch.randn(5, 3, 2, 8)
cache = torch.zeros(9, 2, 2, 8)
ops.write_kv(cache, torch.tensor([4, -1, 0, 8, -1]), qkv[:, 1], qkv[:, 2])
kernel_ok = bool(torch.equal(cache[[4, 0, 8], 0], qkv[[0, 2, 3], 1])
                 and torch.equal(cache[[4, 0, 8], 1], qkv[[0, 2, 3], 2])
                 and cache[[1, 2, 3, 5, 6, 7]].eq(0).all())

model, prompts, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
out = {"kernel_ok": kernel_ok, "decode_backend": ops.decode_backend(torch.zeros(1, 4, 16))}
for name, kw in (("native", {}),
                 ("vtoken", dict(kv_eviction_policy="h2o", kv_min_tokens=0, block_size=4,
                                 kv_reclamation="vtoken", kv_frag_threshold=0.0,
                                 kv_check_invariants=True))):
    llm = LLM(model, num_gpu_blocks_override=64, **kw)
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    out[name] = [r.outputs[0].token_ids for r in res]
    out[name + "_stats"] = llm.get_kv_stats()
out["calls"] = dict(calls)
print("RESULT" + json.dumps(out))
"""


def test_triton_decode_through_the_dispatch_point(tiny_llama):
    """VLLM_KERNEL_BACKEND=triton under the interpreter: every decode and KV write of an engine
    run goes through the Triton kernels (with attention mass where H2O asks for it); tokens
    equal transformers (Native) and the default CPU path (H2O + vToken, same evictions)."""
    prompts = random_prompts(2, seed=3, lo=20, hi=30)
    env = dict(os.environ, TRITON_INTERPRET="1", VLLM_KERNEL_BACKEND="triton",
               PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-c", _TRITON_RUN, tiny_llama, json.dumps(prompts),
                          "8"], env=env, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.split("RESULT", 1)[1])
    assert got["kernel_ok"] and got["decode_backend"] == "triton"
    assert got["calls"]["decode_attention"] > 0 and got["calls"]["decode_attention+mass"] > 0
    assert got["calls"]["write_kv"] > 0
    assert got["native"] == hf_greedy(tiny_llama, prompts, 8)
    stats = got["vtoken_stats"]
    assert stats["evicted_tokens"] > 0 and stats["relocation_events"] > 0
    cpu = LLM(tiny_llama, num_gpu_blocks_override=64, kv_eviction_policy="h2o", kv_min_tokens=0,
              block_size=4, kv_reclamation="vtoken", kv_frag_threshold=0.0)
    ref = cpu.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert got["vtoken"] == [r.outputs[0].token_ids for r in ref]
    assert stats["evicted_tokens"] == cpu.get_kv_stats()["evicted_tokens"]


def test_write_kv_kernel_compiles_for_sm90():
    """The interpreter is more permissive than the compiler: compile for Hopper, no GPU needed."""
    code = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm.kernels import triton_write_kv
for dt in ("bf16", "fp32"):
    sig = {"k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "cache_ptr": f"*{dt}", "slot_ptr": "*i64"}
    sig.update({f"stride_{n}": "i64" for n in ("kt", "kh", "vt", "vh", "slot", "kv", "head")})
    consts = dict(KVH=8, D=128, BLOCK_H=8, BLOCK_D=128)
    sig.update({c: "constexpr" for c in consts})
    k = triton.compile(ASTSource(triton_write_kv._write_kv_kernel, sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32))
    print(dt, len(k.asm["cubin"]))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "bf16" in run.stdout and "fp32" in run.stdout
