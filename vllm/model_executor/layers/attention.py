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
from typing import List, Optional

FULL, SLIDING = "full_attention", "sliding_attention"


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
