"""EngineArgs: the engine's options with upstream vLLM's flag names, each defined once.

A field's `flag(...)` metadata (help, choices, short alias, per-request name) is the only
definition of an option: the CLI (`add_cli_args`), `LLM(**kwargs)` and `AsyncEngineArgs(...)`
keywords (the dataclass itself), the OpenAI request body's kv_* fields and KVEvictionParams
(`request_flags()`), and the docs' flag reference (docs/flags.md, generated from the parser by
vllm/entrypoints/flag_reference.py) all read it.
"""
import argparse
import dataclasses
import typing
from dataclasses import InitVar, dataclass
from typing import Any, Callable, List, Optional, Sequence, Union

from vllm.config import (DEFAULT_MIN_TOKENS, DEVICES, DISTRIBUTED_BACKENDS, DTYPES,
                         EVICTION_SCOPES, KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATION_METHODS,
                         RECLAMATION_MODES, KVEvictionConfig, ParallelConfig)
from vllm.core.eviction import check_policy_name, policy_names


def flag(default: Any, help: str = "", *, choices: Union[Sequence[str], Callable, None] = None,
         short: Optional[str] = None, negatable: bool = False, kv: Optional[str] = None,
         per_request: bool = False) -> Any:
    """A field that is also a CLI flag (--field-name). choices: a sequence, or a callable
    returning one (read when the parser is built); short: an alias such as "-tp"; negatable:
    a bool flag with a --no- form; kv: the KVEvictionConfig field it sets; per_request: a request
    may set it too (OpenAI body field = the field's name; KVEvictionParams field = kv)."""
    assert not per_request or kv, "a per-request flag names its KVEvictionConfig field"
    return dataclasses.field(default=default, metadata=dict(
        help=help, choices=choices, short=short, negatable=negatable, kv=kv,
        per_request=per_request))


def flag_type(field: dataclasses.Field) -> type:
    """int for Optional[int], and so on."""
    args = [a for a in typing.get_args(field.type) if a is not type(None)]
    return args[0] if args else field.type


@dataclass
class EngineArgs:
    model: Optional[str] = flag(
        None, "local HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    tokenizer: Optional[str] = flag(None, "tokenizer directory (default: the model's)")
    device: str = flag("auto", "auto: cuda when torch sees a GPU, else cpu", choices=DEVICES)
    dtype: str = flag(
        "auto", "auto: bfloat16 on CUDA, float32 on CPU (a bf16 checkpoint keeps its GEMM "
        "weights in bf16 in the batch bands where that is faster); bfloat16 on CPU: GEMM weights "
        "in bf16, activations float32, KV cache bf16 (--kv-cache-dtype auto)",
        choices=("auto", *DTYPES))
    block_size: int = flag(16, "tokens per KV block")
    max_model_len: Optional[int] = flag(
        None, "longest prompt + output in tokens (default: the model's context length)")
    max_num_seqs: int = flag(256, "most requests in one step")
    max_num_batched_tokens: Optional[int] = flag(
        None, "most tokens in one step (default: 2048, or --max-model-len without chunked "
        "prefill)")
    num_gpu_blocks_override: Optional[int] = flag(None, "fixed KV block budget")
    kv_cache_memory: Optional[int] = flag(
        None, "CPU: KV cache size in bytes (default a fifth of free RAM, at most 2 GiB)")
    gpu_memory_utilization: float = flag(
        0.9, "CUDA: share of the GPU's memory for weights, activations and the KV cache; the KV "
        "pool gets what a profiling forward leaves of it")
    enable_prefix_caching: bool = flag(
        False, "reuse the KV blocks of a prompt prefix another request computed", negatable=True)
    kv_cache_dtype: str = flag(
        "auto", "KV cache storage: auto = the model's precision (CPU: bfloat16 for a GGUF or bf16 "
        "model, float32 under --quantization none / --dtype float32; CUDA: the model's dtype); "
        "float32 stores four bytes per value; bfloat16 two (CPU: 2x the tokens of float32; "
        "CUDA: a bf16 model's own cache); fp8 (= fp8_e4m3) or fp8_e5m2 store one byte per value "
        "(4x the tokens of float32, 2x those of bf16, in the same memory; CPU, and CUDA from "
        "sm_80 (e4m3 from sm_89))", choices=KV_CACHE_DTYPES)
    calculate_kv_scales: bool = flag(
        False, "fp8 KV cache: each layer's K and V scales from its first write (the first "
        "prefill's amax, with 2x headroom) instead of 1.0")
    disable_hybrid_kv_cache_manager: bool = flag(
        False, "a model with sliding-window and full-attention layers (Gemma 3): keep every "
        "layer's KV at full size in one group instead of giving the sliding layers window-sized "
        "block tables of their own")
    enable_chunked_prefill: bool = flag(
        True, "split long prompts across steps, batched with decodes", negatable=True)
    seed: int = flag(0, "seed of sampling and of the random eviction policies", kv="seed")
    enforce_eager: bool = flag(False, "CUDA: capture no CUDA graphs (every decode step runs "
                               "eagerly); the CPU is always eager")
    load_format: str = flag(
        "auto", "dummy: seeded random weights from the model directory's config.json alone; "
        "simulate: skip model math and emit seeded synthetic attention statistics",
        choices=LOAD_FORMATS)
    quantization: str = flag(
        "auto", "gguf: keep a .gguf model's GEMM weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, "
        "Q6_K) in their blocks and multiply them natively on the CPU (other types, GPUs and "
        "tensor parallelism: dequantized float32); none: dequantize everything to float32; auto "
        "(the default): gguf for a .gguf model, with the float32 weights kept too for the batch "
        "sizes where they are faster on this CPU (timed at load, cached with the CPU kernel "
        "plan), when they fit in half the available memory",
        choices=QUANTIZATION_METHODS, short="-q")
    tensor_parallel_size: int = flag(
        1, "ranks that shard every layer (heads and MLP columns) and the KV pool", short="-tp")
    pipeline_parallel_size: int = flag(1, "not supported: 1", short="-pp")
    data_parallel_size: int = flag(1, "not supported: 1", short="-dp")
    distributed_executor_backend: Optional[str] = flag(
        None, "how ranks run: uni (in this process; the default at size 1), mp (one process per "
        "rank on this node; the default above size 1) or ray (ranks as Ray actors, across nodes)",
        choices=DISTRIBUTED_BACKENDS)
    kv_eviction_policy: str = flag(
        "none", "token-level KV eviction policy (none: no eviction)", choices=policy_names,
        kv="policy", per_request=True)
    kv_eviction_ratio: float = flag(
        0.5, "fraction of tokens evicted (budget = floor((1 - r) * length))",
        kv="eviction_ratio", per_request=True)
    kv_budget_tokens: Optional[int] = flag(
        None, "fixed per-request token budget instead of the ratio", kv="budget_tokens",
        per_request=True)
    kv_min_tokens: Optional[int] = flag(
        None, "floor under every budget: a request never holds fewer live tokens because of "
        f"eviction. Unnamed: {DEFAULT_MIN_TOKENS} under a ratio budget (short contexts are left "
        "alone) and none under a budget a flag or request names; 0 reproduces the paper's "
        "setups", kv="min_tokens", per_request=True)
    kv_prefill_chunk: Optional[int] = flag(
        None, "evict while a long prompt streams in: run the policy after every N prompt tokens, "
        "so a prompt never holds more than budget + N (default: once, at the prompt's end)",
        kv="prefill_chunk", per_request=True)
    kv_evict_scope: str = flag(
        "all", "all: any token may be evicted and budgets count every token; generated: the "
        "prompt is never evicted, budgets and ratios count generated tokens (a request holds its "
        "prompt plus at most the budget), and every policy takes prefix-cache hits on the prompt",
        choices=EVICTION_SCOPES, kv="scope", per_request=True)
    kv_evict_interval: int = flag(
        1, "evict in batches: a request evicts once its live (counted) tokens reach budget + N, "
        "back down to the budget, so policies and repacking run once per N tokens",
        kv="interval", per_request=True)
    kv_sink_tokens: Optional[int] = flag(
        None, "leading tokens no policy evicts (default: 4 for streamingllm, else 0)",
        kv="sink_tokens")
    kv_recent_fraction: float = flag(
        0.5, "H2O: share of the budget kept as the recent window", kv="recent_fraction")
    kv_reclamation: str = flag(
        "vtoken", "vtoken: repack partially live blocks; vtoken-fill: also write new tokens into "
        "dead slots first; none: Naive-Evict", choices=RECLAMATION_MODES, kv="reclamation")
    kv_frag_threshold: float = flag(
        0.25, "dead share of a request's private slots that makes it eligible for repacking",
        kv="frag_threshold")
    kv_check_invariants: bool = flag(
        False, "debugging: check the token tables and block accounting after every step",
        kv="check_invariants")
    kv_eviction_log: bool = flag(
        False, "debugging: keep every evicted token id per request (memory grows with length)",
        kv="keep_eviction_log")
    kv_reclaim_force_sync: bool = flag(
        False, "ablation: wait for every relocation copy instead of polling its event",
        kv="reclaim_force_sync")
    enable_sleep_mode: bool = flag(
        False, "serve sleep mode: LLM.sleep(level) / POST /sleep?level=1|2 release the KV cache "
        "(2: the weights too), LLM.wake_up() / POST /wake_up restore them, GET /is_sleeping")
    disable_log_stats: bool = flag(
        False, "accepted for upstream compatibility (this engine logs no periodic stats)")

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size,
                              self.data_parallel_size, self.distributed_executor_backend)

    def eviction_config(self) -> KVEvictionConfig:
        check_policy_name(self.kv_eviction_policy)
        return KVEvictionConfig(**{f.metadata["kv"]: getattr(self, f.name)
                                   for f in dataclasses.fields(EngineArgs) if f.metadata["kv"]})

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, model_positional: bool = False):
        """One flag per field of `cls` (model_positional: `vllm serve MODEL` names the model and
        adds its own --model)."""
        for field in dataclasses.fields(cls):
            if field.metadata and not (model_positional and field.name == "model"):
                _add_flag(parser, field)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)})


def _add_flag(parser: argparse.ArgumentParser, field: dataclasses.Field) -> None:
    meta = field.metadata
    names = [f"--{field.name.replace('_', '-')}"] + ([meta["short"]] if meta["short"] else [])
    kwargs = dict(default=field.default, help=meta["help"])
    kind = flag_type(field)
    if kind is bool:
        kwargs["action"] = (argparse.BooleanOptionalAction if meta["negatable"]
                            else "store_true")
    else:
        kwargs["type"] = kind
        choices = meta["choices"]
        if choices is not None:
            kwargs["choices"] = list(choices() if callable(choices) else choices)
    parser.add_argument(*names, **kwargs)


def request_flags() -> List[dataclasses.Field]:
    """The flags a request may set too, in definition order."""
    return [f for f in dataclasses.fields(EngineArgs) if f.metadata["per_request"]]


@dataclass
class AsyncEngineArgs(EngineArgs):
    """EngineArgs plus the options of the serving engine (AsyncLLMEngine), as upstream."""
    enable_log_requests: bool = flag(False, "log each request's arrival and end", negatable=True)
    disable_log_requests: InitVar[Optional[bool]] = None   # upstream's older, inverted name

    def __post_init__(self, disable_log_requests: Optional[bool]):
        if disable_log_requests is not None:
            self.enable_log_requests = not disable_log_requests

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, model_positional: bool = False):
        super().add_cli_args(parser, model_positional)
        parser.add_argument("--disable-log-requests", dest="enable_log_requests",
                            action="store_false", help=argparse.SUPPRESS)  # upstream's older flag
        return parser
