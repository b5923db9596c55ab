"""EngineArgs: the engine's options, with upstream vLLM's CLI flag names."""
import argparse
import dataclasses
from dataclasses import InitVar, dataclass
from typing import Optional

from vllm.config import (DEFAULT_MIN_TOKENS, DEVICES, DISTRIBUTED_BACKENDS, EVICTION_POLICIES,
                         EVICTION_SCOPES, KV_CACHE_DTYPES,
                         QUANTIZATION_METHODS, RECLAMATION_MODES, KVEvictionConfig,
                         ParallelConfig)

_KV_FIELDS = {  # EngineArgs field -> KVEvictionConfig field
    "kv_eviction_policy": "policy", "kv_eviction_ratio": "eviction_ratio",
    "kv_budget_tokens": "budget_tokens", "kv_min_tokens": "min_tokens",
    "kv_prefill_chunk": "prefill_chunk", "kv_evict_scope": "scope",
    "kv_evict_interval": "interval",
    "kv_sink_tokens": "sink_tokens",
    "kv_recent_fraction": "recent_fraction", "kv_reclamation": "reclamation",
    "kv_frag_threshold": "frag_threshold", "kv_check_invariants": "check_invariants",
    "kv_eviction_log": "keep_eviction_log", "kv_reclaim_force_sync": "reclaim_force_sync",
    "seed": "seed",
}


@dataclass
class EngineArgs:
    model: Optional[str] = None            # local HF dir or .gguf; None = SmolLM2-135M-Instruct
    tokenizer: Optional[str] = None
    device: str = "auto"                   # auto = cuda when torch sees a GPU, else cpu
    dtype: str = "auto"                    # auto = bfloat16 on CUDA, float32 on CPU (bf16
                                           # GEMM weights for a bf16 checkpoint where faster)
    block_size: int = 16
    max_model_len: Optional[int] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    num_gpu_blocks_override: Optional[int] = None
    kv_cache_memory: Optional[int] = None  # CPU: KV bytes
    gpu_memory_utilization: float = 0.9    # CUDA: weights + activations + KV share of memory
    enable_prefix_caching: bool = False
    kv_cache_dtype: str = "auto"           # auto = the model's precision (kv_quant.resolve)
    calculate_kv_scales: bool = False      # fp8: per-layer K/V scales from the first prefill
    disable_hybrid_kv_cache_manager: bool = False   # sliding layers keep full-size KV
    enable_chunked_prefill: bool = True
    seed: int = 0
    enforce_eager: bool = False
    load_format: str = "auto"              # auto | dummy (random weights) | simulate (no model math)
    quantization: str = "auto"             # auto | gguf | none
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1        # > 1: not supported
    data_parallel_size: int = 1            # > 1: not supported
    distributed_executor_backend: Optional[str] = None   # mp | ray | uni; None: uni at size 1
    kv_eviction_policy: str = "none"
    kv_eviction_ratio: float = 0.5
    kv_budget_tokens: Optional[int] = None
    kv_min_tokens: Optional[int] = None    # None: KVEvictionConfig.floor decides
    kv_prefill_chunk: Optional[int] = None
    kv_evict_scope: str = "all"
    kv_evict_interval: int = 1
    kv_sink_tokens: Optional[int] = None
    kv_recent_fraction: float = 0.5
    kv_reclamation: str = "vtoken"
    kv_frag_threshold: float = 0.25
    kv_check_invariants: bool = False
    kv_eviction_log: bool = False          # keep Sequence.eviction_log (debugging, tests)
    kv_reclaim_force_sync: bool = False
    disable_log_stats: bool = False        # upstream's flag; this engine logs no periodic stats

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size,
                              self.data_parallel_size, self.distributed_executor_backend)

    def eviction_config(self) -> KVEvictionConfig:
        return KVEvictionConfig(**{dst: getattr(self, src) for src, dst in _KV_FIELDS.items()})

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, model_positional: bool = False):
        add = parser.add_argument
        if not model_positional:
            add("--model", type=str, default=None,
                help="local HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
        add("--tokenizer", type=str, default=None)
        add("--device", type=str, default="auto", choices=list(DEVICES),
            help="auto: cuda when torch sees a GPU, else cpu")
        add("--dtype", type=str, default="auto",
            choices=["auto", "float32", "bfloat16", "float16"],
            help="auto: bfloat16 on CUDA, float32 on CPU (a bf16 checkpoint keeps its GEMM "
                 "weights in bf16 in the batch bands where that is faster); bfloat16 on CPU: "
                 "GEMM weights in bf16, activations float32, KV cache bf16 (--kv-cache-dtype "
                 "auto)")
        add("--block-size", type=int, default=16)
        add("--max-model-len", type=int, default=None)
        add("--max-num-seqs", type=int, default=256)
        add("--max-num-batched-tokens", type=int, default=None)
        add("--num-gpu-blocks-override", type=int, default=None,
            help="fixed KV block budget")
        add("--kv-cache-memory", type=int, default=None,
            help="CPU: KV cache size in bytes (default a fifth of free RAM, at most 2 GiB)")
        add("--gpu-memory-utilization", type=float, default=0.9,
            help="CUDA: share of the GPU's memory for weights, activations and the KV cache; "
                 "the KV pool gets what a profiling forward leaves of it")
        add("--kv-cache-dtype", type=str, default="auto", choices=list(KV_CACHE_DTYPES),
            help="KV cache storage: auto = the model's precision (CPU: bfloat16 for a GGUF or "
                 "bf16 model, float32 under --quantization none / --dtype float32; CUDA: the "
                 "model's dtype); float32 stores four bytes per value; bfloat16 two (CPU: 2x "
                 "the tokens of float32; CUDA: a bf16 model's own cache); fp8 "
                 "(= fp8_e4m3) or fp8_e5m2 store one byte per value (4x the tokens of "
                 "float32, 2x those of bf16, in the same memory; CPU, and CUDA from sm_80 "
                 "(e4m3 from sm_89))")
        add("--calculate-kv-scales", action="store_true",
            help="fp8 KV cache: each layer's K and V scales from its first write (the first "
                 "prefill's amax, with 2x headroom) instead of 1.0")
        add("--disable-hybrid-kv-cache-manager", action="store_true",
            help="a model with sliding-window and full-attention layers (Gemma 3): keep every "
                 "layer's KV at full size in one group instead of giving the sliding layers "
                 "window-sized block tables of their own")
        add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False)
        add("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
        add("--seed", type=int, default=0)
        add("--enforce-eager", action="store_true")
        add("--load-format", type=str, default="auto", choices=["auto", "dummy", "simulate"],
            help="dummy: seeded random weights from the model directory's config.json alone; "
                 "simulate: skip model math and emit seeded synthetic attention statistics")
        add("--quantization", "-q", type=str, default="auto", choices=list(QUANTIZATION_METHODS),
            help="gguf: keep a .gguf model's GEMM weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, "
                 "Q6_K) in their blocks and multiply them natively on the CPU (other types, GPUs "
                 "and tensor parallelism: dequantized float32); none: dequantize everything to "
                 "float32; auto (the default): gguf for a .gguf model, with the float32 weights "
                 "kept too for the batch sizes where they are faster on this CPU (timed at load)")
        add("--tensor-parallel-size", "-tp", type=int, default=1,
            help="ranks that shard every layer (heads and MLP columns) and the KV pool")
        add("--pipeline-parallel-size", "-pp", type=int, default=1, help="not supported: 1")
        add("--data-parallel-size", "-dp", type=int, default=1, help="not supported: 1")
        add("--distributed-executor-backend", type=str, default=None,
            choices=list(DISTRIBUTED_BACKENDS),
            help="how ranks run: uni (in this process; the default at size 1), mp (one "
                 "process per rank on this node; the default above size 1) or ray (ranks as Ray "
                 "actors, across nodes)")
        add("--kv-eviction-policy", type=str, default="none", choices=list(EVICTION_POLICIES))
        add("--kv-eviction-ratio", type=float, default=0.5,
            help="fraction of tokens evicted (budget = floor((1 - r) * length))")
        add("--kv-budget-tokens", type=int, default=None, help="fixed per-request token budget")
        add("--kv-min-tokens", type=int, default=None,
            help="floor under every budget: a request never holds fewer live tokens because of "
                 f"eviction. Unnamed: {DEFAULT_MIN_TOKENS} under a ratio budget (short contexts "
                 "are left alone) and none under a budget a flag or request names; 0 reproduces "
                 "the paper's setups")
        add("--kv-prefill-chunk", type=int, default=None,
            help="evict while a long prompt streams in: run the policy after every N prompt "
                 "tokens, so a prompt never holds more than budget + N (default: once, at the "
                 "prompt's end)")
        add("--kv-evict-scope", type=str, default="all", choices=list(EVICTION_SCOPES),
            help="all: any token may be evicted and budgets count every token; generated: the "
                 "prompt is never evicted, budgets and ratios count generated tokens (a request "
                 "holds its prompt plus at most the budget), and every policy takes "
                 "prefix-cache hits on the prompt")
        add("--kv-evict-interval", type=int, default=1,
            help="evict in batches: a request evicts once its live (counted) tokens reach "
                 "budget + N, back down to the budget, so policies and repacking run once per N "
                 "tokens")
        add("--kv-sink-tokens", type=int, default=None)
        add("--kv-recent-fraction", type=float, default=0.5)
        add("--kv-reclamation", type=str, default="vtoken", choices=list(RECLAMATION_MODES),
            help="vtoken: repack partially live blocks; vtoken-fill: also write new tokens into "
                 "dead slots first; none: Naive-Evict")
        add("--kv-frag-threshold", type=float, default=0.25)
        add("--kv-check-invariants", action="store_true")
        add("--kv-eviction-log", action="store_true",
            help="debugging: keep every evicted token id per request (memory grows with length)")
        add("--kv-reclaim-force-sync", action="store_true",
            help="ablation: wait for every relocation copy instead of polling its event")
        add("--disable-log-stats", action="store_true",
            help="accepted for upstream compatibility (this engine logs no periodic stats)")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)})


@dataclass
class AsyncEngineArgs(EngineArgs):
    """EngineArgs plus the options of the serving engine (AsyncLLMEngine), as upstream."""
    enable_log_requests: bool = False      # log each request's arrival, abort and failure
    disable_log_requests: InitVar[Optional[bool]] = None   # upstream's older, inverted name

    def __post_init__(self, disable_log_requests: Optional[bool]):
        if disable_log_requests is not None:
            self.enable_log_requests = not disable_log_requests

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, model_positional: bool = False):
        EngineArgs.add_cli_args(parser, model_positional)
        parser.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction,
                            default=False, help="log each request's arrival and end")
        parser.add_argument("--disable-log-requests", dest="enable_log_requests",
                            action="store_false", help=argparse.SUPPRESS)  # upstream's older flag
        return parser
