"""OpenAIServingCompletion: /v1/completions, whole or streamed (SSE)."""
from typing import AsyncIterator, Dict, List, Optional, Tuple

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from vllm.entrypoints.openai.errors import OpenAIError
from vllm.entrypoints.openai.output_constraint import OutputConstraint
from vllm.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs,
                                              CompletionRequest, CompletionResponse, UsageInfo,
                                              now_s, random_id)
from vllm.entrypoints.openai.serving_engine import (OpenAIServing, TextDelta, finite_logprob,
                                                    prompt_logprobs_json, sse, token_label,
                                                    usage_chunk, usage_flags)
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
        constraint = OutputConstraint.from_request(req)
        await self.check_constraint(constraint)
        params = self.sampling_params(req, max_tokens, req.logprobs, constraint,
                                      prompt_logprobs=self._prompt_logprobs(req))
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
            raise OpenAIError("The decoder prompt cannot be empty", param="prompt")
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

    @staticmethod
    def _prompt_logprobs(req: CompletionRequest) -> Optional[int]:
        """echo with logprobs scores the prompt too (upstream: as many top entries)."""
        if req.prompt_logprobs is not None:
            return req.prompt_logprobs
        return req.logprobs if req.echo else None

    # ---- whole response ----------------------------------------------------------------------
    def _response(self, req, model, request_id, prompts, finals: List[RequestOutput]):
        choices, n_in, n_out = [], 0, 0
        as_ids = self.tokens_as_ids(req)
        for i, final in enumerate(finals):
            prefix = (prompts[i]["prompt"] or "") if req.echo else ""
            echoed = self._echoed(final) if req.echo else ([], [])
            for c in final.outputs:
                lp = None
                if req.logprobs is not None:
                    lp, _ = self._logprobs(echoed[0] + c.token_ids,
                                           echoed[1] + list(c.logprobs or []), 0, as_ids)
                choices.append(CompletionChoice(
                    index=i * req.n + c.index, text=prefix + c.text, logprobs=lp,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs)))
                n_out += len(c.token_ids)
            n_in += len(final.prompt_token_ids)
        return CompletionResponse(id=request_id, model=model, choices=choices,
                                  system_fingerprint=self.fingerprint,
                                  usage=UsageInfo.of(n_in, n_out, self.kv_usage(req, finals)))

    @staticmethod
    def _echoed(out: RequestOutput) -> Tuple[List[int], List[Optional[Dict]]]:
        """The prompt's tokens and their logprob dicts (None for the first one)."""
        ids = list(out.prompt_token_ids)
        entries = list(out.prompt_logprobs or [])
        return ids, entries + [None] * (len(ids) - len(entries))

    def _logprobs(self, ids: List[int], entries: List[Optional[Dict]], offset: int,
                  as_ids: bool) -> Tuple[CompletionLogprobs, int]:
        """OpenAI's completion logprobs of `ids` (entries[i]: {id: Logprob} or None, which
        gives a null logprob); text_offset counts from `offset`. -> (logprobs, next offset)."""
        lp = CompletionLogprobs()
        for tok, d in zip(ids, entries):
            entry = d.get(tok) if d else None
            text = entry.decoded_token if entry is not None and entry.decoded_token is not None \
                else self.tokenizer.decode([tok])
            lp.tokens.append(f"token_id:{tok}" if as_ids else text)
            lp.token_logprobs.append(finite_logprob(entry.logprob) if entry else None)
            lp.top_logprobs.append({token_label(v, t, as_ids): finite_logprob(v.logprob)
                                    for t, v in d.items()} if d else None)
            lp.text_offset.append(offset)
            offset += len(text)
        return lp, offset

    # ---- streaming ---------------------------------------------------------------------------
    async def _stream(self, req, model, prompts, params, request_id, kv) -> AsyncIterator[str]:
        n = req.n
        deltas = [TextDelta(params.stop) for _ in range(len(prompts) * n)]
        offsets = [0] * len(deltas)
        echo_pending = [req.echo] * len(deltas)   # the prompt goes out with a choice's first delta
        finished = [False] * len(deltas)          # a finished choice is never sent again
        as_ids = self.tokens_as_ids(req)
        n_in = n_out = 0
        finals = []
        include_usage, continuous = usage_flags(req.stream_options)
        gen = self.generate_many(prompts, params, request_id, kv)
        try:
            async for i, out in gen:
                for c in out.outputs:
                    k = i * n + c.index
                    if finished[k]:
                        continue
                    text, start, end = deltas[k].advance(c)
                    echo = echo_pending[k]
                    if not (echo or text or start < end or c.finish_reason is not None):
                        continue
                    ids, entries = c.token_ids[start:end], list(c.logprobs or [])[start:end]
                    if echo:
                        text = (prompts[i]["prompt"] or "") + text
                        p_ids, p_entries = self._echoed(out)
                        ids, entries = p_ids + ids, p_entries + entries
                        echo_pending[k] = False
                    lp = None
                    if req.logprobs is not None:
                        lp, offsets[k] = self._logprobs(ids, entries, offsets[k], as_ids)
                    finished[k] = c.finish_reason is not None
                    chunk = self._chunk(request_id, model, k, text, lp, c)
                    if continuous:
                        chunk["usage"] = UsageInfo.of(len(out.prompt_token_ids), end).model_dump()
                    yield sse(chunk)
                if out.finished:
                    n_in += len(out.prompt_token_ids)
                    n_out += sum(len(c.token_ids) for c in out.outputs)
                    finals.append(out)
            if include_usage:
                yield usage_chunk(request_id, "text_completion", model,
                                  UsageInfo.of(n_in, n_out, self.kv_usage(req, finals)))
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
