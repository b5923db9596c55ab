"""Torch references and small paged-cache scenes shared by tests/test_kernels.py and tests/gpu."""
import sys
import types

import torch

BS = 4   # block size of the paged scenes


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


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


def decode_reference(q, kv, slots, lens, scale):
    """Per request, per head, float64: (out, per-key probability summed over heads)."""
    b, h, d = q.shape
    kvh = kv.shape[2]
    out = torch.zeros(b, h, d, dtype=torch.float64)
    mass = torch.zeros(slots.shape, dtype=torch.float64)
    for i in range(b):
        view = slots[i, :lens[i]]
        for head in range(h):
            k = kv[view, 0, head // (h // kvh)].double()
            v = kv[view, 1, head // (h // kvh)].double()
            p = torch.softmax(k @ q[i, head].double() * scale, dim=0)
            out[i, head] = p @ v
            mass[i, :lens[i]] += p
    return out, mass


def prefill_reference(q, k, v, mask, scale):
    h, kvh = q.shape[0], k.shape[0]
    k = k.repeat_interleave(h // kvh, 0).double()
    v = v.repeat_interleave(h // kvh, 0).double()
    s = (q.double() @ k.transpose(1, 2)) * scale
    return torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v


def compile_kernels(capability: int) -> dict:
    """Compile the Triton kernels for a CUDA target without a GPU (Triton ships ptxas); run in a
    process without TRITON_INTERPRET. Returns {kernel: cubin bytes}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm.attention import triton_decode, triton_relocate, triton_write_kv
    target = GPUTarget("cuda", capability, 32)
    sizes = {}
    reloc = {"kv_ptr": "*i32", "src_ptr": "*i64", "dst_ptr": "*i64", "num_layers": "i32",
             "layer_stride": "i64", "ROW": "constexpr", "BLOCK": "constexpr"}
    kernel = triton.compile(ASTSource(triton_relocate._relocate_kernel, reloc,
                                      constexprs={"ROW": 1024, "BLOCK": 1024}), target=target)
    sizes["relocate"] = len(kernel.asm["cubin"])
    for dtype, mass in (("fp16", True), ("fp32", False)):
        sig = {"q_ptr": f"*{dtype}", "kv_ptr": f"*{dtype}", "slots_ptr": "*i64",
               "lens_ptr": "*i64", "out_ptr": f"*{dtype}", "mass_ptr": "*fp32", "scale": "fp32"}
        sig.update({f"stride_{n}": "i32" for n in ("qb", "qh", "sb", "slot", "kv", "head", "mb",
                                                    "mh")})
        consts = dict(G=4, D=128, BLOCK_G=16, BLOCK_N=32, BLOCK_D=128, WANT_MASS=mass)
        sig.update({c: "constexpr" for c in consts})
        kernel = triton.compile(ASTSource(triton_decode._decode_kernel, sig, constexprs=consts),
                                target=target)
        sizes[f"decode_{dtype}_mass{int(mass)}"] = len(kernel.asm["cubin"])
    # split-K decode (what CUDA graph buckets, with their full-width views, run) and the KV
    # write, in bf16 (the engine's dtype on CUDA)
    ptrs = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "slots_ptr": "*i64", "lens_ptr": "*i64"}
    strides = {f"stride_{n}": "i32" for n in ("qb", "qh", "sb", "slot", "kv", "head")}
    tiles = dict(G=4, D=128, BLOCK_G=16, BLOCK_N=32, BLOCK_D=128)
    split = {**ptrs, "ml_ptr": "*fp32", "acc_ptr": "*fp32", "scale": "fp32", "min_tiles": "i32",
             **strides}
    mass_sig = {**ptrs, "stats_ptr": "*fp32", "part_ptr": "*fp32", "scale": "fp32",
                "min_tiles": "i32", **strides, "stride_pb": "i32", "stride_ph": "i32"}
    reduce = {"ml_ptr": "*fp32", "acc_ptr": "*fp32", "out_ptr": "*bf16", "stats_ptr": "*fp32",
              "num_splits": "i32", "stride_ob": "i32", "stride_oh": "i32"}
    write = {"k_ptr": "*bf16", "v_ptr": "*bf16", "cache_ptr": "*bf16", "slot_ptr": "*i64",
             **{f"stride_{n}": "i32" for n in ("kt", "kh", "vt", "vh", "slot", "kv", "head")}}
    for name, fn, sig, consts in (
            ("split", triton_decode._split_kernel, split, tiles),
            ("reduce", triton_decode._reduce_kernel, reduce,
             dict(D=128, BLOCK_S=32, BLOCK_D=128, WANT_STATS=True)),
            ("mass", triton_decode._mass_kernel, mass_sig, tiles),
            ("write_kv", triton_write_kv._write_kv_kernel, write,
             dict(KVH=8, D=128, BLOCK_H=8, BLOCK_D=128))):
        kernel = triton.compile(ASTSource(fn, {**sig, **{c: "constexpr" for c in consts}},
                                          constexprs=consts), target=target)
        sizes[name] = len(kernel.asm["cubin"])
    return sizes


def install_fake_xformers(monkeypatch, memory_efficient_attention, **attn_bias_classes):
    """xformers' module tree in sys.modules with torch stand-ins (its ops do not run on CPU):
    xformers.ops.memory_efficient_attention and xformers.ops.fmha.attn_bias.<classes>."""
    ops_mod = types.SimpleNamespace(memory_efficient_attention=memory_efficient_attention)
    bias_mod = types.SimpleNamespace(**attn_bias_classes)
    for name, mod in {"xformers": types.SimpleNamespace(ops=ops_mod), "xformers.ops": ops_mod,
                      "xformers.ops.fmha": types.SimpleNamespace(attn_bias=bias_mod),
                      "xformers.ops.fmha.attn_bias": bias_mod}.items():
        monkeypatch.setitem(sys.modules, name, mod)
