"""OpenAIServing: what completions and chat share (model check, limits, sampling params,
running several prompts as one request, SSE framing, streaming text deltas)."""
import asyncio
import dataclasses
import json
import logging
import math
from typing import AsyncIterator, Dict, List, Optional, Sequence, Tuple

from fastapi import Request

from vllm.engine.async_llm_engine import AsyncLLMEngine, EngineStepError
from vllm.engine.llm_engine import EngineSleepingError
from vllm.entrypoints.openai.errors import OpenAIError
from vllm.entrypoints.openai.output_constraint import OutputConstraint
from vllm.entrypoints.openai.protocol import (MAX_LOGPROBS, KVUsage, PromptLogprob,
                                              PromptLogprobs, SamplingRequest, UsageInfo,
                                              now_s)
from vllm.entrypoints.openai.server_options import ServerOptions
from vllm.kv_eviction_params import KVEvictionParams
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.sequence import SequenceStatus
from vllm.structured_output import StructuredOutputError

logger = logging.getLogger(__name__)

LOGPROB_FLOOR = -9999.0   # JSON has no -inf


def finite_logprob(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


def sse(payload) -> str:
    body = payload if isinstance(payload, str) else json.dumps(payload, allow_nan=False)
    return f"data: {body}\n\n"


def usage_chunk(request_id: str, object_name: str, model: str, usage: UsageInfo) -> str:
    """The closing chunk of a stream with stream_options.include_usage: no choices, the usage."""
    return sse({"id": request_id, "object": object_name, "created": now_s(), "model": model,
                "choices": [], "usage": usage.model_dump(exclude_none=True)})


def usage_flags(stream_options) -> Tuple[bool, bool]:
    """-> (final usage chunk, usage on every chunk): upstream's rule, continuous usage only
    with include_usage (which defaults to true once stream_options is given)."""
    if stream_options is None:
        return False, False
    final = bool(stream_options.include_usage)
    return final, final and bool(stream_options.continuous_usage_stats)


def token_label(lp, token_id: int, as_ids: bool) -> str:
    """A logprobs entry's token: its text, or "token_id:<id>" (return_tokens_as_token_ids)."""
    if as_ids:
        return f"token_id:{token_id}"
    return (lp.decoded_token if lp is not None else None) or ""


def prompt_logprobs_json(entries) -> Optional[PromptLogprobs]:
    """The engine's prompt logprobs (None first, then {id: Logprob}) with -inf clamped."""
    if entries is None:
        return None
    return [None if d is None else
            {t: PromptLogprob(logprob=finite_logprob(lp.logprob), rank=lp.rank,
                              decoded_token=lp.decoded_token) for t, lp in d.items()}
            for d in entries]


class TextDelta:
    """What one streamed choice has sent so far.

    Text that may still change is held back: a trailing U+FFFD (half of a multi-byte
    character) and a tail that could grow into a stop string, which the engine would cut.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self.sent_chars = 0
        self.sent_tokens = 0

    def _stable_len(self, text: str) -> int:
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        end = len(text) - hold
        while end > 0 and text[end - 1] == "\ufffd":
            end -= 1
        return end

    def advance(self, out: CompletionOutput) -> Tuple[str, int, int]:
        """-> (new text, first new token index, end token index)."""
        end = len(out.text) if out.finish_reason is not None else self._stable_len(out.text)
        delta = out.text[self.sent_chars:end] if end > self.sent_chars else ""
        self.sent_chars = max(self.sent_chars, end)
        start, self.sent_tokens = self.sent_tokens, len(out.token_ids)
        return delta, start, self.sent_tokens


class OpenAIServing:
    options = ServerOptions()    # the app sets its own (build_app)
    fingerprint: Optional[str] = None    # system_fingerprint of whole responses (build_app)

    def __init__(self, engine: AsyncLLMEngine, tokenizer, served_model_names: List[str]):
        self.engine = engine
        self.tokenizer = tokenizer     # the server's own copy: the engine thread uses the other
        self.served_model_names = served_model_names
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.engine.hf_config.vocab_size

    # ---- validation ---------------------------------------------------------------------------
    def model_name(self, requested: Optional[str]) -> str:
        """Omitted or "" is the served model (upstream); an unknown name is a 404."""
        if not requested:
            return self.served_model_names[0]
        if requested not in self.served_model_names:
            raise OpenAIError(f"The model `{requested}` does not exist.", status=404,
                              param="model", code="model_not_found")
        return requested

    def tokens_as_ids(self, req: SamplingRequest) -> bool:
        if req.return_tokens_as_token_ids is not None:
            return req.return_tokens_as_token_ids
        return self.options.return_tokens_as_token_ids

    @staticmethod
    def check_supported(req: SamplingRequest) -> None:
        if req.best_of not in (None, req.n):
            raise OpenAIError("best_of is not supported by this server", param="best_of")

    def logit_bias(self, req: SamplingRequest) -> Optional[Dict[int, float]]:
        """OpenAI's {"token id": bias}: ids must be in the vocabulary; biases clamp to
        [-100, 100]."""
        if not req.logit_bias:
            return None
        try:
            bias = {int(t): min(max(float(v), -100.0), 100.0) for t, v in req.logit_bias.items()}
        except ValueError:
            raise OpenAIError("logit_bias keys must be token ids", param="logit_bias") from None
        bad = [t for t in bias if not 0 <= t < self.vocab_size]
        if bad:   # upstream's wording
            raise OpenAIError(f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. "
                              f"Vocabulary size: {self.vocab_size}", param="logit_bias")
        return bias

    def check_token_ids(self, ids: List[int], param: str = "prompt") -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:   # upstream: "Token id <id> is out of vocabulary"
            raise OpenAIError(f"Token id {bad} is out of vocabulary (vocabulary size "
                              f"{self.vocab_size})", param=param)

    def max_tokens_for(self, prompt_len: int, max_tokens: Optional[int]) -> int:
        """Upstream's context check: prompt + completion must fit in --max-model-len."""
        limit = self.max_model_len
        if prompt_len == 0:
            raise OpenAIError("The decoder prompt cannot be empty", param="prompt")
        if prompt_len >= limit:
            raise OpenAIError(f"This model's maximum context length is {limit} tokens. However, "
                              f"your request has {prompt_len} input tokens. Please reduce the "
                              f"length of the input.", param="prompt",
                              code="context_length_exceeded")
        if max_tokens is None:
            return limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise OpenAIError(f"This model's maximum context length is {limit} tokens. However, "
                              f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in "
                              f"the input, {max_tokens} in the completion). Please reduce the "
                              f"length of the input or completion.", param="max_tokens",
                              code="context_length_exceeded")
        return max_tokens

    def sampling_params(self, req: SamplingRequest, max_tokens: int, logprobs: Optional[int],
                        constraint: Optional[OutputConstraint] = None, *,
                        prompt_logprobs: Optional[int] = None) -> SamplingParams:
        logit_bias = self.logit_bias(req)
        self._check_token_fields(req, prompt_logprobs)
        try:
            return SamplingParams(
                n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                min_p=req.min_p or 0.0, seed=req.seed, max_tokens=max_tokens,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=(1.0 if req.repetition_penalty is None
                                    else req.repetition_penalty),
                logit_bias=logit_bias,
                min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos, logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                structured_outputs=constraint.params if constraint is not None else None,
                prompt_logprobs=prompt_logprobs, allowed_token_ids=req.allowed_token_ids)
        except ValueError as e:
            raise OpenAIError(str(e), param=str(e).split(" ", 1)[0]) from None

    def _check_token_fields(self, req: SamplingRequest, prompt_logprobs: Optional[int]) -> None:
        """upstream's checks (and wording) for prompt_logprobs and allowed_token_ids."""
        if prompt_logprobs is not None:
            k = self.vocab_size if prompt_logprobs == -1 else prompt_logprobs
            if k > MAX_LOGPROBS:
                raise OpenAIError(f"Requested prompt logprobs of {k}, which is greater than "
                                  f"max allowed: {MAX_LOGPROBS}", param="prompt_logprobs")
        ids = req.allowed_token_ids
        if ids is not None and any(not 0 <= t < self.vocab_size for t in ids):
            raise OpenAIError("allowed_token_ids contains out-of-vocab token id!",
                              param="allowed_token_ids")

    async def check_constraint(self, constraint: Optional[OutputConstraint]) -> None:
        """Compile the spec up front (the engine caches it for the request): a spec xgrammar
        rejects is a 400 naming the body field, not an error after the stream has begun."""
        if constraint is None:
            return
        try:
            await self.engine.acall(lambda e: e.structured_output.validate(constraint.params))
        except StructuredOutputError as e:
            raise OpenAIError(str(e), param=constraint.field) from None

    def kv_eviction(self, req: SamplingRequest) -> Optional[KVEvictionParams]:
        """The body's kv_* fields, checked alone and against the server's flags (a 400 names
        the field)."""
        given = {f.name: getattr(req, KVEvictionParams.body_field(f.name))
                 for f in dataclasses.fields(KVEvictionParams)}
        if all(v is None for v in given.values()):
            return None
        try:
            params = KVEvictionParams(**given)
            params.apply(self.engine.kv_config)
            return params
        except ValueError as e:
            raise OpenAIError(str(e), param=str(e).split(":", 1)[0]) from None

    def kv_usage(self, req: SamplingRequest,
                 finals: Sequence[RequestOutput]) -> Optional[KVUsage]:
        """usage.kv (ours) only when the request or the server asks for it: otherwise usage
        has upstream's shape."""
        if not (req.kv_usage or self.options.kv_usage_in_response):
            return None

        def total(key):
            return int(sum(f.kv_stats.get(key, 0) for f in finals))
        budgets = [f.kv_stats["budget_tokens"] for f in finals if "budget_tokens" in f.kv_stats]
        return KVUsage(evicted_tokens=total("evicted_tokens"), live_tokens=total("live_tokens"),
                       peak_blocks=total("peak_blocks"),
                       budget_tokens=int(max(budgets)) if budgets else None)

    # ---- running requests -----------------------------------------------------------------------
    async def generate_many(self, prompts: List[Dict], params: SamplingParams, request_id: str,
                            kv_eviction: Optional[KVEvictionParams] = None, deltas: bool = True
                            ) -> AsyncIterator[Tuple[int, RequestOutput]]:
        """Runs every prompt as its own engine request and yields (prompt index, output) as
        they come (deltas=False: final outputs only). Closing the iterator (or a failure of one
        prompt) aborts all of them."""
        if len(prompts) == 1:
            gen = self.engine.generate(prompts[0], params, request_id, kv_eviction=kv_eviction,
                                      deltas=deltas)
            async for out in self._guarded(gen):
                yield 0, _unless_exhausted(out)
            return
        q: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, prompt: Dict) -> None:
            try:
                async for out in self.engine.generate(prompt, params, f"{request_id}-{i}",
                                                      kv_eviction=kv_eviction, deltas=deltas):
                    q.put_nowait((i, out))
            except Exception as e:
                q.put_nowait((i, e))
            q.put_nowait((i, done))

        tasks = [asyncio.ensure_future(pump(i, p)) for i, p in enumerate(prompts)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await q.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise self._as_openai_error(item)
                else:
                    yield i, _unless_exhausted(item)
        finally:
            for t in tasks:
                t.cancel()

    async def _guarded(self, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        try:
            async for out in gen:
                yield out
        except Exception as e:
            raise self._as_openai_error(e) from None
        finally:
            await gen.aclose()

    @staticmethod
    def _as_openai_error(e: Exception) -> OpenAIError:
        if isinstance(e, OpenAIError):
            return e
        if isinstance(e, ValueError):
            return OpenAIError(str(e), param=getattr(e, "param", None) or "prompt")
        if isinstance(e, EngineStepError):
            return OpenAIError(str(e), status=500)
        if isinstance(e, EngineSleepingError):
            return OpenAIError(str(e), status=503)
        logger.error("request failed", exc_info=e)
        return OpenAIError(f"internal error: {e!r}", status=500)

    async def collect(self, prompts: List[Dict], params: SamplingParams, request_id: str,
                      raw_request: Optional[Request],
                      kv_eviction: Optional[KVEvictionParams] = None) -> List[RequestOutput]:
        """Final outputs in prompt order; the requests are aborted if the client goes away."""
        finals: List[Optional[RequestOutput]] = [None] * len(prompts)

        async def consume():
            gen = self.generate_many(prompts, params, request_id, kv_eviction, deltas=False)
            try:
                async for i, out in gen:
                    if out.finished:
                        finals[i] = out
            finally:
                await gen.aclose()

        work = asyncio.ensure_future(consume())
        watch = asyncio.ensure_future(_wait_for_disconnect(raw_request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
        if not work.done() or work.cancelled():
            raise OpenAIError("client disconnected", status=499)
        work.result()
        return finals

    def stream_errors(self, e: Exception) -> str:
        return sse(self._as_openai_error(e).body())


def _unless_exhausted(out: RequestOutput) -> RequestOutput:
    """A request whose KV outgrew the pool is an error for the client, not a finish reason
    (upstream's clients know only stop / length / abort)."""
    reason = SequenceStatus.FINISHED_KV_EXHAUSTED.value
    if out.finished and any(c.finish_reason == reason for c in out.outputs):
        live = out.kv_stats.get("live_tokens", 0)
        raise OpenAIError(f"The request's KV cache ({live} live tokens) no longer fits the KV "
                          f"pool even with every other request preempted. Lower max_tokens, "
                          f"enable KV eviction (kv_eviction_policy) or start the server with a "
                          f"larger --kv-cache-memory.", param="max_tokens", code=reason)
    return out


async def _wait_for_disconnect(raw_request: Optional[Request]) -> None:
    if raw_request is None:
        await asyncio.Event().wait()
        return
    while True:   # the body was read already: the next message is the disconnect
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return
