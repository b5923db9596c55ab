"""SimulatedModel (--load-format simulate): no model math, synthetic attention statistics.

The KV plane (scheduler, block manager, token tables, policies, planner, copy executor) runs for
real; only the transformer is replaced, so paper-scale capacity runs fit on a CPU in minutes.

The engine gives it a tiny KV cache, one layer of one head of width one:

    kv_caches   [1, num_slots, 2, 1, 1]      [..., 0, 0, 0] = importance w   [..., 1, 0, 0] = position

Each new token's importance is written to its slot exactly like real K/V, so relocation copies
move it and attention reads it through the same views; a broken copy or table corrupts the
statistics, as it would corrupt real attention. Importance is a seeded, heavy-tailed function of
(position, token id): log-normal, with an attention-sink boost on position 0.

Statistics follow the real backend's shapes and meaning (vllm/attention/backend.py): every
layer-head's probabilities over the visible keys sum to 1, so each query row sums to L*H.
  decode   p_q(j) ~ w_j * n(q, j)   (n: a seeded log-normal per (query, key) jitter)
  prefill  p_q(j) ~ w_j over keys with position <= q's; column sums in O(Lk) via prefix sums.
A family with learned attention sinks (gpt-oss: the model class's `attention_sinks`) has a
sink of weight SINK_WEIGHT in every denominator, as its softmax does: p_q(j) = w_j / (W(q) +
SINK_WEIGHT), and rows sum to less than L*H.
Key statistics (synthetic_key_statistic, from the cache rows, so relocation carries them): "norm" w,
"similarity" 1 (one-dimensional keys all point the same way), "value_norm" a seeded log-normal of
the position (a few tokens with large value norms, as VaSE observes).
"""
import numpy as np
import torch

from vllm.model_executor.layers.attention import attention_specs, scores_from

TABLE_BITS = 20
SINK_BOOST = 30.0          # attention sinks: the first token draws a large share of attention
IMPORTANCE_SIGMA = 1.5     # log-normal spread of key importance (heavy hitters)
JITTER_SIGMA = 0.5         # per-query variation of decode attention
VALUE_SIGMA = 1.0          # log-normal spread of value norms
SINK_WEIGHT = 4.0          # a learned sink draws the attention of this many median keys


class SimulatedModel:
    def __init__(self, hf_config, seed: int = 0):
        if getattr(hf_config, "head_dim", None) is None:
            hf_config.head_dim = hf_config.hidden_size // hf_config.num_attention_heads
        self.config = hf_config
        self.vocab = hf_config.vocab_size
        # the layer-heads whose attention the statistics sum (a hybrid model's full layers)
        self.layer_heads = sum(scores_from(attention_specs(hf_config))) * \
            hf_config.num_attention_heads
        from vllm.model_executor.model_loader import model_class
        self.sink = SINK_WEIGHT if model_class(hf_config).attention_sinks else 0.0
        g = torch.Generator().manual_seed(seed)
        size = 1 << TABLE_BITS
        self.importance = torch.empty(size).log_normal_(0.0, IMPORTANCE_SIGMA, generator=g)
        self.jitter = torch.empty(size).log_normal_(0.0, JITTER_SIGMA, generator=g)
        self.salt = int(torch.randint(0, size, (1,), generator=g))
        self.value_norms = torch.empty(size).log_normal_(0.0, VALUE_SIGMA, generator=g)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    # ---- model interface --------------------------------------------------------------------
    def __call__(self, input_ids, positions, kv_caches, meta):
        return self.forward(input_ids, positions, kv_caches, meta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta) -> torch.Tensor:
        """-> hidden [T, 1]: the token each position predicts, as a float."""
        cache = kv_caches[0, :, :, 0, 0]                          # [num_slots, 2]
        w = self._importance(input_ids, positions)
        cache[meta.slot_mapping] = torch.stack((w, positions.to(cache.dtype)), dim=1)
        b = meta.num_decodes
        if b and meta.decode_mass is not None:
            meta.decode_mass += self._decode_probs(cache, meta, positions[:b])
        for span in meta.prefills:
            if span.colsum is not None:
                span.colsum += self._prefill_colsum(cache, span,
                                                    positions[span.q_start:span.q_end])
        nxt = (input_ids * 31 + positions * 17 + 7) % self.vocab
        return nxt.to(torch.float32).unsqueeze(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(hidden.shape[0], self.vocab, dtype=torch.float32)
        logits[torch.arange(hidden.shape[0]), hidden[:, 0].long()] = 1.0
        return logits

    def synthetic_key_statistic(self, kv_caches: torch.Tensor, slots: torch.Tensor,
                                kind: str) -> np.ndarray:
        """Key statistic `kind` per token in `slots`: the model runner asks this model for it
        instead of reading a real model's K/V (see the module docstring)."""
        rows = kv_caches[0, slots, :, 0, 0].float()                 # [n, 2]: (w, position)
        if kind == "norm":
            return rows[:, 0].abs().numpy()
        if kind == "similarity":
            return np.ones(len(rows), np.float32)
        assert kind == "value_norm", kind
        return self.value_norms[self._index(rows[:, 1], torch.zeros(len(rows)))].numpy()

    # ---- synthetic attention ----------------------------------------------------------------
    def _index(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        mask = (1 << TABLE_BITS) - 1
        return (a.long() * 1000003 + b.long() * 7919 + self.salt) & mask

    def _importance(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        w = self.importance[self._index(positions, input_ids)]
        return torch.where(positions == 0, w * SINK_BOOST, w)

    def _decode_probs(self, cache, meta, qpos: torch.Tensor) -> torch.Tensor:
        b, width = meta.decode_slots.shape
        kv = cache.index_select(0, meta.decode_slots.view(-1)).view(b, width, 2)
        w, kpos = kv[..., 0], kv[..., 1]
        s = w * self.jitter[self._index(kpos, qpos[:, None])]
        s = s.masked_fill(meta.decode_bias.view(b, width) != 0, 0.0)    # -inf = padding
        return s / (s.sum(dim=1, keepdim=True) + self.sink) * self.layer_heads

    def _prefill_colsum(self, cache, span, qpos: torch.Tensor) -> torch.Tensor:
        """colsum[j] = L*H * w_j * sum over scored queries q that see j of 1 / W(q),
        W(q) = sum of w over the keys q sees (a prefix of the view: keys are in logical order)."""
        w = cache.index_select(0, span.kv_slots)[:, 0].double()
        lk, lq = len(w), len(qpos)
        if span.mask is None:      # plain causal: query i sees the first Lk - Lq + i + 1 keys
            seen = torch.arange(lk - lq + 1, lk + 1)
        else:
            seen = span.mask.sum(dim=1)
        seen = seen[span.colsum_from:]   # only the scored queries vote
        inv = 1.0 / (w.cumsum(0)[seen - 1] + self.sink)
        # per_key[k] = sum of 1/W(q) over queries whose last visible key is k; suffix-sum it
        per_key = torch.zeros(lk, dtype=torch.float64).index_add_(0, seen - 1, inv)
        reach = per_key.flip(0).cumsum(0).flip(0)
        return (w * reach * self.layer_heads).float()
