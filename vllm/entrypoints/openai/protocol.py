"""Request and response bodies of the OpenAI-compatible API (pydantic), with upstream's extras.

Requests ignore unknown fields (clients send many); floats must be finite. Bounds that are part
of the contract (n, logprobs, seed, max_tokens >= 1) live here so that the OpenAPI schema shows
them and a violation is a 400 before any work is done.
"""
import time
import uuid
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, create_model, model_serializer,
                      model_validator)

from vllm.engine.arg_utils import flag_type, request_flags

MAX_N = 128          # samples per prompt
MAX_LOGPROBS = 20    # as upstream's default --max-logprobs
_I64 = 2 ** 63


class ParamError(ValueError):
    """A request-level check that names the body field it is about (the 400's param)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


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
    budget_tokens: Optional[int] = None   # the effective budget (live tokens held at most, the
                                          # prompt included under scope generated); None: no
                                          # policy ran


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[Dict[str, int]] = None
    kv: Optional[KVUsage] = None      # ours: only when the request (or the server) asks for it

    @model_serializer(mode="wrap")
    def _drop_absent_kv(self, handler):
        data = handler(self)
        if data.get("kv", 0) is None:
            data.pop("kv")
        return data

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int,
           kv: Optional[KVUsage] = None) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, kv=kv)


class StreamOptions(RequestModel):
    include_usage: Optional[bool] = True
    continuous_usage_stats: Optional[bool] = False


# ---- structured outputs (both endpoints; one kind per request) ----------------------------------
class JsonSchemaFormat(RequestModel):
    name: str
    description: Optional[str] = None
    json_schema: Optional[Dict[str, Any]] = Field(None, alias="schema")   # BaseModel has .schema
    strict: Optional[bool] = None


class ResponseFormat(RequestModel):
    """OpenAI's response_format: "text" (no constraint), "json_object", "json_schema"."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsRequest(RequestModel):
    """upstream's `structured_outputs` body field: exactly one of the constraints."""
    json_: Optional[Union[str, Dict[str, Any]]] = Field(None, alias="json")  # BaseModel has .json
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False


# ---- sampling fields shared by completions and chat ---------------------------------------------
# the engine flags a request may set (EngineArgs' per_request fields), as optional body fields of
# the same name: None takes the server's flag
KVEvictionFields = create_model(
    "KVEvictionFields", __base__=RequestModel,
    **{f.name: (Optional[flag_type(f)], Field(None, description=f.metadata["help"]))
       for f in request_flags()})


class SamplingRequest(KVEvictionFields):
    model: Optional[str] = None
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    temperature: Optional[float] = Field(None, ge=0.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    seed: Optional[int] = Field(None, ge=-_I64, le=_I64 - 1)   # a torch.long, as upstream
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
    # ours: this request's KV eviction over the server's --kv-* defaults comes from
    # KVEvictionFields (validated in KVEvictionParams, so the 400 names the field)
    kv_usage: bool = False       # ours: report usage.kv (also on with --kv-usage-in-response)
    # upstream vLLM's token-level extensions
    allowed_token_ids: Optional[List[int]] = None
    prompt_logprobs: Optional[int] = None
    return_tokens_as_token_ids: Optional[bool] = None   # None: the server's flag decides

    @model_validator(mode="before")
    @classmethod
    def _check_stream_fields(cls, data):
        """upstream's request-level rules (and wording) for stream_options and prompt_logprobs."""
        if not isinstance(data, dict):
            return data
        if data.get("stream_options") and not data.get("stream"):
            raise ParamError("Stream options can only be defined when `stream=True`.",
                             "stream_options")
        k = data.get("prompt_logprobs")
        if isinstance(k, int) and not isinstance(k, bool):
            if data.get("stream") and (k > 0 or k == -1):
                raise ParamError("`prompt_logprobs` are not available when `stream=True`.",
                                 "prompt_logprobs")
            if k < 0 and k != -1:
                raise ParamError("`prompt_logprobs` must be a positive value or -1.",
                                 "prompt_logprobs")
        return data
    # structured outputs (output_constraint.py): OpenAI's response_format, upstream's
    # structured_outputs and its older guided_* fields
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsRequest] = None
    guided_json: Optional[Union[str, Dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[List[str]] = None
    guided_grammar: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    guided_decoding_backend: Optional[str] = None    # accepted and ignored: xgrammar is the one


class CompletionRequest(SamplingRequest):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    max_tokens: Optional[int] = Field(16, ge=1)
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: Optional[str] = None
    add_special_tokens: bool = True


def _check_generation_prompt(data):
    """upstream's rule: only an explicit add_generation_prompt=true conflicts (when it is
    omitted, continue_final_message turns the generation prompt off)."""
    if isinstance(data, dict) and data.get("continue_final_message") \
            and data.get("add_generation_prompt"):
        raise ParamError("Cannot set both `continue_final_message` and "
                         "`add_generation_prompt` to True.", "continue_final_message")
    return data


class TextContentPart(RequestModel):
    type: str
    text: Optional[str] = None


class FunctionCallParam(RequestModel):
    name: str
    arguments: Optional[Union[str, Dict[str, Any]]] = None    # OpenAI sends a JSON string


class ToolCallParam(RequestModel):
    """A call in an earlier assistant message."""
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(RequestModel):
    role: str
    content: Optional[Union[str, List[TextContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCallParam]] = None     # role "assistant"
    tool_call_id: Optional[str] = None                   # role "tool"


class FunctionDefinition(RequestModel):
    name: str
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None          # a JSON schema


class ChatTool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: List[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[List[ChatTool]] = None
    # None: "auto" with tools, else "none" (upstream's defaults); tool_use.py has the rules
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    add_special_tokens: bool = False
    chat_template: Optional[str] = None
    include_reasoning: bool = True     # false: no reasoning_content (--reasoning-parser)

    @model_validator(mode="before")
    @classmethod
    def _check_generation_prompt(cls, data):
        return _check_generation_prompt(data)


# ---- completion responses -----------------------------------------------------------------------
class CompletionLogprobs(ResponseModel):
    text_offset: List[int] = Field(default_factory=list)
    token_logprobs: List[Optional[float]] = Field(default_factory=list)
    tokens: List[str] = Field(default_factory=list)
    top_logprobs: List[Optional[Dict[str, float]]] = Field(default_factory=list)


class PromptLogprob(ResponseModel):
    """upstream's Logprob as JSON: one entry of a prompt position's {token id: entry} dict."""
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


PromptLogprobs = List[Optional[Dict[int, PromptLogprob]]]   # None for the first prompt token


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_logprobs: Optional[PromptLogprobs] = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: List[CompletionChoice]
    service_tier: Optional[str] = None
    system_fingerprint: Optional[str] = None     # fingerprint.py
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


class FunctionCall(ResponseModel):
    name: str
    arguments: str            # JSON text, as the model wrote it


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(ResponseModel):
    role: str = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None
    # with --reasoning-parser only: the reasoning (null when there is none); without the flag
    # the key is absent
    reasoning_content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _drop_absent_fields(self, handler):
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        if "reasoning_content" not in self.model_fields_set:
            data.pop("reasoning_content", None)
        return data


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
    service_tier: Optional[str] = None
    system_fingerprint: Optional[str] = None     # fingerprint.py
    usage: UsageInfo
    prompt_logprobs: Optional[PromptLogprobs] = None


class DeltaFunctionCall(ResponseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(ResponseModel):
    """The first delta of a call has id, type and function.name; later ones add arguments."""
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None


class DeltaMessage(ResponseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None     # --reasoning-parser; sent only when non-empty
    tool_calls: Optional[List[DeltaToolCall]] = None


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
    return_token_strs: Optional[bool] = False


class TokenizeChatRequest(RequestModel):
    model: Optional[str] = None
    messages: List[ChatMessage] = Field(..., min_length=1)
    tools: Optional[List[ChatTool]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: Optional[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _check_generation_prompt(cls, data):
        return _check_generation_prompt(data)


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: List[int]
    token_strs: Optional[List[str]] = None


class TokenizerInfoResponse(BaseModel):
    """The tokenizer's configuration (as tokenizer_config.json has it) and its class."""
    model_config = ConfigDict(extra="allow")
    tokenizer_class: str


class DetokenizeRequest(RequestModel):
    model: Optional[str] = None
    tokens: List[int]


class DetokenizeResponse(ResponseModel):
    prompt: str


class VersionResponse(ResponseModel):
    version: str
