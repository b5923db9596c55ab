"""Torch references and small paged-cache scenes shared by tests/test_kernels.py and tests/gpu."""
import sys
import types

import torch

BS = 4   # block size of the paged scenes


def prefill_meta(spans):
    """The AttentionMetadata of a prefill-only step over these PrefillSpans."""
    from vllm.attention.backend import AttentionMetadata
    empty = torch.empty(0, dtype=torch.int64)
    return AttentionMetadata(slot_mapping=empty, num_decodes=0,
                             decode_views=torch.empty(0, 1, dtype=torch.int64),
                             decode_lens=empty, prefills=list(spans))


def key_statistic_reference(cache, slots, kind: str):
    """What ModelRunner._key_statistic computes, per view slot, mean over layers and KV heads:
    "norm" ||k||, "value_norm" ||v||, "similarity" cos(k, the view's mean unit key); cache
    [L, S, 2, KVH, D] (float64 for a reference). -> numpy [len(slots)]."""
    x = cache[:, slots, 1 if kind == "value_norm" else 0]           # [L, n, KVH, D]
    norms = x.norm(dim=-1, keepdim=True)
    if kind != "similarity":
        return norms.mean(dim=(0, 2)).flatten().numpy()
    unit = x / norms
    anchor = unit.mean(dim=1, keepdim=True)
    return (unit * anchor / anchor.norm(dim=-1, keepdim=True)).sum(-1).mean(dim=(0, 2)).numpy()


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def same_fp8_codes(got, want, dtype) -> bool:
    """fp8 bytes (uint8) equal, but for a NaN's sign bit: NaN where want has NaN (either
    sign; torch builds differ in the sign of the NaN their CPU clamp returns), equal bytes
    everywhere else."""
    nan = want.view(dtype).float().isnan()
    return torch.equal(got.view(dtype).float().isnan(), nan) and torch.equal(got[~nan], want[~nan])


def moves(num_slots, n, seed):
    perm = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))
    return perm[:n], perm[n:2 * n]          # disjoint, shuffled


def paged_scene(lens, kvh, d, seed, num_blocks=40, pad=-1, dtype=torch.float32):
    """Requests whose tokens sit in shuffled blocks, with eviction holes: views are the live
    slots in logical order, padded to [B, Lmax] with `pad`."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_blocks * BS, 2, kvh, d, generator=g).to(dtype)
    blocks = torch.randperm(num_blocks, generator=g)
    views, used = [], 0
    for n in lens:                              # n live tokens out of about 1.6 n written
        written = n + n * 6 // 10
        nb = -(-written // BS)
        mine = blocks[used:used + nb]
        used += nb
        slots = (mine[:, None] * BS + torch.arange(BS)).reshape(-1)[:written]
        live = torch.randperm(written, generator=g)[:n].sort().values     # holes = evicted
        views.append(slots[live])
    slots = torch.full((len(lens), max(lens)), pad, dtype=torch.int64)
    for i, v in enumerate(views):
        slots[i, :len(v)] = v
    return kv, slots, torch.tensor(lens)


def decode_reference(q, kv, slots, lens, scale, sinks=None):
    """Per request, per head, float64: (out, per-key probability summed over heads); sinks as
    in attention_reference."""
    b, h, d = q.shape
    kvh = kv.shape[2]
    out = torch.zeros(b, h, d, dtype=torch.float64)
    mass = torch.zeros(slots.shape, dtype=torch.float64)
    for i in range(b):
        view = slots[i, :lens[i]]
        for head in range(h):
            k = kv[view, 0, head // (h // kvh)].double()
            v = kv[view, 1, head // (h // kvh)].double()
            s = k @ q[i, head].double() * scale
            if sinks is not None:
                s = torch.cat((s, sinks[head:head + 1].double()))
            p = torch.softmax(s, dim=0)[:len(view)]
            out[i, head] = p @ v
            mass[i, :lens[i]] += p
    return out, mass


def attention_reference(q, k, v, mask, scale, sinks=None):
    """float64 (out [H, Lq, D], probabilities [H, Lq, Lk]) of q [H, Lq, D] over k/v [KVH, Lk, D]
    (GQA) where mask [Lq, Lk] is True. sinks [H] (gpt-oss, transformers' GptOss
    eager_attention_forward): each head's logit joins its softmax as a key with no value,
    p_j = exp(l_j) / (sum_i exp(l_i) + exp(s_h)), so a row of probabilities sums to < 1."""
    h, kvh, lk = q.shape[0], k.shape[0], k.shape[1]
    k = k.repeat_interleave(h // kvh, 0).double()
    v = v.repeat_interleave(h // kvh, 0).double()
    s = ((q.double() @ k.transpose(1, 2)) * scale).masked_fill(~mask, float("-inf"))
    if sinks is not None:
        s = torch.cat((s, sinks.double().view(h, 1, 1).expand(h, s.shape[1], 1)), -1)
    p = torch.softmax(s, -1)[..., :lk]
    return p @ v, p


def prefill_reference(q, k, v, mask, scale):
    return attention_reference(q, k, v, mask, scale)[0]


# ---- Triton kernels compiled for a CUDA target without a GPU (Triton ships ptxas) ---------------
# Run these in a process without TRITON_INTERPRET (an interpreted @triton.jit cannot compile).
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# an fp8 KV cache: a case's dtype "bf16+e4m3" is q/out in bf16 over an e4m3fn cache
FP8_KV = {"e4m3": ("fp8e4nv", "float8_e4m3fn"), "e5m2": ("fp8e5", "float8_e5m2")}
# integer arguments that are multiples of 16 at the engine's shapes (head_dim 64/128): the JIT
# specializes them (tt.divisibility 16), and so do these compiles; slot/mass row strides are
# max_model_len, which may be anything, and are left unspecialized
ALIGNED_INTS = ("stride_qb", "stride_qh", "stride_slot", "stride_kv", "stride_head", "stride_ob",
                "stride_oh")


def split_dtype(dtype: str):
    """A case's dtype -> (q dtype, KV cache dtype), Triton names: "bf16" -> (bf16, bf16),
    "bf16+e4m3" -> (bf16, fp8e4nv)."""
    q, _, kv = dtype.partition("+")
    return q, FP8_KV[kv][0] if kv else q


def torch_dtypes(dtype: str):
    """A case's dtype -> (q torch dtype, cache torch dtype)."""
    import torch
    q, _, kv = dtype.partition("+")
    return getattr(torch, DTYPES[q]), getattr(torch, FP8_KV[kv][1] if kv else DTYPES[q])


def kernel_signature(fn, dtype: str, constexprs: dict):
    """(signature, attrs) of a decode-path kernel as decode_attention launches it: q/out (and
    the cache, unless fp8: split_dtype) in `dtype`, int64 slots and lens, other pointers fp32
    (an fp8 cache's scale row too), 16-byte aligned pointers and strides."""
    q, kv = split_dtype(dtype)
    types = {"q_ptr": f"*{q}", "kv_ptr": f"*{kv}", "out_ptr": f"*{q}",
             "slots_ptr": "*i64", "lens_ptr": "*i64", "scale": "fp32"}
    sig, attrs = {}, {}
    for i, a in enumerate(fn.arg_names):
        if a in constexprs:
            sig[a] = "constexpr"
            continue
        sig[a] = types.get(a, "*fp32" if a.endswith("_ptr") else "i32")
        if a.endswith("_ptr") or a in ALIGNED_INTS:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def decode_kernel_specs(dtype: str, d: int, g: int, sinks: bool = False) -> dict:
    """{name: (fn, constexprs, options)}: every decode-path kernel with the block sizes, warps
    and pipelining decode_attention picks for head_dim d, g query heads per KV head and this
    dtype; sinks: as a layer with attention sinks launches them."""
    from vllm.kernels import triton_decode as td
    q, kv = torch_dtypes(dtype)
    cfg = td._config(g, d, kv, q)
    tile = dict(G=g, D=d, BLOCK_G=cfg.block_g, BLOCK_D=cfg.block_d)
    attention = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return {
        "decode": (td._decode_kernel, {**tile, "BLOCK_N": cfg.block_n, "WANT_STATS": False,
                                       "HAS_SINKS": sinks}, attention),
        "decode_stats": (td._decode_kernel, {**tile, "BLOCK_N": cfg.block_n, "WANT_STATS": True,
                                             "HAS_SINKS": sinks}, attention),
        "split": (td._split_kernel, {**tile, "BLOCK_N": cfg.block_n}, attention),
        "reduce": (td._reduce_kernel, dict(D=d, BLOCK_S=td.REDUCE_CHUNK, BLOCK_D=cfg.block_d,
                                           WANT_STATS=True, HAS_SINKS=sinks),
                   dict(num_warps=cfg.num_warps)),
        "mass": (td._mass_kernel, {**tile, "BLOCK_N": cfg.mass_block_n}, attention),
    }


def compile_kernel(fn, dtype: str, constexprs: dict, options: dict, capability: int = 90):
    """options: the launch's num_warps (and num_stages, where decode_attention sets it)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig, attrs = kernel_signature(fn, dtype, constexprs)
    return triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", capability, 32), options=options)


def _cuobjdump(cubin: bytes, *args: str) -> str:
    import os
    import subprocess
    import tempfile

    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *args, f.name], capture_output=True, text=True,
                              check=True).stdout


def resource_usage(kernel) -> dict:
    """Registers, spill bytes (the local stack frame: what n_spills reports on a GPU) and
    tensor-core instructions of a compiled kernel, read from its cubin and PTX."""
    import re
    usage = _cuobjdump(kernel.asm["cubin"], "--dump-resource-usage")
    field = lambda name: int(re.search(name + r":(\d+)", usage).group(1))
    sass = _cuobjdump(kernel.asm["cubin"], "-sass")
    ptx = kernel.asm["ptx"]
    return {"regs": field("REG"), "spill_bytes": field("STACK") + field("LOCAL"),
            "shared": kernel.metadata.shared,
            "mma_ptx": "mma.sync" in ptx or "wgmma" in ptx,
            "mma_sass": "HMMA" in sass or "HGMMA" in sass}


def compile_decode_kernels(cases, capability: int = 90) -> dict:
    """cases: (dtype, head_dim, g, kernel name) -> {"dtype/d/g/name": resource_usage}."""
    out = {}
    for dtype, d, g, name in cases:
        fn, consts, options = decode_kernel_specs(dtype, d, g)[name]
        out[f"{dtype}/{d}/{g}/{name}"] = resource_usage(
            compile_kernel(fn, dtype, consts, options, capability))
    return out


def compile_kernels(capability: int) -> dict:
    """Compile the Triton kernels for a CUDA target without a GPU. Returns {kernel: cubin
    bytes}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm.kernels import triton_relocate, triton_write_kv
    target = GPUTarget("cuda", capability, 32)
    sizes = {}
    reloc = {"kv_ptr": "*i32", "src_ptr": "*i64", "dst_ptr": "*i64", "num_layers": "i32",
             "layer_stride": "i64", "ROW": "constexpr", "BLOCK": "constexpr"}
    kernel = triton.compile(ASTSource(triton_relocate._relocate_kernel, reloc,
                                      constexprs={"ROW": 1024, "BLOCK": 1024}), target=target)
    sizes["relocate"] = len(kernel.asm["cubin"])
    for dtype, mass in (("fp16", True), ("fp32", False)):
        fn, consts, options = decode_kernel_specs(dtype, 128, 4)["decode_stats" if mass
                                                                 else "decode"]
        sizes[f"decode_{dtype}_mass{int(mass)}"] = len(
            compile_kernel(fn, dtype, consts, options, capability).asm["cubin"])
    # split-K decode and the mass pass (what CUDA graph buckets with long views run), in bf16
    # (the engine's dtype on CUDA)
    for name, (fn, consts, options) in decode_kernel_specs("bf16", 128, 4).items():
        if name in ("split", "reduce", "mass"):
            sizes[name] = len(compile_kernel(fn, "bf16", consts, options,
                                             capability).asm["cubin"])
    write = {"k_ptr": "*bf16", "v_ptr": "*bf16", "cache_ptr": "*bf16", "slot_ptr": "*i64",
             **{f"stride_{n}": "i32" for n in ("kt", "kh", "vt", "vh", "slot", "kv", "head")}}
    consts = dict(KVH=8, D=128, BLOCK_H=8, BLOCK_D=128)
    kernel = triton.compile(ASTSource(triton_write_kv._write_kv_kernel,
                                      {**write, **{c: "constexpr" for c in consts}},
                                      constexprs=consts), target=target)
    sizes["write_kv"] = len(kernel.asm["cubin"])
    return sizes


def compile_write_kv_fp8(cache: str, capability: int = 90, kvh: int = 8, d: int = 128):
    """The quantizing KV write kernel, bf16 K/V into a `cache`-typed pool (fp8e4nv, fp8e5)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm.kernels import triton_write_kv
    write = {"k_ptr": "*bf16", "v_ptr": "*bf16", "cache_ptr": f"*{cache}", "scale_ptr": "*fp32",
             "slot_ptr": "*i64",
             **{f"stride_{n}": "i32" for n in ("kt", "kh", "vt", "vh", "slot", "kv", "head")}}
    consts = dict(KVH=kvh, D=d, BLOCK_H=triton.next_power_of_2(kvh),
                  BLOCK_D=triton.next_power_of_2(d))
    return triton.compile(ASTSource(triton_write_kv._write_kv_fp8_kernel,
                                    {**write, **{c: "constexpr" for c in consts}},
                                    constexprs=consts), target=GPUTarget("cuda", capability, 32))


def install_fake_xformers(monkeypatch, memory_efficient_attention, **attn_bias_classes):
    """xformers' module tree in sys.modules with torch stand-ins (its ops do not run on CPU):
    xformers.ops.memory_efficient_attention and xformers.ops.fmha.attn_bias.<classes>."""
    ops_mod = types.SimpleNamespace(memory_efficient_attention=memory_efficient_attention)
    bias_mod = types.SimpleNamespace(**attn_bias_classes)
    for name, mod in {"xformers": types.SimpleNamespace(ops=ops_mod), "xformers.ops": ops_mod,
                      "xformers.ops.fmha": types.SimpleNamespace(attn_bias=bias_mod),
                      "xformers.ops.fmha.attn_bias": bias_mod}.items():
        monkeypatch.setitem(sys.modules, name, mod)
