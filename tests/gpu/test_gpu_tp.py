"""On CUDA with two or more GPUs: tensor parallelism over NCCL (rank r on cuda:r). TP=2 greedy
tokens and eviction stats equal TP=1 in float32, with H2O and vToken relocation. Skipped with
fewer than two GPUs (the device check runs on one H200: these never ran there)."""
import pytest
import torch

from tests.conftest import random_prompts
from vllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
EVICT = dict(kv_eviction_policy="h2o", kv_eviction_ratio=0.5, kv_min_tokens=0, block_size=4,
             kv_frag_threshold=0.0, kv_reclamation="vtoken", kv_check_invariants=True,
             num_gpu_blocks_override=256, dtype="float32", device="cuda")


def run(model, tp):
    llm = LLM(model, tensor_parallel_size=tp, **EVICT)
    prompts = random_prompts(6, seed=5, lo=20, hi=90)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    stats = llm.get_kv_stats()
    llm.llm_engine.shutdown()
    return [o.outputs[0].token_ids for o in outs], stats["evicted_tokens"]


def test_nccl_tp2_equals_tp1(tiny_llama):
    assert run(tiny_llama, 2) == run(tiny_llama, 1)
