"""LLM: the offline API, as upstream: LLM(model=...).generate(prompts, SamplingParams(...))."""
import itertools
from typing import Dict, List, Optional, Sequence as Seq, Union

from tqdm import tqdm

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.llm_engine import LLMEngine, PromptType
from vllm.kv_eviction_params import KVEvictionParams
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: Optional[str] = None, **kwargs):
        """kwargs: EngineArgs' fields (the engine flags, e.g. kv_eviction_policy="h2o",
        enable_sleep_mode=True)."""
        self.llm_engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: Union[PromptType, Seq[PromptType]],
                 sampling_params: Union[SamplingParams, Seq[SamplingParams], None] = None,
                 use_tqdm: bool = True,
                 kv_eviction: Union[KVEvictionParams, Seq[Optional[KVEvictionParams]],
                                    None] = None) -> List[RequestOutput]:
        """kv_eviction: eviction settings for every prompt, or one (or None) per prompt."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = _per_prompt(sampling_params or SamplingParams(), SamplingParams, prompts,
                             "sampling params")
        evictions = _per_prompt(kv_eviction, KVEvictionParams, prompts, "kv_eviction settings")
        ids = []
        try:
            for prompt, p, ev in zip(prompts, params, evictions):
                ids.append(str(next(self._ids)))
                self.llm_engine.add_request(ids[-1], prompt, p, kv_eviction=ev)
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: Union[List[Dict], List[List[Dict]]],
             sampling_params: Union[SamplingParams, Seq[SamplingParams], None] = None,
             use_tqdm: bool = True, chat_template: Optional[str] = None,
             add_generation_prompt: bool = True,
             kv_eviction: Union[KVEvictionParams, Seq[Optional[KVEvictionParams]],
                                None] = None,
             tools: Optional[List[Dict]] = None,
             continue_final_message: bool = False) -> List[RequestOutput]:
        """tools: OpenAI-style function tools for templates that render them (e.g.
        examples/tool_chat_template_hermes.jinja); the output is not parsed for calls.
        continue_final_message: the prompt ends inside the last (assistant) message."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, chat_template, add_generation_prompt, tools=tools,
                                            continue_final_message=continue_final_message)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, kv_eviction)

    def apply_chat_template(self, messages: List[Dict], chat_template: Optional[str] = None,
                            add_generation_prompt: bool = True,
                            tools: Optional[List[Dict]] = None,
                            continue_final_message: bool = False) -> Dict:
        if continue_final_message and add_generation_prompt:   # upstream's rule and wording
            raise ValueError("Cannot set both `continue_final_message` and "
                             "`add_generation_prompt` to True.")
        tok = self.get_tokenizer()
        text = tok.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                       add_generation_prompt=add_generation_prompt, tools=tools,
                                       continue_final_message=continue_final_message)
        return {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}

    def sleep(self, level: int = 1) -> None:
        """Release the KV cache (level 1; its content and the prefix cache are lost) or the KV
        cache and the weights (level 2), on every rank, until wake_up(). Needs
        enable_sleep_mode=True; generate() raises EngineSleepingError meanwhile."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: Optional[List[str]] = None) -> None:
        """Restore what sleep() released: the weights reloaded from the model directory as
        loaded the first time, the KV pool at its size. tags: "weights", "kv_cache" (None:
        both), to restore one before the other."""
        self.llm_engine.wake_up(tags)

    def get_kv_stats(self) -> Dict[str, float]:
        return self.llm_engine.get_kv_stats()

    def get_engine_info(self) -> Dict:
        return self.llm_engine.get_engine_info()

    def _run(self, ids: List[str], use_tqdm: bool) -> List[RequestOutput]:
        engine = self.llm_engine
        done: Dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while len(done) < len(ids):
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]


def _per_prompt(value, single_type, prompts, what: str) -> list:
    """One value for every prompt, or a list with one per prompt."""
    if value is None or isinstance(value, single_type):
        return [value] * len(prompts)
    if len(value) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(value)} {what}")
    return list(value)
