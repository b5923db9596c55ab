"""vLLM fork with vToken: token-level virtualization of the paged KV cache."""
__version__ = "0.1.0"

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.llm_engine import LLMEngine
from vllm.entrypoints.llm import LLM
from vllm.kv_eviction_params import KVEvictionParams
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "KVEvictionParams", "RequestOutput",
           "CompletionOutput", "__version__"]
