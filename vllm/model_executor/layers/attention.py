"""What each decoder layer's attention reads: its sliding window (or none) and which rotary
table it uses. Config only (no torch), so the engine sizes and schedules from the same rules
the model is built with.

transformers masks key k for query q in a sliding layer unless q - W < k <= q, on logical
positions. Eviction never changes positions, so a window is a condition on logical ids: the
engine sends, per decode row, how many leading entries of its attention view fall outside the
window (AttentionMetadata.window_skip), and prefill masks compare ids.

    layer_types present (Gemma 2/3, Qwen2/3)   "sliding_attention" -> sliding_window,
                                               "full_attention" -> none
    no layer_types, sliding_window set (Mistral)  every layer slides
"""
from dataclasses import dataclass
from typing import List, Optional, Tuple

FULL, SLIDING = "full_attention", "sliding_attention"
# set on the HF config by the engine (--disable-hybrid-kv-cache-manager; it travels to every
# rank with the config): every layer in one KV group
ONE_KV_GROUP_ATTR = "vllm_one_kv_group"


@dataclass(frozen=True)
class AttentionSpec:
    layer_type: str                    # FULL or SLIDING (also the key of its rotary table)
    sliding_window: Optional[int]      # W: keys with logical id > q - W; None: every key


def attention_specs(cfg) -> List[AttentionSpec]:
    """One spec per layer; a layer type the engine cannot run is an error."""
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        types = [SLIDING if window is not None else FULL] * n
    if len(types) != n:
        raise ValueError(f"--model: layer_types has {len(types)} entries for {n} layers")
    unknown = sorted(set(types) - {FULL, SLIDING})
    if unknown:
        raise ValueError(f"--model: attention layer types {unknown} are not supported; "
                         f"supported: {[FULL, SLIDING]}")
    if SLIDING in types and (window is None or int(window) < 1):
        raise ValueError(f"--model: sliding-window layers with sliding_window={window!r}")
    return [AttentionSpec(t, int(window) if t == SLIDING else None) for t in types]


def model_window(cfg) -> Optional[int]:
    """The sliding window of the model's sliding layers (one per model), or None."""
    windows = {s.sliding_window for s in attention_specs(cfg)} - {None}
    return windows.pop() if windows else None


def scores_from(specs: List[AttentionSpec]) -> List[bool]:
    """Which layers' attention feeds the eviction statistics: the full-attention ones (sliding
    layers spread their mass over the recent window, which policies already protect); a model
    with no full layer (Mistral) scores from all of them."""
    if all(s.sliding_window is not None for s in specs):
        return [True] * len(specs)
    return [s.sliding_window is None for s in specs]


@dataclass(frozen=True)
class KVGroups:
    """How the layers' KV is laid out in the pool (upstream's hybrid KV cache manager, with one
    page size). A model whose layers are all full attention, or all sliding (Mistral), or run
    with --disable-hybrid-kv-cache-manager, keeps one group: every layer its own tensor, every
    block all layers. A model with both (Gemma 3, gpt-oss) has a full-attention group (the token
    table, eviction, reclamation, prefix caching) and sliding subgroups of the same number of
    layers, g = the full layers' count; tensor t holds layer t of every group, so a pool block
    is one page in each of the g tensors and any group may take it:

        Gemma 3, 18 layers (every 6th full): g = 3 tensors, ceil(15 / 3) = 5 subgroups
            full       layers 5, 11, 17         -> tensors 0, 1, 2
            sliding 1  layers 0, 1, 2           -> tensors 0, 1, 2
            sliding 2  layers 3, 4, 6           -> tensors 0, 1, 2
            ...
            sliding 5  layers 14, 15, 16        -> tensors 0, 1, 2

    A request holds, per sliding subgroup, one block per logical block that a query to come can
    still see (ids > next position - W): at most ceil(W / block_size) + 1 after a decode step.
    """
    num_tensors: int                   # g: KV tensors (layers per block)
    layer_group: Tuple[int, ...]       # per layer: 0 = full attention, k >= 1 sliding subgroup k
    layer_tensor: Tuple[int, ...]      # per layer: its tensor
    window: Optional[int] = None       # W of the sliding subgroups

    @property
    def hybrid(self) -> bool:
        return self.num_sliding_groups > 0

    @property
    def num_sliding_groups(self) -> int:
        return max(self.layer_group, default=0)


def kv_groups(cfg) -> KVGroups:
    specs = attention_specs(cfg)
    full = [i for i, s in enumerate(specs) if s.sliding_window is None]
    sliding = [i for i, s in enumerate(specs) if s.sliding_window is not None]
    if getattr(cfg, ONE_KV_GROUP_ATTR, False) or not full or not sliding:
        n = len(specs)
        return KVGroups(n, (0,) * n, tuple(range(n)))
    g = len(full)
    group, tensor = [0] * len(specs), [0] * len(specs)
    for t, i in enumerate(full):
        tensor[i] = t
    for m, i in enumerate(sliding):
        group[i], tensor[i] = 1 + m // g, m % g
    return KVGroups(g, tuple(group), tuple(tensor), specs[sliding[0]].sliding_window)
