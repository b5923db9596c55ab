"""One dispatch point for kernels: CUDA op when built, else the torch fallback."""
import torch


def relocate_kv(kv_caches: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """kv_caches [L, S, 2, KVH, D]: copy every layer's K and V rows src[i] -> dst[i] in place.

    src and dst never overlap (the planner moves live tokens into dead slots of other blocks).
    """
    if len(src) == 0:
        return
    kv_caches.index_copy_(1, dst, kv_caches.index_select(1, src))
