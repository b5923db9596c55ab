"""LLMEngine: add requests, step the scheduler + model + sampler, return RequestOutputs."""
import os
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Union

import torch
from transformers import AutoConfig, AutoTokenizer

from vllm.config import CacheConfig, ModelConfig, SchedulerConfig
from vllm.core.block_manager import BlockManager
from vllm.core.kv_monitor import KVMonitor
from vllm.core.eviction_driver import EvictionDriver
from vllm.core.reclaim.admission import HeadroomAdmission
from vllm.core.reclaim.backend import ReclamationBackend
from vllm.core.reclaim.hole_filler import HoleFiller
from vllm.core.scheduler import Scheduler
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.stop_checker import StopChecker
from vllm.model_executor.gguf_loader import resolve_model
from vllm.model_executor.model_loader import DTYPES, get_model
from vllm.model_executor.sampler import Sampler, SamplingRow, compute_prompt_logprobs
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.sequence import Sequence, SequenceStatus
from vllm.worker.model_runner import ModelRunner, StepRow
from vllm.worker.relocation import RelocationExecutor

PromptType = Union[str, Dict, List[int]]


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
        model_dir = resolve_model(args.model)
        self.tokenizer = self._load_tokenizer(args.tokenizer or model_dir, args.load_format)
        hf_config = AutoConfig.from_pretrained(model_dir)
        self.hf_config = hf_config
        max_len = args.max_model_len or getattr(hf_config, "max_position_embeddings", 2048)
        self.model_config = ModelConfig(model=model_dir, tokenizer=args.tokenizer or model_dir,
                                        dtype="float32" if args.dtype == "auto" else args.dtype,
                                        max_model_len=max_len, seed=args.seed,
                                        enforce_eager=args.enforce_eager)
        self.cache_config = CacheConfig(args.block_size, args.num_gpu_blocks_override,
                                        args.kv_cache_memory, args.enable_prefix_caching)
        self.scheduler_config = SchedulerConfig(
            args.max_num_seqs, args.max_num_batched_tokens or max(2048, args.max_num_seqs),
            max_len, args.enable_chunked_prefill)
        self.kv_config = args.eviction_config()
        torch.manual_seed(args.seed)
        self.simulated = args.load_format == "simulate"
        if self.simulated:   # no model math: the KV plane (scheduler, tables, policies) runs for real
            from vllm.model_executor.models.simulated import SimulatedModel
            self.model = SimulatedModel(hf_config, args.seed)
        else:
            self.model = get_model(model_dir, hf_config, self.model_config.dtype, max_len)
        num_blocks = self._num_kv_blocks()
        cfg = self.model.config
        shape = (1, num_blocks * args.block_size, 2, 1, 1) if self.simulated else \
            (cfg.num_hidden_layers, num_blocks * args.block_size, 2, cfg.num_key_value_heads,
             cfg.head_dim)
        self.kv_caches = torch.zeros(shape, dtype=DTYPES[self.model_config.dtype])
        self.block_manager = BlockManager(num_blocks, args.block_size, args.enable_prefix_caching)
        headroom = HeadroomAdmission(self.kv_config).reserve()
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager, headroom)
        self.runner = ModelRunner(self.model, self.kv_caches, self.block_manager.token_table,
                                  self.scheduler_config.max_num_batched_tokens,
                                  self.scheduler_config.max_num_seqs, max_len)
        self.kv_monitor = KVMonitor(self.block_manager)
        self.sampler = Sampler()
        self.stop_checker = StopChecker(self.tokenizer, max_len)
        self.requests: Dict[str, RequestState] = {}
        self.eviction = None
        self.reclaimer = None
        if self.kv_config.enabled:
            self.eviction = EvictionDriver(self.kv_config, self.block_manager,
                                           cfg.num_hidden_layers * cfg.num_attention_heads)
        if self.kv_config.reclaims:
            self.set_relocation_executor(
                RelocationExecutor(self.kv_caches, force_sync=self.kv_config.reclaim_force_sync))

    def set_relocation_executor(self, executor) -> None:
        """Install the copy executor (tests install one whose completion is delayed)."""
        assert self.kv_config.reclaims and not self.requests, "set the executor before requests"
        if self.reclaimer is not None:
            self.block_manager.before_free.remove(self.reclaimer.before_free)
        self.reclaimer = ReclamationBackend(self.kv_config, self.block_manager, executor,
                                            self.kv_config.check_invariants)
        self.eviction.busy_blocks = self.reclaimer.busy_blocks
        if self.kv_config.fills_holes:
            self.block_manager.hole_filler = HoleFiller(self.block_manager)
            self.block_manager.hole_filler.busy_blocks = self.reclaimer.busy_blocks

    @staticmethod
    def _load_tokenizer(path: str, load_format: str):
        try:
            return AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):
            if load_format == "simulate":
                return None            # simulated runs take prompt token ids only
            raise

    # ---- sizing -------------------------------------------------------------------------------
    def block_bytes(self) -> int:
        cfg = self.model.config
        elem = torch.finfo(DTYPES[self.model_config.dtype]).bits // 8
        return (cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * elem
                * self.cache_config.block_size)

    def _num_kv_blocks(self) -> int:
        cc = self.cache_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        budget = cc.kv_cache_memory
        if budget is None:   # a fifth of available RAM, at most 2 GiB
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            budget = min(avail // 5, 2 << 30)
        blocks = budget // self.block_bytes()
        if blocks < 1:
            raise ValueError(f"--kv-cache-memory: {budget} bytes hold no KV block "
                             f"({self.block_bytes()} bytes each)")
        return int(blocks)

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
                    stream: bool = False) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        self._validate_prompt(ids)
        seqs = [Sequence(request_id if params.n == 1 else f"{request_id}#{i}", request_id, i,
                         text, ids, params, self._eos_token_id(), arrival_time)
                for i in range(params.n)]
        self.requests[request_id] = RequestState(request_id, text, ids, params, seqs, stream)
        for seq in seqs:
            self.scheduler.add(seq)

    def _eos_token_id(self) -> Optional[int]:
        return self.tokenizer.eos_token_id if self.tokenizer is not None else None

    def _validate_prompt(self, ids: List[int]) -> None:
        if not ids:
            raise ValueError("The prompt cannot be empty")
        vocab = self.model.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"Token id {max(ids) if max(ids) >= vocab else min(ids)} "
                             f"is out of vocabulary (size {vocab})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"The decoder prompt (length {len(ids)}) is longer than the maximum "
                             f"model length of {self.max_model_len}")
        usable = self.block_manager.num_blocks - self.scheduler.headroom_blocks
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

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> List[RequestOutput]:
        sched = self.scheduler.schedule()
        changed = {s.request_id for s in sched.ended}
        if sched.scheduled:
            collect = self.eviction is not None and self.eviction.needs_stats
            inp = self.runner.prepare_inputs(sched.scheduled, collect_stats=collect)
            if self.reclaimer is not None:   # I3: attention waits on completed copies (stream wait)
                self.reclaimer.executor.pre_attention()
            hidden = self.runner.execute(inp)
            self._record_prompt_logprobs(inp.rows, hidden)
            sample_rows = [r for r in inp.rows if r.completes]
            for r in inp.rows:
                r.seq.num_computed_tokens += r.num_new
                self.block_manager.cache_full_blocks(r.seq)
            self._manage_kv(inp.rows, inp.meta)
            if sample_rows:
                self._sample(sample_rows, hidden)
            changed.update(r.seq.request_id for r in sample_rows)
        return self._collect_outputs(changed)

    def _manage_kv(self, rows: List[StepRow], meta) -> None:
        """Eviction, then reclamation, then per-request KV statistics (and invariant checks)."""
        if self.eviction is not None:
            self.eviction.after_step(rows, meta)
        if self.reclaimer is not None:
            self.reclaimer.step(self.scheduler.running)
        self.kv_monitor.after_step(rows, self.scheduler.running)
        if self.kv_config.check_invariants:
            self.check_invariants()

    @torch.inference_mode()
    def _sample(self, rows: List[StepRow], hidden: torch.Tensor) -> None:
        last = torch.tensor([r.start + r.num_new - 1 for r in rows])
        logits = self.model.compute_logits(hidden[last])
        out = self.sampler(logits, [SamplingRow(r.seq.params, r.seq.generator,
                                                r.seq.num_output_tokens, r.seq.eos_token_id,
                                                r.seq.token_ids)
                                    for r in rows])
        now = time.monotonic()
        for r, token, lps in zip(rows, out.token_ids, out.logprobs):
            seq = r.seq
            seq.append_token(token)
            seq.first_token_time = seq.first_token_time or now
            if lps is not None:
                self._decode_logprobs(lps)
                seq.output_logprobs.append(lps)
            status = self.stop_checker.check(seq, stream=self.requests[seq.request_id].stream)
            if status is not None:
                self.kv_monitor.on_finish(seq)
                self.scheduler.finish(seq, status)

    @torch.inference_mode()
    def _record_prompt_logprobs(self, rows: List[StepRow], hidden: torch.Tensor) -> None:
        for r in rows:
            seq, k = r.seq, r.seq.params.prompt_logprobs
            if k is None or seq.prompt_logprobs is not None and \
                    len(seq.prompt_logprobs) >= seq.num_prompt_tokens:
                continue
            c = seq.num_computed_tokens
            seq.prompt_logprobs = seq.prompt_logprobs or [None]
            end = min(c + r.num_new, seq.num_prompt_tokens - 1)   # positions that predict a prompt token
            if end <= c:
                continue
            logits = self.model.compute_logits(hidden[r.start:r.start + end - c])
            lps = compute_prompt_logprobs(logits, seq.prompt_token_ids[c + 1:end + 1], k)
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
        metrics = {"arrival_time": state.arrival_time, "first_token_time": first.first_token_time,
                   "finished_time": time.monotonic() if finished else None,
                   "num_preemptions": sum(s.num_preemptions for s in state.seqs)}
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids,
                             first.prompt_logprobs, completions, finished,
                             dict(first.kv_stats), metrics)

    # ---- KV statistics and invariants ---------------------------------------------------------------------------
    def get_kv_stats(self) -> Dict[str, float]:
        stats = self.kv_monitor.stats()
        stats["translation_rebuilds"] = self.runner.translation.rebuilds
        stats["evicted_tokens"] = self.eviction.evicted_tokens if self.eviction else 0
        stats["preemptions"] = self.scheduler.num_preemptions
        reclaim = self.reclaimer.stats() if self.reclaimer else {}
        filler = self.block_manager.hole_filler
        stats["hole_slots_reused"] = filler.slots_reused if filler else 0
        for key in ("relocation_events", "relocated_tokens", "bytes_moved", "blocks_reclaimed",
                    "planner_time_s", "copy_time_s", "table_rewrite_time_s", "copy_launches",
                    "copy_blocked_s"):
            stats[key] = reclaim.get(key, 0)
        return stats

    def check_invariants(self) -> None:
        """I2 for every running request, plus block accounting (I1 is checked per relocation)."""
        for seq in self.scheduler.running:
            self.block_manager.token_table.check_invariants(seq.seq_id, seq.block_ids)
        self.check_accounting()

    def check_accounting(self) -> None:
        self.block_manager.check_accounting(self.scheduler.running)
        live = {s.seq_id for s in self.scheduler.running}
        tables = set(self.block_manager.token_table.request_ids())
        assert tables == live, f"token tables {sorted(tables - live)} outlive their requests"
