"""vLLM fork with vToken: token-level virtualization of the paged KV cache."""
__version__ = "0.1.0"

from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.engine.async_llm_engine import AsyncLLMEngine
from vllm.engine.llm_engine import LLMEngine
from vllm.entrypoints.llm import LLM
from vllm.inputs import TextPrompt, TokensPrompt
from vllm.kv_eviction_params import KVEvictionParams
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "EngineArgs", "AsyncEngineArgs", "SamplingParams",
           "RequestOutputKind", "KVEvictionParams", "RequestOutput", "CompletionOutput",
           "TextPrompt", "TokensPrompt", "__version__"]
