"""Mixture-of-experts families (Qwen3-MoE, Mixtral, gpt-oss): greedy tokens identical to
transformers in float32 on tiny random checkpoints (conftest.build_moe_model: routers, norms,
biases and sinks randomized; gpt-oss with windows of 16 and prompts longer than that), alone
and batched, chunked, prefix-cached, preempted, at TP = 2, and under every eviction policy
(Naive-Evict = vToken); the expert block against a float64 reference per C build and block
type."""
import math

import numpy as np
import pytest
import torch

from tests.conftest import MOE_FAMILIES, greedy_checked, hf_greedy, random_prompts
from vllm import LLM, SamplingParams
from vllm.core.eviction import policy_names
from vllm.kernels import cpu_kernel_plan, cpu_kernels, quant_kernels
from vllm.model_executor.layers.fused_moe import FusedMoE, MoESpec, expert_name
from vllm.model_executor.quant_linear import QuantWeight

MAX_NEW = 20


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, seed=12, lo=20, hi=45)      # every prompt longer than a window


@pytest.fixture(scope="module")
def references(moe_models, prompts):
    return {f: hf_greedy(path, prompts, MAX_NEW) for f, path in moe_models.items()}


def _generate(model_dir, prompts, **kwargs):
    return greedy_checked(model_dir, prompts, MAX_NEW, **kwargs)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_batch1_matches_transformers(moe_models, prompts, references, family):
    got, _ = _generate(moe_models[family], prompts[:1], num_gpu_blocks_override=64)
    assert got == references[family][:1]


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("chunked,prefix", [(False, False), (True, True)])
def test_mixed_batch_matches_transformers(moe_models, prompts, references, family, chunked,
                                          prefix):
    kwargs = dict(enable_prefix_caching=prefix, num_gpu_blocks_override=256)
    if chunked:
        kwargs.update(max_num_batched_tokens=16)       # multi-chunk prompts
    else:
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=1024,
                      max_model_len=1024)
    got, _ = _generate(moe_models[family], prompts, **kwargs)
    assert got == references[family]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_preemption_matches_transformers(moe_models, prompts, references, family):
    got, llm = _generate(moe_models[family], prompts, num_gpu_blocks_override=14, block_size=8)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert got == references[family]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_tensor_parallel_matches_transformers(moe_models, prompts, references, family):
    """TP = 2: every expert's intermediate split over the ranks, routing on each rank from the
    whole router, the all-reduce after the experts; with eviction, vToken, as at TP = 1."""
    from tests.test_tensor_parallel import EVICT, run
    one, _ = run(moe_models[family], 1, kv_eviction_policy="h2o", **EVICT)
    two, stats = run(moe_models[family], 2, kv_eviction_policy="h2o", **EVICT)
    assert two == one and stats["evicted_tokens"] > 0
    got, _ = _generate(moe_models[family], prompts, tensor_parallel_size=2)
    assert got == references[family]


@pytest.mark.parametrize("policy", [p for p in policy_names() if p != "none"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_naive_evict_equals_vtoken(moe_models, prompts, family, policy):
    """gpt-oss's statistics are over real keys with its sinks in the softmax: rows sum to less
    than one, and every policy runs on them."""
    if family != "gpt-oss" and policy not in ("h2o", "streamingllm", "keydiff"):
        pytest.skip("every policy runs on gpt-oss; three on the other families")
    outs = {}
    for mode in ("none", "vtoken", "vtoken-fill"):
        outs[mode], llm = _generate(moe_models[family], prompts[:3], block_size=8,
                                    num_gpu_blocks_override=256, kv_eviction_policy=policy,
                                    kv_budget_tokens=24, kv_min_tokens=0, kv_reclamation=mode,
                                    kv_check_invariants=True)
        assert llm.llm_engine.get_kv_stats()["evicted_tokens"] > 0
    assert outs["none"] == outs["vtoken"] == outs["vtoken-fill"]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_dummy_weights_from_config_alone(moe_models, family):
    got, _ = _generate(moe_models[family], random_prompts(2, seed=3), load_format="dummy",
                       num_gpu_blocks_override=64)
    assert all(len(t) == MAX_NEW for t in got)


# ---- the expert block ---------------------------------------------------------------------------
H, I, E = 64, 32, 4


def _weights(seed: int, biases: bool, h: int = H, i: int = I):
    g = torch.Generator().manual_seed(seed)
    w = {"p.mlp.gate.weight": torch.randn(E, h, generator=g)}
    if biases:
        w["p.mlp.gate.bias"] = torch.randn(E, generator=g)
    for e in range(E):
        for proj, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
            w[expert_name("p", e, proj)] = torch.randn(*shape, generator=g) * 0.2
            if biases:
                w[expert_name("p", e, proj)[:-6] + "bias"] = torch.randn(shape[0], generator=g)
    return w


def _reference(spec: MoESpec, w, x: torch.Tensor, dequant=None) -> torch.Tensor:
    """float64: every token through its top_k experts, one at a time."""
    x = x.double()
    wd = {k: (dequant(k) if dequant and k.endswith("proj.weight") else v).double()
          for k, v in w.items()}
    logits = x @ wd["p.mlp.gate.weight"].t() + wd.get("p.mlp.gate.bias", 0)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        if spec.routing == "topk_softmax":
            top, ids = torch.topk(logits[t], spec.top_k)
            weights = torch.softmax(top, 0)
        else:
            top, ids = torch.topk(torch.softmax(logits[t], 0), spec.top_k)
            weights = top / top.sum() if spec.renormalize else top
        for wt, e in zip(weights, ids.tolist()):
            lin = lambda proj, v: v @ wd[expert_name("p", e, proj)].t() + wd.get(  # noqa: E731
                expert_name("p", e, proj)[:-6] + "bias", 0)
            gate, up = lin("gate", x[t]), lin("up", x[t])
            if spec.activation == "silu":
                h = torch.nn.functional.silu(gate) * up
            else:
                gate = gate.clamp(max=spec.limit)
                h = (up.clamp(-spec.limit, spec.limit) + 1) * gate * torch.sigmoid(
                    spec.alpha * gate)
            out[t] += wt * lin("down", h)
    return out


def _x_for(routes: str, w, spec: MoESpec, m: int = 9) -> torch.Tensor:
    """Tokens whose picks leave experts 1 and 2 idle ("some idle"), or that all pick expert 0
    ("one takes all"), found by drawing."""
    g = torch.Generator().manual_seed(1)
    rows = []
    gate = w["p.mlp.gate.weight"]
    while len(rows) < m:
        x = torch.randn(w["p.mlp.gate.weight"].shape[1], generator=g)
        ids = torch.topk(x @ gate.t() + w.get("p.mlp.gate.bias", 0), spec.top_k).indices
        if (routes == "one takes all" and 0 in ids) or \
                (routes == "some idle" and not ({1, 2} & set(ids.tolist()))):
            rows.append(x)
    return torch.stack(rows)


def _plan(isa: str, shapes) -> cpu_kernel_plan.KernelPlan:
    n = len(cpu_kernel_plan.BANDS)
    return cpu_kernel_plan.KernelPlan(isa, "test", 1, {cpu_kernel_plan.shape_name(*s): ["c"] * n
                                                       for s in shapes}, ["c"] * n)


@pytest.fixture(params=cpu_kernels.ISAS)
def isa(request, monkeypatch):
    if request.param not in cpu_kernels.runnable_isas():
        pytest.skip(f"this CPU cannot run {request.param}")
    if cpu_kernels.library(request.param) is None or quant_kernels.library(request.param) is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(cpu_kernels, "active_isa", lambda: request.param)
    return request.param


@pytest.mark.parametrize("spec", [MoESpec(E, 2, "softmax_topk", True),
                                  MoESpec(E, 2, "softmax_topk", False),
                                  MoESpec(E, 2, "topk_softmax", True, "swiglu_clamped",
                                          1.702, 1.5)], ids=["renorm", "plain", "gpt-oss"])
@pytest.mark.parametrize("routes", ["some idle", "one takes all"])
@pytest.mark.parametrize("weights", ["float32", "Q8_0", "Q4_0", "Q4_K", "Q6_K"])
def test_experts_match_float64(isa, spec, routes, weights):
    """Every C build, float32 panels and GGUF blocks (K-quants: random valid blocks, experts
    of 256): an expert no token picks, one every token picks. Tolerances: float32 1e-4;
    blocks against the float64 math of the blocks' own values, within the activations' 8-bit
    quantization (3e-2 of the output's scale)."""
    import gguf

    from tests.gguf_kquants import random_blocks
    biases = spec.activation != "silu"
    kquant = weights in ("Q4_K", "Q6_K")
    w = _weights(7, biases, *((256, 256) if kquant else (H, I)))
    x = _x_for(routes, w, spec)
    quant, dequant = None, None
    if weights != "float32":
        qtype = getattr(quant_kernels, weights)
        quant, values = {}, {}
        rng = np.random.default_rng(qtype)
        for name, t in w.items():
            if name.endswith("proj.weight"):
                blocks = random_blocks(rng, *t.shape, qtype) if kquant else \
                    gguf.quants.quantize(t.numpy(), gguf.GGMLQuantizationType(qtype))
                quant[name] = QuantWeight(torch.from_numpy(blocks), qtype, tuple(t.shape))
                values[name] = torch.from_numpy(gguf.quants.dequantize(
                    blocks, gguf.GGMLQuantizationType(qtype)).reshape(t.shape))
        dequant = values.__getitem__
    h, i = w["p.mlp.gate.weight"].shape[1], w[expert_name("p", 0, "gate")].shape[0]
    plan = _plan(isa, [(h, 2 * i), (i, h)])
    moe = FusedMoE(spec, w, "p", plan, quant=quant)
    got = moe(x.contiguous())
    want = _reference(spec, w, x, dequant)
    counts = torch.bincount(moe.route(x)[1].view(-1), minlength=E).tolist()
    assert (counts[1] == counts[2] == 0) if routes == "some idle" else counts[0] == len(x)
    tol = 1e-4 if weights == "float32" else 3e-2 * float(want.abs().max())
    assert torch.allclose(got.double(), want, atol=tol, rtol=0), float((got - want).abs().max())


def test_router_variants_match_transformers():
    """The routers as transformers computes them (Qwen3-MoE with and without norm_topk_prob,
    Mixtral, gpt-oss): the same experts and weights, bit for bit in float32."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, H, generator=g)
    cases = []
    for norm in (True, False):
        cfg = transformers.Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=2,
                                          norm_topk_prob=norm)
        cases.append((Qwen3MoeTopKRouter(cfg), MoESpec(E, 2, "softmax_topk", norm)))
    cfg = transformers.MixtralConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=2)
    cases.append((MixtralTopKRouter(cfg), MoESpec(E, 2, "softmax_topk", True)))
    cfg = transformers.GptOssConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=2)
    cases.append((GptOssTopKRouter(cfg), MoESpec(E, 2, "topk_softmax", True, "swiglu_clamped")))
    for router, spec in cases:
        with torch.no_grad():
            router.weight.copy_(torch.randn(E, H, generator=g))
            w = {"p.mlp.gate.weight": router.weight.detach().clone()}
            if getattr(router, "bias", None) is not None:
                router.bias.copy_(torch.randn(E, generator=g))
                w["p.mlp.gate.bias"] = router.bias.detach().clone()
            for e in range(E):
                for proj in ("gate", "up", "down"):
                    w[expert_name("p", e, proj)] = torch.zeros(H if proj == "down" else I,
                                                               I if proj == "down" else H)
            _, want_w, want_ids = router(x)
        got_w, got_ids = FusedMoE(spec, w, "p", None).route(x)
        assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w.to(got_w.dtype))


@pytest.mark.parametrize("routing, renorm", [("softmax_topk", True), ("softmax_topk", False),
                                            ("topk_softmax", True)])
def test_c_routing_groups_the_picks_as_torch_does(routing, renorm, monkeypatch):
    """ops.moe_route's C kernel against its torch path (moe_topk, a stable sort by expert): the
    same tokens and offsets, weights within 2 ulps (expf against torch's exp), for 1 to 40
    tokens with some experts idle and one picked by every token; moe_combine's C kernel bit for
    bit torch's index_add_. The worked example of vtok_moe_route's comment too."""
    from vllm.kernels import cpu_kernels, ops
    if not cpu_kernels.available():
        pytest.skip("no C kernels here")
    tokens, weights, offsets = cpu_kernels.moe_route(
        torch.tensor([[0.0, math.log(3), math.log(2)]]), 2, 0, True)
    assert tokens.tolist() == [0, 0] and offsets.tolist() == [0, 0, 1, 2]
    assert torch.allclose(weights, torch.tensor([0.6, 0.4]))
    g = torch.Generator().manual_seed(5)
    for t in (1, 2, 7, 40):
        logits = torch.randn(t, 16, generator=g) * 3
        logits[:, 3] += 20                                  # every token picks expert 3
        logits[:, 5:7] -= 50                                # nobody picks 5 and 6
        got = cpu_kernels.moe_route(logits, 4, ops.MOE_ROUTINGS.index(routing), renorm)
        with monkeypatch.context() as m:
            m.setattr(ops, "cpu_rows", lambda x, width=16: False)
            want = ops.moe_route(logits, 4, routing, renorm)
            y = torch.randn(len(got[0]), 32, generator=g)
            want_out = ops.moe_combine(y, want[1], want[0], t)
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
        assert torch.allclose(got[1], want[1], rtol=2.5e-7, atol=0)
        assert got[2][4] - got[2][3] == t and got[2][7] == got[2][5]     # 3 all, 5 and 6 none
        assert torch.equal(cpu_kernels.moe_combine(y, want[1], want[0], t), want_out)


def test_moe_spec_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="routing"):
        MoESpec(4, 2, "sigmoid_topk")
    with pytest.raises(ValueError, match="experts per token"):
        MoESpec(4, 5)
    assert np.isclose(MoESpec(4, 2).alpha, 1.702)


def test_mxfp4_checkpoint_runs_as_its_dequantized_weights(moe_models, prompts, tmp_path):
    """gpt-oss with MXFP4 experts (uint8 blocks and scales, quantization_config mxfp4) gives
    the tokens of the same checkpoint with the experts it encodes stored in float32, alone and
    at TP = 2 (the blocks dequantized whole, then sliced)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from vllm.model_executor.layers import mxfp4
    src = moe_models["gpt-oss"]
    weights = load_file(f"{src}/model.safetensors")
    g = torch.Generator().manual_seed(9)
    packed = {}
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, n = weights.pop(name).shape                  # [E, in, out] -> disk [E, out, in/32, ..]
        packed[name + "_blocks"] = torch.randint(0, 256, (e, n, k // 32, 16), generator=g,
                                                 dtype=torch.uint8)
        packed[name + "_scales"] = torch.randint(122, 126, (e, n, k // 32), generator=g,
                                                 dtype=torch.uint8)
    dirs = {}
    for kind, tensors in (("mxfp4", {**weights, **packed}),
                          ("float32", mxfp4.dequantize_checkpoint({**weights, **packed},
                                                                  torch.float32))):
        dirs[kind] = str(tmp_path / kind)
        shutil.copytree(src, dirs[kind])
        save_file(tensors, f"{dirs[kind]}/model.safetensors")
    with open(f"{dirs['mxfp4']}/config.json") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    with open(f"{dirs['mxfp4']}/config.json", "w") as f:
        json.dump(cfg, f)
    want, _ = _generate(dirs["float32"], prompts[:2], num_gpu_blocks_override=64)
    assert want == hf_greedy(dirs["float32"], prompts[:2], MAX_NEW)
    for tp in (1, 2):
        got, _ = _generate(dirs["mxfp4"], prompts[:2], num_gpu_blocks_override=64,
                           tensor_parallel_size=tp)
        assert got == want
    cfg["quantization_config"] = {"quant_method": "awq"}
    with open(f"{dirs['mxfp4']}/config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="awq"):
        LLM(dirs["mxfp4"], num_gpu_blocks_override=64)


@pytest.mark.parametrize("weights", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_grouped_gemm_is_the_per_group_gemm(isa, weights):
    """quant_kernels.gemm_grouped bit for bit as gemm() on each group's rows, in every C build:
    empty groups, groups below and above the tiled kernels' rows, repacked weights beside plain
    ones, biases on some groups."""
    import gguf
    qtype = getattr(quant_kernels, weights)
    n, k, counts = 40, 256, [3, 0, 7, 1, 5, 0]
    g = torch.Generator().manual_seed(qtype)
    ws = []
    for e in range(len(counts)):
        blocks = torch.from_numpy(gguf.quants.quantize(
            (torch.randn(n, k, generator=g) * 0.1).numpy(), gguf.GGMLQuantizationType(qtype)))
        packed = e % 2 and quant_kernels.packs(qtype, isa)
        ws.append((quant_kernels.repack(blocks, qtype, isa), qtype | quant_kernels.PACKED)
                  if packed else (blocks, qtype))
    biases = [torch.randn(n, generator=g) if e % 3 else None for e in range(len(counts))]
    offsets = torch.tensor([0] + np.cumsum(counts).tolist(), dtype=torch.int64)
    x = torch.randn(int(offsets[-1]), k, generator=g)
    y = quant_kernels.gemm_grouped(x, quant_kernels.Grouped(ws, n, k, biases), offsets, isa)
    for e, (a, b) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        if b > a:
            want = quant_kernels.gemm(x[a:b], *ws[e], n, k, biases[e], isa=isa)
            assert torch.equal(y[a:b], want), (e, float((y[a:b] - want).abs().max()))


@pytest.mark.skipif(not quant_kernels.available(), reason="no C compiler")
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_bfloat16_experts_run_bf16_and_match_transformers(moe_models, prompts, family,
                                                          tmp_path):
    """--dtype bfloat16 on a bf16 checkpoint: every expert GEMM (after the family's renaming:
    Mixtral's w1/w2/w3, gpt-oss's fused experts) is a BF16Linear; with a float32 KV cache the
    greedy tokens equal transformers' float32 run of the same bf16 weights."""
    import transformers

    from vllm.model_executor.bf16_linear import BF16Linear
    model = transformers.AutoModelForCausalLM.from_pretrained(moe_models[family],
                                                              dtype=torch.bfloat16)
    model.save_pretrained(str(tmp_path))
    transformers.AutoTokenizer.from_pretrained(moe_models[family]).save_pretrained(
        str(tmp_path))
    llm = LLM(str(tmp_path), dtype="bfloat16", num_gpu_blocks_override=128,
              kv_cache_dtype="float32")
    layers = llm.llm_engine.model_executor.driver_worker.model.layers
    experts = [lin for layer in layers if layer.moe is not None
               for lin in list(layer.moe.gate_up) + list(layer.moe.down)]
    assert experts and all(isinstance(lin, BF16Linear) for lin in experts)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:3]], params, use_tqdm=False)]
    assert got == hf_greedy(str(tmp_path), prompts[:3], MAX_NEW)
