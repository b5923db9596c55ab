"""Request and response bodies of the OpenAI-compatible API (pydantic), with upstream's extras.

Requests ignore unknown fields (clients send many); floats must be finite. Bounds that are part
of the contract (n, logprobs, seed, max_tokens >= 1) live here so that the OpenAPI schema shows
them and a violation is a 400 before any work is done.
"""
import time
import uuid
from typing import Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 128          # samples per prompt
MAX_LOGPROBS = 20    # as upstream's default --max-logprobs
_I64 = 2 ** 63


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- errors and small bodies --------------------------------------------------------------------
class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[int, str]] = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "vllm"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: List[ModelCard]


class KVUsage(ResponseModel):
    """The request's KV figures (ours, not OpenAI's): summed over its prompts and samples."""
    evicted_tokens: int = 0
    live_tokens: int = 0
    peak_blocks: int = 0


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    kv: Optional[KVUsage] = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int,
           kv: Optional[KVUsage] = None) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, kv=kv)


class StreamOptions(RequestModel):
    include_usage: Optional[bool] = True
    continuous_usage_stats: Optional[bool] = False


# ---- sampling fields shared by completions and chat ---------------------------------------------
class SamplingRequest(RequestModel):
    model: Optional[str] = None
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    temperature: Optional[float] = Field(None, ge=0.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    seed: Optional[int] = Field(None, ge=-_I64, lt=_I64)
    stop: Optional[Union[str, List[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    logit_bias: Optional[Dict[str, float]] = None
    user: Optional[str] = None
    # upstream vLLM's sampling extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = 1.0
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: Optional[List[int]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # ours: this request's KV eviction over the server's --kv-* defaults (validated in
    # KVEvictionParams, so the 400 names the field)
    kv_eviction_policy: Optional[str] = None
    kv_eviction_ratio: Optional[float] = None
    kv_budget_tokens: Optional[int] = None
    kv_min_tokens: Optional[int] = None
    kv_prefill_chunk: Optional[int] = None


class CompletionRequest(SamplingRequest):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    max_tokens: Optional[int] = Field(16, ge=1)
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: Optional[str] = None
    add_special_tokens: bool = True


class TextContentPart(RequestModel):
    type: str
    text: Optional[str] = None


class ChatMessage(RequestModel):
    role: str
    content: Optional[Union[str, List[TextContentPart]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(SamplingRequest):
    messages: List[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: Optional[Dict] = None
    tools: Optional[List[Dict]] = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    chat_template: Optional[str] = None


# ---- completion responses -----------------------------------------------------------------------
class CompletionLogprobs(ResponseModel):
    text_offset: List[int] = Field(default_factory=list)
    token_logprobs: List[Optional[float]] = Field(default_factory=list)
    tokens: List[str] = Field(default_factory=list)
    top_logprobs: List[Optional[Dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: List[CompletionChoice]
    usage: Optional[UsageInfo] = None


# ---- chat responses -----------------------------------------------------------------------------
class ChatTopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: Optional[List[int]] = None


class ChatLogprobToken(ChatTopLogprob):
    top_logprobs: List[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(ResponseModel):
    content: Optional[List[ChatLogprobToken]] = None


class AssistantMessage(ResponseModel):
    role: str = "assistant"
    content: Optional[str] = None


class ChatChoice(ResponseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: List[ChatChoice]
    usage: UsageInfo


class DeltaMessage(ResponseModel):
    role: Optional[str] = None
    content: Optional[str] = None


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: List[ChatStreamChoice]
    usage: Optional[UsageInfo] = None


# ---- tokenizer endpoints ------------------------------------------------------------------------
class TokenizeCompletionRequest(RequestModel):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(RequestModel):
    model: Optional[str] = None
    messages: List[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: List[int]


class DetokenizeRequest(RequestModel):
    model: Optional[str] = None
    tokens: List[int]


class DetokenizeResponse(ResponseModel):
    prompt: str


class VersionResponse(ResponseModel):
    version: str
    engine: Optional[Dict] = None     # ours: CPU, C kernel variant, load-time kernel plan
