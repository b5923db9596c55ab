"""TPShards: which slice of each checkpoint tensor one tensor-parallel rank loads.

Upstream's layout for the Llama family (H heads, KVH KV heads, head size D, N ranks, rank r):

    q_proj  [H*D, E]     rows, by heads          rank r: heads r*H/N .. (r+1)*H/N
    k/v     [KVH*D, E]   rows, by KV heads       N <= KVH: KV heads r*KVH/N ..; N > KVH: the one
                                                 KV head r*KVH//N, replicated N/KVH times
    o_proj  [E, H*D]     columns (row-parallel: partial sums, all-reduced)
    gate/up [I, E]       rows
    down    [E, I]       columns (row-parallel, all-reduced)
    experts              each expert as gate/up/down over its own intermediate size Ie
                         (moe_intermediate_size, else intermediate_size): Mixtral's w1/w3
                         rows, w2 columns; gpt-oss's fused gate_up_proj [X, E, 2Ie] its last
                         dim (interleaved gate/up pairs stay together), down_proj [X, Ie, E]
                         dim 1; the router whole (every rank routes alike)
    sinks   [H]          by heads, as q
    embed, lm_head [V, E] rows, by vocabulary: ceil(V/N) each, the last zero-padded
    norms                whole on every rank

Worked example, the default model (H=9, KVH=3, D=64, I=1536, V=49152) at N=3: rank 1 loads q
rows 192..384, k/v rows 64..128, o columns 192..384, gate/up rows 512..1024, down columns
512..1024 and vocabulary rows 16384..32768. Slicing a safetensors file reads only those bytes.
"""
import re
from typing import Tuple

import torch


# an expert's tensor: gpt-oss's fused (group 1), or one expert's (group 2: its projection)
_EXPERT_RE = re.compile(r"\.experts\.(?:(gate_up_proj(?:_bias)?|down_proj)$|\d+\.(\w+)\.)")


def _shape(t) -> Tuple[int, ...]:
    return tuple(t.get_shape()) if hasattr(t, "get_shape") else tuple(t.shape)


class TPShards:
    def __init__(self, hf_config, rank: int, world_size: int):
        c = hf_config
        self.rank, self.n = rank, world_size
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // self.heads
        self.intermediate, self.vocab = c.intermediate_size, c.vocab_size
        self.expert_intermediate = getattr(c, "moe_intermediate_size", None) or self.intermediate
        self.check()

    def check(self) -> None:
        n, h, kvh = self.n, self.heads, self.kv_heads
        kv_ok = kvh % n == 0 if n <= kvh else n % kvh == 0
        if h % n or not kv_ok or self.intermediate % n or self.expert_intermediate % n:
            raise ValueError(
                f"--tensor-parallel-size {n}: the model has {h} attention heads, {kvh} KV "
                f"heads and an MLP of {self.intermediate} (experts of "
                f"{self.expert_intermediate}); the attention heads and the MLPs must divide by "
                f"the tensor-parallel size, and the KV heads must divide by it or it by them "
                f"(KV heads are then replicated)")

    # ---- what this rank holds -------------------------------------------------------------
    @property
    def local_heads(self) -> int:
        return self.heads // self.n

    @property
    def local_kv_heads(self) -> int:
        return max(self.kv_heads // self.n, 1)

    @property
    def vocab_shard(self) -> int:
        return -(-self.vocab // self.n)

    def _kv_rows(self) -> Tuple[int, int]:
        first = self.rank * self.kv_heads // self.n if self.n > self.kv_heads \
            else self.rank * self.local_kv_heads
        return first * self.head_dim, (first + self.local_kv_heads) * self.head_dim

    def span(self, name: str) -> Tuple[int, int, int]:
        """(dim, start, stop) of the slice this rank loads of checkpoint tensor `name`; dim -1:
        the whole tensor."""
        r, d = self.rank, self.head_dim
        q = self.local_heads * d
        i = self.intermediate // self.n
        v = self.vocab_shard
        ie = self.expert_intermediate // self.n
        m = _EXPERT_RE.search(name)
        if m is not None:
            proj = m[1] or m[2]
            if proj in ("gate_up_proj", "gate_up_proj_bias"):      # gpt-oss, fused: 2 Ie
                return (2 if proj == "gate_up_proj" else 1), 2 * r * ie, 2 * (r + 1) * ie
            if proj == "down_proj" and m[1]:                        # gpt-oss, fused
                return 1, r * ie, (r + 1) * ie
            if name.endswith(("down_proj.bias", "w2.bias")):
                return -1, 0, 0
            if proj in ("down_proj", "w2"):
                return 1, r * ie, (r + 1) * ie
            return 0, r * ie, (r + 1) * ie
        if name.endswith("self_attn.sinks"):
            return 0, r * self.local_heads, (r + 1) * self.local_heads
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return 0, r * q, (r + 1) * q
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            return (0, *self._kv_rows())
        if name.endswith("o_proj.weight"):
            return 1, r * q, (r + 1) * q
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            return 0, r * i, (r + 1) * i
        if name.endswith("down_proj.weight"):
            return 1, r * i, (r + 1) * i
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, r * v, min((r + 1) * v, self.vocab)
        return -1, 0, 0

    def take(self, name: str, tensor) -> torch.Tensor:
        """This rank's slice of `tensor` (a torch tensor or a safetensors slice), vocabulary
        shards zero-padded to vocab_shard rows."""
        dim, start, stop = self.span(name)
        if self.n == 1 or dim == -1:
            return tensor[:] if not isinstance(tensor, torch.Tensor) else tensor
        part = tensor[(slice(None),) * dim + (slice(start, stop),)]
        if name in ("model.embed_tokens.weight", "lm_head.weight") and stop - start < \
                self.vocab_shard:
            pad = torch.zeros(self.vocab_shard - (stop - start), _shape(part)[1],
                              dtype=part.dtype, device=part.device)
            part = torch.cat([part, pad])
        return part.contiguous() if isinstance(part, torch.Tensor) else part
