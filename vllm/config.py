"""Engine configuration: plain dataclasses validated in __post_init__.

Every error message names the CLI flag a user would change.
"""
from dataclasses import dataclass
from typing import Any, Optional

import torch

from vllm.attention.kv_quant import KV_CACHE_DTYPES

EVICTION_SCOPES = ("all", "generated")   # which tokens a policy may evict and a budget counts
DEFAULT_MIN_TOKENS = 512   # the floor under ratio budgets when no --kv-min-tokens is named
RECLAMATION_MODES = ("vtoken", "vtoken-fill", "none")
DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cuda", "cpu")
QUANTIZATION_METHODS = ("auto", "gguf", "none")
LOAD_FORMATS = ("auto", "dummy", "simulate")


def _check(cond: bool, flag: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{flag}: {message}")


@dataclass
class DeviceConfig:
    """--device: "auto" resolves to "cuda" where torch sees a GPU, else "cpu"."""
    device: str = "auto"

    def __post_init__(self):
        _check(self.device in DEVICES, "--device", f"must be one of {DEVICES}, got {self.device!r}")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        _check(self.device != "cuda" or torch.cuda.is_available(), "--device",
               "cuda was asked for but torch sees no GPU (torch.cuda.is_available() is False); "
               "use --device cpu or auto")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


@dataclass
class ModelConfig:
    model: str                      # local HF directory (safetensors or .bin) after resolution
    tokenizer: str
    dtype: str = "auto"             # auto: bfloat16 on CUDA, float32 on CPU
    max_model_len: Optional[int] = None
    seed: int = 0
    enforce_eager: bool = False
    device: str = "cpu"             # resolved (DeviceConfig)
    load_format: str = "auto"       # auto | dummy | simulate
    hf_config: Any = None           # the checkpoint's transformers config
    quantization: str = "none"      # resolved --quantization: gguf (keep the GGUF's blocks) | none
    quantization_file: Optional[str] = None     # gguf: the GGUF file

    def __post_init__(self):
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device == "cuda" else "float32"
        _check(self.dtype in DTYPES, "--dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.max_model_len is None or self.max_model_len > 0, "--max-model-len",
               f"must be positive, got {self.max_model_len}")
        _check(self.load_format in LOAD_FORMATS, "--load-format",
               f"must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        _check(self.quantization in QUANTIZATION_METHODS and self.quantization != "auto",
               "--quantization", f"must be resolved to gguf or none, got {self.quantization!r}")
        _check(self.quantization != "gguf" or self.quantization_file is not None,
               "--quantization", "gguf needs a .gguf --model")


@dataclass
class CacheConfig:
    block_size: int = 16
    num_gpu_blocks_override: Optional[int] = None
    kv_cache_memory: Optional[int] = None     # bytes (CPU); default: a fraction of free RAM
    enable_prefix_caching: bool = False
    gpu_memory_utilization: float = 0.9       # CUDA: share of GPU memory for weights + KV + work
    kv_cache_dtype: str = "auto"              # auto (the model's dtype) | float32 | bfloat16 | fp8..
    calculate_kv_scales: bool = False         # fp8: scales from the first prefill (else 1.0)

    def __post_init__(self):
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "--kv-cache-dtype",
               f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8":
            self.kv_cache_dtype = "fp8_e4m3"
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "--gpu-memory-utilization",
               f"must be in (0, 1], got {self.gpu_memory_utilization}")
        _check(self.block_size > 0, "--block-size", f"must be positive, got {self.block_size}")
        _check(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override > 0,
               "--num-gpu-blocks-override", f"must be positive, got {self.num_gpu_blocks_override}")
        _check(self.kv_cache_memory is None or self.kv_cache_memory > 0, "--kv-cache-memory",
               f"must be positive, got {self.kv_cache_memory}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self):
        _check(self.max_num_seqs > 0, "--max-num-seqs", f"must be positive, got {self.max_num_seqs}")
        _check(self.max_num_batched_tokens > 0, "--max-num-batched-tokens",
               f"must be positive, got {self.max_num_batched_tokens}")
        _check(self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
               "--max-num-batched-tokens",
               f"({self.max_num_batched_tokens}) must be >= --max-model-len "
               f"({self.max_model_len}) when chunked prefill is disabled")


DISTRIBUTED_BACKENDS = ("mp", "ray", "uni")


@dataclass
class ParallelConfig:
    """How many ranks, and which executor runs them (upstream's flags)."""
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: Optional[str] = None   # None: uni at world size 1

    def __post_init__(self):
        for flag, value in (("--tensor-parallel-size", self.tensor_parallel_size),
                            ("--pipeline-parallel-size", self.pipeline_parallel_size),
                            ("--data-parallel-size", self.data_parallel_size)):
            _check(value >= 1, flag, f"must be >= 1, got {value}")
        for flag, value, what in (
                ("--pipeline-parallel-size", self.pipeline_parallel_size, "pipeline"),
                ("--data-parallel-size", self.data_parallel_size, "data")):
            _check(value == 1, flag, f"{what} parallelism is not supported by this engine "
                                     f"(got {value}); use 1")
        backend = self.distributed_executor_backend
        _check(backend is None or backend in DISTRIBUTED_BACKENDS,
               "--distributed-executor-backend",
               f"must be one of {DISTRIBUTED_BACKENDS}, got {backend!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class KVEvictionConfig:
    """Token-level eviction (the policy) and physical reclamation (vToken).

    `policy` is a name of the policy registry (vllm.core.eviction.POLICY_CLASSES) or "none"; the
    engine side checks it where it makes a config (EngineArgs.eviction_config, KVEvictionParams,
    make_policy), since this module is shared with the workers, which never import the
    policies."""
    policy: str = "none"
    eviction_ratio: float = 0.5             # fraction evicted; budget = floor((1 - r) * n)
    budget_tokens: Optional[int] = None     # fixed budget instead of the ratio
    min_tokens: Optional[int] = None        # floor (see `floor`); None: the default floor
    scope: str = "all"                      # all | generated: the prompt is never evicted
    interval: int = 1                       # evict at budget + interval, back down to budget
    prefill_chunk: Optional[int] = None     # evict after every N prompt tokens (None: at its end)
    sink_tokens: Optional[int] = None       # None: policy default (4 for streamingllm, else 0)
    recent_fraction: float = 0.5            # H2O: share of the budget kept as the recent window
    scissorhands_window: int = 400          # w: history of low-attention steps
    scissorhands_recent: int = 10           # r: most recent tokens always kept
    scissorhands_drop: Optional[int] = None  # m: tokens dropped at once (default budget // 2)
    snapkv_window: int = 32                 # last prompt queries that vote
    snapkv_kernel: int = 7                  # max-pool kernel over the votes
    rkv_window: int = 8                     # R-KV: decode steps whose attention is importance
    rkv_lambda: float = 0.1                 # R-KV: weight of importance against redundancy
    value_protect_fraction: float = 0.1     # value-random: budget share kept by largest ||v||
    seed: int = 0
    reclamation: str = "vtoken"
    frag_threshold: float = 0.25            # dead share of private slots that makes a request eligible
    check_invariants: bool = False
    keep_eviction_log: bool = False         # RequestKV.eviction_log: every evicted id (tests)
    reclaim_force_sync: bool = False        # ablation: block on every relocation copy

    def __post_init__(self):
        _check(0.0 <= self.eviction_ratio < 1.0, "--kv-eviction-ratio",
               f"must be in [0, 1), got {self.eviction_ratio}")
        _check(self.budget_tokens is None or self.budget_tokens >= 1, "--kv-budget-tokens",
               f"must be >= 1, got {self.budget_tokens}")
        _check(self.min_tokens is None or self.min_tokens >= 0, "--kv-min-tokens",
               f"must be >= 0, got {self.min_tokens}")
        _check(self.scope in EVICTION_SCOPES, "--kv-evict-scope",
               f"must be one of {EVICTION_SCOPES}, got {self.scope!r}")
        _check(self.interval >= 1, "--kv-evict-interval", f"must be >= 1, got {self.interval}")
        _check(not (self.policy == "snapkv" and self.scope == "generated"), "--kv-evict-scope",
               "snapkv compresses the prompt only, so with scope generated it would never evict; "
               "use scope all, or a policy that evicts while decoding")
        _check(self.prefill_chunk is None or self.prefill_chunk >= 1, "--kv-prefill-chunk",
               f"must be >= 1, got {self.prefill_chunk}")
        _check(self.sink_tokens is None or self.sink_tokens >= 0, "--kv-sink-tokens",
               f"must be >= 0, got {self.sink_tokens}")
        _check(0.0 <= self.recent_fraction <= 1.0, "--kv-recent-fraction",
               f"must be in [0, 1], got {self.recent_fraction}")
        _check(self.reclamation in RECLAMATION_MODES, "--kv-reclamation",
               f"must be one of {RECLAMATION_MODES}, got {self.reclamation!r}")
        _check(0.0 <= self.frag_threshold <= 1.0, "--kv-frag-threshold",
               f"must be in [0, 1], got {self.frag_threshold}")
        _check(self.scissorhands_window >= 1 and self.scissorhands_recent >= 0,
               "--kv-eviction-policy scissorhands", "window must be >= 1 and recent >= 0")
        _check(self.snapkv_window >= 1 and self.snapkv_kernel >= 1 and self.snapkv_kernel % 2 == 1,
               "--kv-eviction-policy snapkv", "window must be >= 1 and kernel a positive odd number")
        _check(self.rkv_window >= 1 and 0.0 <= self.rkv_lambda <= 1.0,
               "--kv-eviction-policy rkv", "window must be >= 1 and lambda in [0, 1]")
        _check(0.0 <= self.value_protect_fraction <= 1.0, "--kv-eviction-policy value-random",
               f"protect fraction must be in [0, 1], got {self.value_protect_fraction}")

    @property
    def enabled(self) -> bool:
        return self.policy != "none"

    @property
    def floor(self) -> int:
        """Live tokens a budget never goes below: --kv-min-tokens when named; else
        DEFAULT_MIN_TOKENS under a ratio budget (short chats are left alone) and 0 under a budget
        the user named (an explicit --kv-budget-tokens / kv_budget_tokens is honoured)."""
        if self.min_tokens is not None:
            return self.min_tokens
        return 0 if self.budget_tokens is not None else DEFAULT_MIN_TOKENS

    @property
    def sinks(self) -> int:
        if self.sink_tokens is not None:
            return self.sink_tokens
        return 4 if self.policy == "streamingllm" else 0

    @property
    def reclaims(self) -> bool:
        """Engine-wide: any request may evict (its own policy), so the mode alone decides."""
        return self.reclamation in ("vtoken", "vtoken-fill")

    @property
    def fills_holes(self) -> bool:
        return self.reclamation == "vtoken-fill"


@dataclass
class VllmConfig:
    """Everything a worker needs to build its part of the engine (picklable: it goes to every
    rank)."""
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    kv_config: KVEvictionConfig
