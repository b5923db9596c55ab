"""One streaming request to an OpenAI-compatible server, timed: upstream's request functions.

A request streams (server-sent events) with stream_options.include_usage, so the server's usage
chunk gives the exact prompt and output token counts. Timing, from the moment the request is sent:
  ttft     the first chunk that carries generated tokens (a chat stream's opening role chunk,
           which this server sends before generating, carries none)
  itl      the gaps between consecutive token chunks
  latency  until the last token chunk (E2EL)
"""
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Dict, List, Optional, Union

import httpx


@dataclass
class RequestFuncInput:
    prompt: Union[str, List[int]]
    api_url: str
    prompt_len: int
    output_len: int
    model: str
    model_name: Optional[str] = None     # the name the API serves the model under
    logprobs: Optional[int] = None
    extra_headers: Optional[Dict[str, str]] = None
    extra_body: Optional[Dict[str, Any]] = None
    ignore_eos: bool = False
    request_id: Optional[str] = None


@dataclass
class RequestFuncOutput:
    generated_text: str = ""
    success: bool = False
    latency: float = 0.0
    output_tokens: int = 0               # the server's usage.completion_tokens (0: none sent)
    ttft: float = 0.0
    itl: List[float] = field(default_factory=list)
    prompt_len: int = 0
    error: str = ""
    start_time: float = 0.0              # time.perf_counter() when the request was sent


RequestFunc = Callable[[RequestFuncInput, httpx.AsyncClient], Awaitable[RequestFuncOutput]]


def _headers(inp: RequestFuncInput) -> Dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if os.environ.get("OPENAI_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
    headers.update(inp.extra_headers or {})
    if inp.request_id:
        headers["x-request-id"] = inp.request_id
    return headers


def _payload(inp: RequestFuncInput, body: Dict[str, Any]) -> Dict[str, Any]:
    body = {"model": inp.model_name or inp.model, **body, "stream": True,
            "stream_options": {"include_usage": True}}
    if inp.ignore_eos:
        body["ignore_eos"] = True
    body.update(inp.extra_body or {})
    return body


async def _stream(inp: RequestFuncInput, client: httpx.AsyncClient, body: Dict[str, Any],
                  token_text: Callable[[Dict], Optional[str]]) -> RequestFuncOutput:
    """POST body and read its event stream. token_text(choice): the choice's text when the chunk
    carries generated tokens, else None."""
    out = RequestFuncOutput(prompt_len=inp.prompt_len)
    text, got_token = [], False
    out.start_time = last = time.perf_counter()
    try:
        async with client.stream("POST", inp.api_url, json=body, headers=_headers(inp)) as r:
            if r.status_code != 200:
                body = (await r.aread())[:500].decode(errors="replace")
                out.error = f"HTTP {r.status_code}: {body}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue                    # event separators and SSE comments
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("error"):
                    out.error = json.dumps(chunk["error"])
                    return out
                choices = chunk.get("choices") or []
                piece = token_text(choices[0]) if choices else None
                if piece is not None:
                    if got_token:
                        out.itl.append(now - last)
                    else:
                        out.ttft, got_token = now - out.start_time, True
                    last = now
                    text.append(piece)
                if chunk.get("usage"):
                    out.output_tokens = chunk["usage"].get("completion_tokens") or 0
                    out.prompt_len = chunk["usage"].get("prompt_tokens") or out.prompt_len
    except Exception as e:                      # the run goes on; the request counts as failed
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.generated_text, out.latency = "".join(text), last - out.start_time
    out.success = got_token
    if not got_token:
        out.error = "the stream carried no generated tokens"
    return out


def _completion_text(choice: Dict) -> Optional[str]:
    return choice.get("text") or ""


def _chat_text(choice: Dict) -> Optional[str]:
    delta = choice.get("delta") or {}
    if "role" in delta and not delta.get("content"):
        return None                             # the opening role chunk
    return delta.get("content") or ""


async def async_request_openai_completions(inp: RequestFuncInput,
                                           client: httpx.AsyncClient) -> RequestFuncOutput:
    if not inp.api_url.endswith("completions"):
        raise ValueError("OpenAI Completions API URL must end with 'completions'.")
    body = _payload(inp, {"prompt": inp.prompt, "max_tokens": inp.output_len,
                          "repetition_penalty": 1.0, "logprobs": inp.logprobs})
    return await _stream(inp, client, body, _completion_text)


async def async_request_openai_chat_completions(inp: RequestFuncInput,
                                                client: httpx.AsyncClient) -> RequestFuncOutput:
    if not inp.api_url.endswith("chat/completions"):
        raise ValueError("OpenAI Chat Completions API URL must end with 'chat/completions'.")
    content = inp.prompt if isinstance(inp.prompt, str) else json.dumps(inp.prompt)
    body = _payload(inp, {"messages": [{"role": "user", "content": content}],
                          "max_completion_tokens": inp.output_len})
    return await _stream(inp, client, body, _chat_text)


ASYNC_REQUEST_FUNCS: Dict[str, RequestFunc] = {
    "vllm": async_request_openai_completions,
    "openai": async_request_openai_completions,
    "openai-chat": async_request_openai_chat_completions,
}

OPENAI_COMPATIBLE_BACKENDS = list(ASYNC_REQUEST_FUNCS)
