"""OpenAIServingCompletion: /v1/completions, whole or streamed (SSE)."""
from typing import AsyncIterator, Dict, List, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from vllm.entrypoints.openai.errors import OpenAIError
from vllm.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs,
                                              CompletionRequest, CompletionResponse, UsageInfo,
                                              now_s, random_id)
from vllm.entrypoints.openai.serving_engine import (OpenAIServing, TextDelta, finite_logprob,
                                                    sse, usage_chunk)
from vllm.outputs import CompletionOutput, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, raw_request: Optional[Request] = None):
        model = self.model_name(req.model)
        self.check_supported(req)
        if req.suffix:
            raise OpenAIError("suffix is not supported by this server", param="suffix")
        prompts = self._prompts(req)
        max_tokens = min(self.max_tokens_for(len(p["prompt_token_ids"]), req.max_tokens)
                         for p in prompts)
        params = self.sampling_params(req, max_tokens, req.logprobs)
        kv = self.kv_eviction(req)
        request_id = random_id("cmpl")
        if req.stream:
            return StreamingResponse(self._stream(req, model, prompts, params, request_id, kv),
                                     media_type="text/event-stream")
        finals = await self.collect(prompts, params, request_id, raw_request, kv)
        return JSONResponse(self._response(req, model, request_id, prompts, finals).model_dump())

    def _prompts(self, req: CompletionRequest) -> List[Dict]:
        """str | [str] | [int] | [[int]] -> [{"prompt", "prompt_token_ids"}], one per prompt."""
        p = req.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            p = [p]
        if not p:
            raise OpenAIError("The prompt cannot be empty", param="prompt")
        out = []
        for item in p:
            if isinstance(item, str):
                ids = self.tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
                out.append({"prompt": item, "prompt_token_ids": ids})
            else:
                self.check_token_ids(item)
                text = self.tokenizer.decode(item) if req.echo else None
                out.append({"prompt": text, "prompt_token_ids": list(item)})
        return out

    # ---- whole response ----------------------------------------------------------------------
    def _response(self, req, model, request_id, prompts, finals: List[RequestOutput]):
        choices, n_in, n_out = [], 0, 0
        for i, final in enumerate(finals):
            prefix = (prompts[i]["prompt"] or "") if req.echo else ""
            for c in final.outputs:
                choices.append(CompletionChoice(
                    index=i * req.n + c.index, text=prefix + c.text,
                    logprobs=self._logprobs(c, 0, len(c.token_ids), len(prefix))
                    if req.logprobs is not None else None,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason))
                n_out += len(c.token_ids)
            n_in += len(final.prompt_token_ids)
        return CompletionResponse(id=request_id, model=model, choices=choices,
                                  usage=UsageInfo.of(n_in, n_out, self.kv_usage(finals)))

    @staticmethod
    def _logprobs(c: CompletionOutput, start: int, end: int, offset: int) -> CompletionLogprobs:
        lp = CompletionLogprobs()
        for tok, lps in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
            text = lps[tok].decoded_token or ""
            lp.tokens.append(text)
            lp.token_logprobs.append(finite_logprob(lps[tok].logprob))
            lp.top_logprobs.append({(v.decoded_token or ""): finite_logprob(v.logprob)
                                    for v in lps.values()})
            lp.text_offset.append(offset)
            offset += len(text)
        return lp

    # ---- streaming ---------------------------------------------------------------------------
    async def _stream(self, req, model, prompts, params, request_id, kv) -> AsyncIterator[str]:
        n = req.n
        deltas = [TextDelta(params.stop) for _ in range(len(prompts) * n)]
        offsets = [0] * len(deltas)
        n_in = n_out = 0
        finals = []
        opts = req.stream_options
        gen = self.generate_many(prompts, params, request_id, kv)
        try:
            if req.echo:
                for i, p in enumerate(prompts):
                    for j in range(n):
                        offsets[i * n + j] = len(p["prompt"] or "")
                        yield sse(self._chunk(request_id, model, i * n + j, p["prompt"] or ""))
            async for i, out in gen:
                for c in out.outputs:
                    k = i * n + c.index
                    text, start, end = deltas[k].advance(c)
                    if not text and start == end and c.finish_reason is None:
                        continue
                    lp = self._logprobs(c, start, end, offsets[k]) \
                        if req.logprobs is not None else None
                    offsets[k] += sum(len(t) for t in lp.tokens) if lp else 0
                    chunk = self._chunk(request_id, model, k, text, lp, c)
                    if opts and opts.continuous_usage_stats:
                        chunk["usage"] = UsageInfo.of(len(out.prompt_token_ids), end).model_dump()
                    yield sse(chunk)
                if out.finished:
                    n_in += len(out.prompt_token_ids)
                    n_out += sum(len(c.token_ids) for c in out.outputs)
                    finals.append(out)
            if opts and opts.include_usage:
                yield usage_chunk(request_id, "text_completion", model,
                                  UsageInfo.of(n_in, n_out, self.kv_usage(finals)))
        except Exception as e:
            yield self.stream_errors(e)
        finally:
            await gen.aclose()
        yield sse("[DONE]")

    @staticmethod
    def _chunk(request_id: str, model: str, index: int, text: str,
               lp: Optional[CompletionLogprobs] = None, c: Optional[CompletionOutput] = None):
        return {"id": request_id, "object": "text_completion", "created": now_s(), "model": model,
                "choices": [{"index": index, "text": text,
                             "logprobs": lp.model_dump() if lp is not None else None,
                             "finish_reason": c.finish_reason if c else None,
                             "stop_reason": c.stop_reason if c else None}]}
