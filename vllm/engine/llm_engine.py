"""LLMEngine: add requests, step the scheduler + model + sampler, return RequestOutputs."""
import logging
import time
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence as Seq, Set, Union

import numpy as np
import torch
from transformers import AutoTokenizer, GenerationConfig

from vllm.attention import kv_quant
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.core.kv_manager import KVManager
from vllm.core.scheduler import Scheduler
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.step_input_builder import StepInputBuilder, StepRow
from vllm.engine.stop_checker import StopChecker
from vllm.executor.executor_base import ExecutorBase
from vllm.kv_eviction_params import KVEvictionParams
from vllm.model_executor.gguf_loader import resolve_model, resolve_quantization
from vllm.model_executor.layers.attention import (ONE_KV_GROUP_ATTR, attention_specs,
                                                  kv_groups, model_window, scores_from)
from vllm.model_executor.model_loader import (BF16_WEIGHTS_ATTR, GGUF_KEEP_FLOAT32_ATTR,
                                              GGUF_QUANT_ATTR, load_hf_config,
                                              resolve_cpu_dtype)
from vllm.model_executor.sampler import (Sampler, SamplerOutput, SamplingRow,
                                         compute_prompt_logprobs)
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.sequence import Sequence, SequenceStatus
from vllm.structured_output import SequenceGrammar, StructuredOutputManager
from vllm.worker.step_input import StepInput
from vllm.worker.step_output import StepOutput

PromptType = Union[str, Dict, List[int]]
logger = logging.getLogger(__name__)


def generation_eos_token_ids(model_dir: str, hf_config=None) -> FrozenSet[int]:
    """The EOS ids of the model's generation config (``eos_token_id``: an int or a list), as
    upstream vLLM reads them: generation_config.json, or without one the model config's
    (``hf_config``); empty when neither sets any."""
    try:
        gen = GenerationConfig.from_pretrained(model_dir)
    except OSError:        # no generation_config.json
        gen = GenerationConfig.from_model_config(hf_config) if hf_config is not None else None
    ids = getattr(gen, "eos_token_id", None)
    if ids is None:
        return frozenset()
    return frozenset([ids] if isinstance(ids, int) else ids)


SLEEP_TAGS = ("weights", "kv_cache")      # what sleep releases and wake_up(tags) restores


class EngineSleepingError(RuntimeError):
    """A request reached an engine whose KV cache (and maybe weights) sleep() released."""


@dataclass
class RequestState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    params: SamplingParams
    seqs: List[Sequence]
    stream: bool
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, args: EngineArgs):
        parallel_config = args.parallel_config()
        executor_class = ExecutorBase.get_class(parallel_config)   # fail fast, before loading
        quantization, quant_file = resolve_quantization(args.model, args.quantization)
        model_dir = resolve_model(args.model)
        self.tokenizer = self._load_tokenizer(args.tokenizer or model_dir, args.load_format)
        hf_config = load_hf_config(model_dir)          # a multimodal model's text config
        self.hf_config = hf_config
        # the model's EOS ids beside the tokenizer's: each ends a request (as upstream)
        self.eos_token_ids = generation_eos_token_ids(model_dir, hf_config)
        if quantization == "gguf":      # get_model reads them on every rank
            setattr(hf_config, GGUF_QUANT_ATTR, quant_file)
            setattr(hf_config, GGUF_KEEP_FLOAT32_ATTR, args.quantization == "auto")
        if args.disable_hybrid_kv_cache_manager:
            setattr(hf_config, ONE_KV_GROUP_ATTR, True)
        max_len = args.max_model_len or getattr(hf_config, "max_position_embeddings", 2048)
        self.simulated = args.load_format == "simulate"
        self.device_config = DeviceConfig(self._device(args))
        self.device = self.device_config.torch_device
        dtype = resolve_cpu_dtype(args.dtype, self.device_config.device, hf_config,
                                  parallel_config.tensor_parallel_size, quantization)
        self.model_config = ModelConfig(model=model_dir, tokenizer=args.tokenizer or model_dir,
                                        dtype=dtype, max_model_len=max_len, seed=args.seed,
                                        enforce_eager=args.enforce_eager,
                                        device=self.device_config.device,
                                        load_format=args.load_format, hf_config=hf_config,
                                        quantization=quantization,
                                        quantization_file=quant_file)
        # --dtype bfloat16 without the bf16 kernels leaves model_config.dtype bfloat16
        low_bit_weights = quantization == "gguf" or hasattr(hf_config, BF16_WEIGHTS_ATTR)
        kv_cache_dtype = kv_quant.resolve(args.kv_cache_dtype, self.device_config.device,
                                          self.model_config.dtype, low_bit_weights)
        self.cache_config = CacheConfig(args.block_size, args.num_gpu_blocks_override,
                                        args.kv_cache_memory, args.enable_prefix_caching,
                                        args.gpu_memory_utilization, kv_cache_dtype,
                                        args.calculate_kv_scales)
        self.scheduler_config = SchedulerConfig(
            args.max_num_seqs, args.max_num_batched_tokens or max(2048, args.max_num_seqs),
            max_len, args.enable_chunked_prefill)
        self.parallel_config = parallel_config
        self.kv_config = args.eviction_config()
        torch.manual_seed(args.seed)     # the engine's sampling draws (workers seed their own)
        self.model_executor = executor_class(VllmConfig(
            self.model_config, self.cache_config, self.scheduler_config, parallel_config,
            self.kv_config))
        num_blocks = self.model_executor.determine_num_kv_blocks()
        self.gpu_memory_profile: Optional[dict] = self.model_executor.gpu_memory_profile
        self.model_executor.initialize_cache(num_blocks)
        self.kv_bytes_per_token = self.block_bytes() // args.block_size
        specs, groups = attention_specs(hf_config), kv_groups(hf_config)
        self.kv = KVManager(num_blocks, args.block_size, args.enable_prefix_caching,
                            self.kv_config, sum(scores_from(specs)) * hf_config.num_attention_heads,
                            (groups.window, groups.num_sliding_groups) if groups.hybrid else None)
        self.scheduler = Scheduler(self.scheduler_config, self.kv)
        self.input_builder = StepInputBuilder(self.kv.token_table, model_window(hf_config),
                                              self.kv.sliding)
        self.sampler = Sampler()
        # compiles nothing (and imports no xgrammar) until a request asks for structured outputs
        self.structured_output = StructuredOutputManager(self.tokenizer, hf_config.vocab_size)
        self.stop_checker = StopChecker(self.tokenizer, max_len)
        self.requests: Dict[str, RequestState] = {}
        # a hybrid model's request also holds its sliding windows' blocks
        window_blocks = self.kv.sliding.num_groups * self.kv.sliding.max_blocks_per_request() \
            if self.kv.sliding else 0
        self._warn_if_pool_short(max(num_blocks - window_blocks, 0) * args.block_size)
        # upstream's flag: sleep() and wake_up() refuse without it
        self.enable_sleep_mode = args.enable_sleep_mode
        self.released: Set[str] = set()       # SLEEP_TAGS that sleep() released

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        return cls(engine_args)

    @staticmethod
    def _device(args: EngineArgs) -> str:
        """The simulated model has no model math to place: it runs on the CPU (auto picks it)."""
        if args.load_format != "simulate" or args.device == "cpu":
            return args.device
        if args.device == "cuda":
            raise ValueError("--device cuda: --load-format simulate runs on the CPU only "
                             "(it has no model math); use --device cpu or auto")
        return "cpu"

    def _warn_if_pool_short(self, pool_tokens: int) -> None:
        if self.max_model_len <= pool_tokens:
            return
        logger.warning(
            "--max-model-len %d exceeds the KV pool (%d tokens): a request that grows past the "
            "pool is finished with finish_reason %r%s", self.max_model_len, pool_tokens,
            SequenceStatus.FINISHED_KV_EXHAUSTED.value,
            "" if self.kv_config.enabled else " (no default eviction policy bounds it)")

    def shutdown(self) -> None:
        """Stop the executor's workers (tensor-parallel ranks); the engine cannot step after."""
        self.model_executor.shutdown()

    def check_health(self) -> None:
        """Raises if the engine cannot step any more (e.g. WorkerFailed: a tensor-parallel
        worker failed or exited); upstream's name."""
        self.model_executor.check_health()

    def set_relocation_executor(self, executor) -> None:
        """Install the copy executor (tests install one whose completion is delayed)."""
        assert self.kv_config.reclaims and not self.requests, "set the executor before requests"
        self.model_executor.set_relocation_executor(executor)

    # ---- single process: rank 0's worker, for tests and benchmarks ----------------------------
    @property
    def worker(self):
        return self.model_executor.driver_worker

    @property
    def model(self) -> torch.nn.Module:
        return self.worker.model

    @property
    def kv_caches(self) -> torch.Tensor:
        return self.worker.kv_caches

    @property
    def runner(self):
        return self.worker.model_runner

    @staticmethod
    def _load_tokenizer(path: str, load_format: str):
        try:
            return AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):
            if load_format in ("simulate", "dummy"):
                return None            # a config-only model takes prompt token ids only
            raise

    # ---- sizing -------------------------------------------------------------------------------
    def block_bytes(self) -> int:
        return self.worker.block_bytes()

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    # ---- requests -----------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType):
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def add_request(self, request_id: str, prompt: PromptType,
                    params: Optional[SamplingParams] = None, arrival_time: Optional[float] = None,
                    stream: bool = False,
                    kv_eviction: Optional[KVEvictionParams] = None) -> None:
        """kv_eviction: this request's eviction settings over the engine's --kv-* defaults."""
        params = params or SamplingParams()
        if self.released:
            raise EngineSleepingError("the engine is sleeping (its KV cache is released): "
                                      "wake_up() first")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        self._validate_prompt(ids)
        self._validate_allowed_tokens(params)
        grammars = self._new_grammars(params)     # compiles (cached) or raises: no state yet
        kv_config = kv_eviction.apply(self.kv_config) if kv_eviction is not None else None
        seqs = [Sequence(request_id if params.n == 1 else f"{request_id}#{i}", request_id, i,
                         text, ids, params, self._eos_token_id(), arrival_time,
                         self.eos_token_ids)
                for i in range(params.n)]
        for seq, grammar in zip(seqs, grammars):
            seq.grammar = grammar
            if seq.generator is not None and self.device.type != "cpu":
                # seeded draws happen on the logits' device, from a generator there
                seq.generator = torch.Generator(self.device).manual_seed(params.seed + seq.index)
        self.requests[request_id] = RequestState(request_id, text, ids, params, seqs, stream)
        for seq in seqs:
            self.kv.add_request(seq.seq_id, kv_config)   # its KV state, until it is dropped
            self.scheduler.add(seq)

    def _validate_allowed_tokens(self, params: SamplingParams) -> None:
        vocab = self.hf_config.vocab_size
        bad = [t for t in params.allowed_token_ids or () if t >= vocab]
        if bad:   # upstream: "allowed_token_ids contains out-of-vocab token id!"
            raise ValueError(f"allowed_token_ids contains out-of-vocab token id {bad[0]} "
                             f"(out of vocabulary of size {vocab})")

    def _new_grammars(self, params: SamplingParams) -> List[Optional[SequenceGrammar]]:
        """One grammar state per sample, so that n > 1 samples follow it independently."""
        if params.structured_outputs is None:
            return [None] * params.n
        return [self.structured_output.new_grammar(params.structured_outputs)
                for _ in range(params.n)]

    def _eos_token_id(self) -> Optional[int]:
        return self.tokenizer.eos_token_id if self.tokenizer is not None else None

    def _validate_prompt(self, ids: List[int]) -> None:
        if not ids:
            raise ValueError("The decoder prompt cannot be empty")   # upstream's wording
        vocab = self.hf_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"Token id {max(ids) if max(ids) >= vocab else min(ids)} "
                             f"is out of vocabulary (size {vocab})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"The decoder prompt (length {len(ids)}) is longer than the maximum "
                             f"model length of {self.max_model_len}")
        usable = self.kv.num_blocks
        needed = -(-len(ids) // self.cache_config.block_size)
        if needed > usable:
            raise ValueError(f"The prompt (length {len(ids)}) needs {needed} KV blocks but only "
                             f"{usable} exist (--num-gpu-blocks-override / --kv-cache-memory)")

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            state = self.requests.pop(rid, None)
            if state is not None:
                self.scheduler.abort([s.seq_id for s in state.seqs])
                for seq in state.seqs:
                    self.kv.drop_request(seq.seq_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- sleep mode (upstream's) ----------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Level 1 releases the KV pool on every rank (its content is lost, the prefix cache
        with it); level 2 the model's weights too. No request may be in flight: the caller
        aborts them or waits for them (the server's mode=abort / wait)."""
        self.check_sleep(level)
        if self.requests:
            raise ValueError(f"cannot sleep with {len(self.requests)} requests in flight: "
                             f"abort them or wait for them to finish")
        pool = self.kv.bm.pool
        for block in np.flatnonzero(pool.hashed):      # their KV is about to be gone
            pool.uncache(int(block))
        self.input_builder.forget_views()              # the workers' views go with the pool
        self.model_executor.sleep(level)
        self.released |= set(SLEEP_TAGS if level == 2 else ("kv_cache",))

    def wake_up(self, tags: Optional[Seq[str]] = None) -> None:
        """Restore what sleep() released (tags: "weights", "kv_cache"; None: both): the weights
        loaded again as the first time, the pool at its size with every block free. The
        weights come back before (or with) the KV cache."""
        self._require_sleep_mode()
        tags = set(SLEEP_TAGS if tags is None else tags)
        unknown = tags - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"tags: {sorted(unknown)}; wake_up restores {list(SLEEP_TAGS)}")
        if "kv_cache" in tags and "weights" in self.released - tags:
            raise ValueError("tags: the KV cache comes back with or after the weights "
                             "(wake_up(['weights']) first)")
        restore = tags & self.released
        if restore:
            self.model_executor.wake_up(self.kv.num_blocks, tuple(sorted(restore)))
            self.released -= restore

    def is_sleeping(self) -> bool:
        return bool(self.released)

    def check_sleep(self, level: int) -> None:
        """Raises ValueError unless sleep(level) may run: sleep mode is on, the level is one
        (requests in flight are sleep()'s own check)."""
        self._require_sleep_mode()
        if level not in (1, 2):
            raise ValueError(f"level: {level} is not a sleep level (1: release the KV cache, "
                             f"2: the KV cache and the weights)")

    def _require_sleep_mode(self) -> None:
        if not self.enable_sleep_mode:   # upstream's wording
            raise ValueError("Sleep mode is not enabled in the model config "
                             "(enable_sleep_mode=True, --enable-sleep-mode)")

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> List[RequestOutput]:
        sched = self.scheduler.schedule()
        changed = {s.request_id for s in sched.ended}
        scores = self.kv.score_request(sched.scheduled) if sched.scheduled else None
        step, rows = self.input_builder.build(sched.scheduled, scores, sched.copies)
        out = self._execute(step)
        if self.kv_config.check_invariants and rows:   # every rank's views, every step
            self.model_executor.check_invariants(self.input_builder.translation.snapshot())
        # copies completed this step: their moves apply now, so the next step's views read the
        # destinations (this step's read the sources, which were still valid)
        self.kv.copies_done(set(out.completed_copies))
        if rows:
            self._record_prompt_logprobs(rows, out.prompt_logits)
            sample_rows = [r for r in rows if r.completes]
            sampled = self._sample(sample_rows, out.logits) if sample_rows else None
            for r in rows:
                r.seq.num_computed_tokens += r.num_new
            self.kv.after_step(self.input_builder.step_stats(rows, out))
            if sample_rows:
                self._append_tokens(sample_rows, sampled)
            changed.update(r.seq.request_id for r in sample_rows)
        return self._collect_outputs(changed)

    def _execute(self, step: StepInput) -> StepOutput:
        try:
            return self.model_executor.execute_model(step)
        except BaseException:
            self.input_builder.forget_views()   # the workers may not have applied its deltas
            raise

    @torch.inference_mode()
    def _sample(self, rows: List[StepRow], logits: torch.Tensor) -> SamplerOutput:
        return self.sampler(logits, [SamplingRow(r.seq.params, r.seq.generator,
                                                 r.seq.num_output_tokens, r.seq.eos_token_id,
                                                 r.seq.token_ids, r.seq.grammar,
                                                 r.seq.eos_token_ids)
                                     for r in rows])

    def _append_tokens(self, rows: List[StepRow], out: SamplerOutput) -> None:
        now = time.monotonic()
        for r, token, lps in zip(rows, out.token_ids, out.logprobs):
            seq = r.seq
            seq.append_token(token)
            seq.first_token_time = seq.first_token_time or now
            if lps is not None:
                self._decode_logprobs(lps)
                seq.output_logprobs.append(lps)
            status = self.stop_checker.check(seq, stream=self.requests[seq.request_id].stream)
            if status is None and seq.grammar is not None:
                status = self._advance_grammar(seq, token)
            if status is not None:
                self.scheduler.finish(seq, status)

    @staticmethod
    def _advance_grammar(seq: Sequence, token: int) -> Optional[SequenceStatus]:
        """Feed the sampled token to the sequence's grammar. A terminated grammar (its stop
        token accepted, e.g. EOS under ignore_eos) finishes the sequence as a normal stop."""
        if seq.grammar.accept(token):
            return SequenceStatus.FINISHED_STOPPED if seq.grammar.terminated else None
        # only when masks left no grammar token (e.g. min_tokens or allowed_token_ids against
        # a grammar that allows only EOS): continuing would leave the grammar
        logger.warning("request %s: sampled token %d is outside its grammar (min_tokens or "
                       "allowed_token_ids exclude every token it allows); finishing it",
                       seq.request_id, token)
        return SequenceStatus.FINISHED_STOPPED

    @torch.inference_mode()
    def _record_prompt_logprobs(self, rows: List[StepRow],
                                logits: Optional[torch.Tensor]) -> None:
        """logits: the step's prompt-logit rows (StepRow.prompt_logits says whose are which)."""
        for r in rows:
            seq, k = r.seq, r.seq.params.prompt_logprobs
            if k is None or seq.prompt_logprobs is not None and \
                    len(seq.prompt_logprobs) >= seq.num_prompt_tokens:
                continue
            seq.prompt_logprobs = seq.prompt_logprobs or [None]
            if r.prompt_logits is None:
                continue
            c = seq.num_computed_tokens
            end = c + r.prompt_logits.stop - r.prompt_logits.start
            lps = compute_prompt_logprobs(logits[r.prompt_logits],
                                          seq.prompt_token_ids[c + 1:end + 1], k)
            for d in lps:
                self._decode_logprobs(d)
            seq.prompt_logprobs.extend(lps)

    def _decode_logprobs(self, lps: Dict) -> None:
        for tok, lp in lps.items():
            lp.decoded_token = self.tokenizer.decode([tok])

    # ---- outputs ------------------------------------------------------------------------------
    def _collect_outputs(self, request_ids: Iterable[str]) -> List[RequestOutput]:
        outputs = []
        for rid in request_ids:
            state = self.requests.get(rid)
            if state is None:
                continue
            finished = state.finished
            if not (finished or state.stream):
                continue
            outputs.append(self._make_output(state, finished))
            if finished:
                del self.requests[rid]
                for seq in state.seqs:     # its kv_stats are in the output now
                    self.kv.drop_request(seq.seq_id)
        return outputs

    def _make_output(self, state: RequestState, finished: bool) -> RequestOutput:
        completions = []
        for seq in state.seqs:
            if finished or state.stream:
                self.stop_checker.detokenize(seq)
            cum = None
            if seq.params.logprobs is not None:
                cum = sum(lp[t].logprob for lp, t in zip(seq.output_logprobs,
                                                         seq.output_token_ids))
            completions.append(CompletionOutput(
                seq.index, seq.output_text, list(seq.output_token_ids), cum,
                list(seq.output_logprobs) if seq.params.logprobs is not None else None,
                seq.finish_reason, seq.stop_reason))
        first = state.seqs[0]
        scheduled = [s.first_scheduled_time for s in state.seqs if s.first_scheduled_time]
        metrics = {"arrival_time": state.arrival_time, "first_token_time": first.first_token_time,
                   "first_scheduled_time": min(scheduled) if scheduled else None,
                   "finished_time": time.monotonic() if finished else None,
                   "num_preemptions": sum(s.num_preemptions for s in state.seqs)}
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids,
                             first.prompt_logprobs, completions, finished,
                             self.kv.request_stats(first.seq_id), metrics)

    # ---- KV statistics and invariants ----------------------------------------------------------
    def get_kv_stats(self) -> Dict[str, float]:
        stats = self.kv.stats()
        stats["translation_rebuilds"] = self.input_builder.rebuilds
        stats["preemptions"] = self.scheduler.num_preemptions
        # one token's KV in the pool's group (a hybrid model's full layers; one rank's heads)
        stats["kv_bytes_per_token"] = self.kv_bytes_per_token
        stats.update(self.model_executor.relocation_stats())
        return stats

    def get_engine_info(self) -> Dict:
        """What this engine runs on: the CPU, the C kernels' variant and the load-time kernel
        plan (which GEMM / attention path each batch band uses); logged once at load."""
        return self.model_executor.engine_info()

    def check_invariants(self) -> None:
        """I2, the prefix-cache rule and block accounting (I1 is checked per copy batch), and
        every rank's attention views equal the engine's."""
        self.kv.check_invariants({s.seq_id for st in self.requests.values() for s in st.seqs})
        running = {s.seq_id for s in self.scheduler.running}
        assert running == set(self.kv.seqs), "running sequences and KV holders disagree"
        self.model_executor.check_invariants(self.input_builder.translation.snapshot())
