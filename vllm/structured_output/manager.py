"""StructuredOutputManager: compiles each distinct structured-output spec once, with xgrammar."""
import json
import re
import threading
from collections import OrderedDict
from typing import Hashable, List, Tuple

from vllm.sampling_params import StructuredOutputsParams
from vllm.structured_output.error import StructuredOutputError
from vllm.structured_output.grammar import SequenceGrammar

# "[08:28:32] /project/cpp/regex_converter.cc:94: Regex parsing error ..." -> "Regex parsing ..."
_XGR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_ANY_OBJECT = '{"type": "object"}'


class StructuredOutputManager:
    """Owns the xgrammar compiler, built on first use from the tokenizer and the model's vocab
    size (logits columns past the tokenizer's vocabulary are padding no grammar allows), and an
    LRU of compiled grammars keyed by (kind, normalized spec, disable_any_whitespace)."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 256):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.num_compiles = 0                      # cache misses that compiled
        self._compiler = None
        self._cache: "OrderedDict[Hashable, object]" = OrderedDict()
        self._lock = threading.Lock()              # validate() may come from the server's thread

    def validate(self, params: StructuredOutputsParams) -> None:
        """Compile (cached) or raise StructuredOutputError; adds no request."""
        self.compile(params)

    def new_grammar(self, params: StructuredOutputsParams) -> SequenceGrammar:
        return SequenceGrammar(self.compile(params))

    def compile(self, params: StructuredOutputsParams):
        key = _cache_key(params)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is None:
                compiled = self._compile(params, key[1])
                self.num_compiles += 1
                self._cache[key] = compiled
                if len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
        return compiled

    def _compile(self, params: StructuredOutputsParams, spec):
        kind = params.kind
        compiler = self._xgr_compiler(kind)
        any_ws = not params.disable_any_whitespace
        try:
            if kind == "json":
                return compiler.compile_json_schema(spec, any_whitespace=any_ws)
            if kind == "json_object":   # not strict: any properties, any values
                return compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=any_ws,
                                                    strict_mode=False)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(list(spec)))
            return compiler.compile_grammar(spec)
        except Exception as e:       # xgrammar reports every bad spec as a RuntimeError
            msg = _XGR_LOG_PREFIX.sub("", str(e).strip())
            raise StructuredOutputError(kind, f"invalid {kind} for structured outputs: "
                                              f"{msg}") from None

    def _xgr_compiler(self, kind: str):
        if self._compiler is None:
            if self.tokenizer is None:
                raise StructuredOutputError(kind, "structured outputs need the model's "
                                                  "tokenizer; this model has none")
            import xgrammar as xgr
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            # our LRU is the cache; xgrammar's own would grow without bound
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return self._compiler


def _cache_key(params: StructuredOutputsParams) -> Tuple[str, Hashable, bool]:
    kind = params.kind
    spec = getattr(params, kind)
    if kind == "json":     # key order kept: it is the order the output's properties follow
        obj = json.loads(spec) if isinstance(spec, str) else spec
        spec = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    elif kind == "choice":
        spec = tuple(spec)
    elif kind == "json_object":
        spec = None
    return kind, spec, params.disable_any_whitespace


def choice_grammar(choices: List[str]) -> str:
    """EBNF accepting exactly one of the strings: root ::= "a" | "b" | ..."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def _ebnf_literal(text: str) -> str:
    # printable ASCII stays (quote and backslash escaped); everything else as a \u / \U escape
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif " " <= ch <= "~":
            out.append(ch)
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return '"' + "".join(out) + '"'
