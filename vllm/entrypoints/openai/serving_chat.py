"""OpenAIServingChat: /v1/chat/completions with the tokenizer's chat template, whole or streamed."""
from typing import AsyncIterator, Dict, List, Optional

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from vllm.entrypoints.openai.errors import OpenAIError
from vllm.entrypoints.openai.protocol import (AssistantMessage, ChatChoice, ChatCompletionRequest,
                                              ChatCompletionResponse, ChatLogprobs,
                                              ChatLogprobToken, ChatMessage, ChatTopLogprob,
                                              UsageInfo, now_s, random_id)
from vllm.entrypoints.openai.serving_engine import (OpenAIServing, TextDelta, finite_logprob,
                                                    sse, usage_chunk)
from vllm.outputs import CompletionOutput


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine, tokenizer, served_model_names: List[str],
                 chat_template: Optional[str] = None):
        super().__init__(engine, tokenizer, served_model_names)
        self.chat_template = chat_template

    # ---- prompt ----------------------------------------------------------------------------
    def render(self, messages: List[ChatMessage], add_generation_prompt: bool,
               add_special_tokens: bool) -> Dict:
        """Messages -> {"prompt", "prompt_token_ids"} as LLM.chat builds them."""
        convo = [self._message(m, i) for i, m in enumerate(messages)]
        try:
            text = self.tokenizer.apply_chat_template(
                convo, chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt)
        except (ValueError, TypeError, KeyError, IndexError, jinja2.TemplateError) as e:
            raise OpenAIError(f"cannot apply the chat template: {e}", param="messages") from None
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return {"prompt": text, "prompt_token_ids": ids}

    @staticmethod
    def _message(m: ChatMessage, i: int) -> Dict:
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise OpenAIError(f"messages[{i}]: only text content parts are supported",
                                      param=f"messages.{i}.content")
                parts.append(part.text)
            content = "\n".join(parts)
        msg = {"role": m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        return msg

    # ---- request -----------------------------------------------------------------------------
    async def create(self, req: ChatCompletionRequest, raw_request: Optional[Request] = None):
        model = self.model_name(req.model)
        self.check_supported(req)
        if req.tools:
            raise OpenAIError("tools are not supported by this server", param="tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise OpenAIError("only response_format type 'text' is supported",
                              param="response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        prompt = self.render(req.messages, req.add_generation_prompt, req.add_special_tokens)
        max_tokens = self.max_tokens_for(len(prompt["prompt_token_ids"]),
                                         req.max_completion_tokens or req.max_tokens)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, logprobs)
        kv = self.kv_eviction(req)
        request_id = random_id("chatcmpl")
        if req.stream:
            return StreamingResponse(self._stream(req, model, prompt, params, request_id, kv),
                                     media_type="text/event-stream")
        final = (await self.collect([prompt], params, request_id, raw_request, kv))[0]
        choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                              logprobs=self._logprobs(c, 0, len(c.token_ids), req.top_logprobs)
                              if req.logprobs else None,
                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                   for c in final.outputs]
        n_out = sum(len(c.token_ids) for c in final.outputs)
        n_in = len(final.prompt_token_ids)
        usage = UsageInfo.of(n_in, n_out, self.kv_usage([final]))
        resp = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
        return JSONResponse(resp.model_dump())

    @staticmethod
    def _logprobs(c: CompletionOutput, start: int, end: int, top: Optional[int]) -> ChatLogprobs:
        content = []
        for tok, lps in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
            best = sorted(lps.items(), key=lambda kv: -kv[1].logprob)[:top or 0]
            content.append(ChatLogprobToken(
                **_top(lps[tok]), top_logprobs=[ChatTopLogprob(**_top(v)) for _, v in best]))
        return ChatLogprobs(content=content)

    # ---- streaming ---------------------------------------------------------------------------
    async def _stream(self, req, model, prompt, params, request_id, kv) -> AsyncIterator[str]:
        deltas = [TextDelta(params.stop) for _ in range(req.n)]
        opts = req.stream_options
        n_in = len(prompt["prompt_token_ids"])
        n_out, finals = 0, []
        gen = self.generate_many([prompt], params, request_id, kv)
        try:
            for i in range(req.n):
                yield sse(self._chunk(request_id, model, i, {"role": "assistant", "content": ""}))
            async for _, out in gen:
                for c in out.outputs:
                    text, start, end = deltas[c.index].advance(c)
                    if not text and start == end and c.finish_reason is None:
                        continue
                    lp = self._logprobs(c, start, end, req.top_logprobs) if req.logprobs else None
                    chunk = self._chunk(request_id, model, c.index, {"content": text}, lp, c)
                    if opts and opts.continuous_usage_stats:
                        chunk["usage"] = UsageInfo.of(n_in, end).model_dump()
                    yield sse(chunk)
                if out.finished:
                    n_out = sum(len(c.token_ids) for c in out.outputs)
                    finals.append(out)
            if opts and opts.include_usage:
                yield usage_chunk(request_id, "chat.completion.chunk", model,
                                  UsageInfo.of(n_in, n_out, self.kv_usage(finals)))
        except Exception as e:
            yield self.stream_errors(e)
        finally:
            await gen.aclose()
        yield sse("[DONE]")

    @staticmethod
    def _chunk(request_id: str, model: str, index: int, delta: Dict,
               lp: Optional[ChatLogprobs] = None, c: Optional[CompletionOutput] = None) -> Dict:
        return {"id": request_id, "object": "chat.completion.chunk", "created": now_s(),
                "model": model,
                "choices": [{"index": index, "delta": delta,
                             "logprobs": lp.model_dump() if lp is not None else None,
                             "finish_reason": c.finish_reason if c else None,
                             "stop_reason": c.stop_reason if c else None}]}


def _top(lp) -> Dict:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": finite_logprob(lp.logprob),
            "bytes": list(token.encode("utf-8", errors="replace"))}
