"""OpenAIServingChat: /v1/chat/completions with the tokenizer's chat template, whole or streamed.

Tools (tool_use.py): `tools` reach the template as apply_chat_template(tools=...). The default
model's template ignores them; examples/tool_chat_template_hermes.jinja renders them, and earlier
tool calls and results, in the Hermes form that `--tool-call-parser hermes` reads back:
    vllm serve --chat-template examples/tool_chat_template_hermes.jinja \
        --enable-auto-tool-choice --tool-call-parser hermes

Reasoning (`--reasoning-parser`, vllm/reasoning/): each choice's text is split into
reasoning_content and content first; tool calls are parsed from the content only, and a
structured-output constraint applies to the content (it starts where the reasoning ends).
"""
import json
from typing import AsyncIterator, Dict, List, Optional, Tuple, Type

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from vllm.entrypoints.openai.errors import OpenAIError
from vllm.entrypoints.openai.output_constraint import OutputConstraint
from vllm.entrypoints.openai.protocol import (AssistantMessage, ChatChoice, ChatCompletionRequest,
                                              ChatCompletionResponse, ChatLogprobs,
                                              ChatLogprobToken, ChatMessage, ChatTopLogprob,
                                              UsageInfo, now_s, random_id)
from vllm.entrypoints.openai.serving_engine import (OpenAIServing, TextDelta, finite_logprob,
                                                    prompt_logprobs_json, sse, usage_chunk,
                                                    usage_flags)
from vllm.entrypoints.openai.tool_parsers import ToolCallStream, ToolParser, get_tool_parser
from vllm.entrypoints.openai.tool_use import ToolUse
from vllm.outputs import CompletionOutput
from vllm.reasoning import ReasoningParser, get_reasoning_parser


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine, tokenizer, served_model_names: List[str],
                 chat_template: Optional[str] = None, enable_auto_tools: bool = False,
                 tool_parser: Optional[str] = None, reasoning_parser: Optional[str] = None):
        super().__init__(engine, tokenizer, served_model_names)
        self.chat_template = chat_template
        self.auto_parser = auto_tool_parser(enable_auto_tools, tool_parser)
        self.reasoning: Optional[ReasoningParser] = \
            get_reasoning_parser(reasoning_parser)(tokenizer) if reasoning_parser else None

    # ---- prompt ----------------------------------------------------------------------------
    def render(self, messages: List[ChatMessage], add_generation_prompt: bool,
               add_special_tokens: bool, tools: Optional[List[Dict]] = None,
               continue_final_message: bool = False) -> Dict:
        """Messages -> {"prompt", "prompt_token_ids"} as LLM.chat builds them.
        continue_final_message: the prompt ends inside the last message (no end-of-turn, no
        generation prompt), so the model continues it."""
        convo = [self._message(m, i) for i, m in enumerate(messages)]
        try:
            text = self.tokenizer.apply_chat_template(
                convo, chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, tools=tools)
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
        if m.tool_calls:
            msg["tool_calls"] = [_template_call(tc, f"messages.{i}.tool_calls.{k}")
                                 for k, tc in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        return msg

    # ---- request -----------------------------------------------------------------------------
    async def create(self, req: ChatCompletionRequest, raw_request: Optional[Request] = None):
        model = self.model_name(req.model)
        self.check_supported(req)
        tool_use = ToolUse(req, self.auto_parser, self.tokenizer)
        constraint = self._constraint(req, tool_use)
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        prompt = self.render(req.messages, req.add_generation_prompt, req.add_special_tokens,
                             tool_use.template_tools(), req.continue_final_message)
        max_tokens = self.max_tokens_for(len(prompt["prompt_token_ids"]),
                                         req.max_completion_tokens or req.max_tokens)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        await self.check_constraint(constraint)
        constraint = await self._after_reasoning(constraint)
        params = self.sampling_params(req, max_tokens, logprobs, constraint,
                                      prompt_logprobs=req.prompt_logprobs)
        kv = self.kv_eviction(req)
        request_id = random_id("chatcmpl")
        if req.stream:
            return StreamingResponse(self._stream(req, model, prompt, params, request_id, kv,
                                                  tool_use),
                                     media_type="text/event-stream")
        final = (await self.collect([prompt], params, request_id, raw_request, kv))[0]
        choices = []
        role, echo = self._role(req), self._echo(req)
        for c in final.outputs:
            message, finish_reason = self._choice_message(req, tool_use, c)
            message.role = role
            if echo:
                message.content = echo + (message.content or "")
            choices.append(ChatChoice(
                index=c.index, message=message,
                logprobs=self._logprobs(c, 0, len(c.token_ids), req.top_logprobs,
                                        self.tokens_as_ids(req))
                if req.logprobs else None,
                finish_reason=finish_reason, stop_reason=c.stop_reason))
        n_out = sum(len(c.token_ids) for c in final.outputs)
        n_in = len(final.prompt_token_ids)
        usage = UsageInfo.of(n_in, n_out, self.kv_usage(req, [final]))
        resp = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage,
                                      system_fingerprint=self.fingerprint,
                                      prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs))
        return JSONResponse(resp.model_dump())

    def _choice_message(self, req: ChatCompletionRequest, tool_use: ToolUse,
                        c: CompletionOutput) -> Tuple[AssistantMessage, Optional[str]]:
        """A whole choice: (message, finish_reason). With a reasoning parser the reasoning is
        split off first and the rest is the content (tool calls are parsed from it)."""
        if self.reasoning is None:
            return tool_use.message(c.text, c.finish_reason)
        reasoning, content = self.reasoning.extract_reasoning_content(c.text, req)
        message, finish_reason = tool_use.message(content or "", c.finish_reason)
        if not (message.tool_calls and tool_use.forced):   # a forced call's content stays ""
            message.content = message.content or None
        message.reasoning_content = reasoning if req.include_reasoning else None
        return message, finish_reason

    async def _after_reasoning(self, constraint: Optional[OutputConstraint]
                               ) -> Optional[OutputConstraint]:
        """With a reasoning parser a constraint holds for the content only: the reasoning
        before it is free text (grammar_after_reasoning). The client's own spec is checked
        before, so that its 400 is the one it would get without reasoning."""
        if constraint is None or self.reasoning is None:
            return constraint
        wrapped = OutputConstraint(self.reasoning.content_constraint(constraint.params),
                                   constraint.field)
        await self.check_constraint(wrapped)
        return wrapped

    @staticmethod
    def _role(req: ChatCompletionRequest) -> str:
        """upstream: the reply is the assistant's after a generation prompt, else it continues
        the last message's role."""
        return "assistant" if req.add_generation_prompt else req.messages[-1].role

    def _echo(self, req: ChatCompletionRequest) -> str:
        """echo: the last message's content, when the reply continues that message's role."""
        last = req.messages[-1]
        if not req.echo or last.role != self._role(req):
            return ""
        return self._message(last, len(req.messages) - 1)["content"]

    @staticmethod
    def _constraint(req: ChatCompletionRequest, tool_use: ToolUse) -> Optional[OutputConstraint]:
        """A named or "required" tool_choice constrains the output itself: upstream allows no
        other structured output beside it."""
        tools = tool_use.constraint()
        other = OutputConstraint.from_request(req)
        if tools is not None and other is not None:
            raise OpenAIError(f"tool_choice {'required' if tool_use.named is None else 'named'}"
                              f" constrains the output by the tools' schemas; it cannot be "
                              f"combined with {other.field}", param="tool_choice")
        return tools or other

    @staticmethod
    def _logprobs(c: CompletionOutput, start: int, end: int, top: Optional[int],
                  as_ids: bool = False) -> ChatLogprobs:
        content = []
        for tok, lps in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
            best = sorted(lps.items(), key=lambda kv: -kv[1].logprob)[:top or 0]
            content.append(ChatLogprobToken(
                **_top(lps[tok], tok, as_ids),
                top_logprobs=[ChatTopLogprob(**_top(v, t, as_ids)) for t, v in best]))
        return ChatLogprobs(content=content)

    # ---- streaming ---------------------------------------------------------------------------
    async def _stream(self, req, model, prompt, params, request_id, kv,
                      tool_use: ToolUse) -> AsyncIterator[str]:
        deltas = [TextDelta(params.stop) for _ in range(req.n)]
        tool_streams = [tool_use.stream() for _ in range(req.n)]
        texts = [""] * req.n               # each choice's text so far (the reasoning parser's)
        finished = [False] * req.n         # a finished choice is never sent again
        include_usage, continuous = usage_flags(req.stream_options)
        as_ids = self.tokens_as_ids(req)
        n_in = len(prompt["prompt_token_ids"])
        n_out, finals = 0, []
        gen = self.generate_many([prompt], params, request_id, kv)
        try:
            for chunk in self._opening_chunks(req, request_id, model, continuous, n_in):
                yield sse(chunk)
            async for _, out in gen:
                for c in out.outputs:
                    if finished[c.index]:
                        continue
                    text, start, end = deltas[c.index].advance(c)
                    if not text and start == end and c.finish_reason is None:
                        continue
                    final = c.finish_reason is not None
                    ts = tool_streams[c.index]
                    delta = self._delta(req, tool_use, ts, texts, c.index, text, final)
                    if not delta and not final and not req.logprobs:
                        continue
                    lp = self._logprobs(c, start, end, req.top_logprobs, as_ids) \
                        if req.logprobs else None
                    chunk = self._chunk(request_id, model, c.index, delta, lp, c)
                    if ts is not None and c.finish_reason is not None:
                        chunk["choices"][0]["finish_reason"] = tool_use.finish_reason(
                            c.finish_reason, ts.called)
                    finished[c.index] = c.finish_reason is not None
                    if continuous:
                        chunk["usage"] = _usage(n_in, end)
                    yield sse(chunk)
                if out.finished:
                    n_out = sum(len(c.token_ids) for c in out.outputs)
                    finals.append(out)
            if include_usage:
                yield usage_chunk(request_id, "chat.completion.chunk", model,
                                  UsageInfo.of(n_in, n_out, self.kv_usage(req, finals)))
        except Exception as e:
            yield self.stream_errors(e)
        finally:
            await gen.aclose()
        yield sse("[DONE]")

    def _delta(self, req: ChatCompletionRequest, tool_use: ToolUse,
               ts: Optional[ToolCallStream], texts: List[str], index: int, text: str,
               final: bool) -> Dict:
        """A choice's next delta ({} when there is nothing to send yet): its new text as
        content; with a reasoning parser, reasoning_content and the content after it; with a
        tool stream, that content's content and tool_calls deltas."""
        delta, content = {}, text
        if self.reasoning is not None:
            previous = texts[index]
            texts[index] += text
            found = self.reasoning.extract_reasoning_content_streaming(
                previous, texts[index], text, final=final)
            content = (found.content if found is not None else None) or ""
            if found is not None and found.reasoning_content and req.include_reasoning:
                delta["reasoning_content"] = found.reasoning_content
        if ts is not None:
            delta.update(tool_use.delta(ts, content, final))
        elif content or self.reasoning is None:
            delta["content"] = content
        return delta

    def _opening_chunks(self, req: ChatCompletionRequest, request_id: str, model: str,
                        continuous: bool, n_in: int) -> List[Dict]:
        """Each choice's role chunk, then (echo) the echoed content; with continuous usage
        stats they carry usage too (no completion tokens yet), as upstream."""
        chunks = [self._chunk(request_id, model, i, {"role": self._role(req), "content": ""})
                  for i in range(req.n)]
        echo = self._echo(req)
        if echo:
            chunks += [self._chunk(request_id, model, i, {"content": echo})
                       for i in range(req.n)]
        if continuous:
            for chunk in chunks:
                chunk["usage"] = _usage(n_in, 0)
        return chunks

    @staticmethod
    def _chunk(request_id: str, model: str, index: int, delta: Dict,
               lp: Optional[ChatLogprobs] = None, c: Optional[CompletionOutput] = None) -> Dict:
        return {"id": request_id, "object": "chat.completion.chunk", "created": now_s(),
                "model": model,
                "choices": [{"index": index, "delta": delta,
                             "logprobs": lp.model_dump() if lp is not None else None,
                             "finish_reason": c.finish_reason if c else None,
                             "stop_reason": c.stop_reason if c else None}]}


def auto_tool_parser(enable_auto_tools: bool, name: Optional[str]) -> Optional[Type[ToolParser]]:
    """The parser of tool_choice "auto": served only with both flags, as upstream."""
    if not enable_auto_tools:
        return None
    if not name:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    return get_tool_parser(name)


def _template_call(tc, param: str) -> Dict:
    """An earlier call as templates take it: arguments as a dict (upstream does the same; the
    Hermes and Llama 3 templates write them out with tojson)."""
    args = tc.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise OpenAIError(f"{param}.function.arguments is not JSON",
                              param=f"{param}.function.arguments") from None
    call = {"type": "function", "function": {"name": tc.function.name, "arguments": args or {}}}
    if tc.id is not None:
        call["id"] = tc.id
    return call


def _usage(prompt_tokens: int, completion_tokens: int) -> Dict:
    """A chunk's running usage: upstream sends the three counts only."""
    return UsageInfo.of(prompt_tokens, completion_tokens).model_dump(exclude_none=True)


def _top(lp, token_id: int, as_ids: bool) -> Dict:
    """bytes are always the token's text (return_tokens_as_token_ids changes only `token`)."""
    text = lp.decoded_token or ""
    return {"token": f"token_id:{token_id}" if as_ids else text,
            "logprob": finite_logprob(lp.logprob),
            "bytes": list(text.encode("utf-8", errors="replace"))}
