"""tokenizer_config(): the body of GET /tokenizer_info, upstream's TokenizerInfo: the loaded
tokenizer's init kwargs as tokenizer_config.json has them, without file paths, plus
tokenizer_class (and --chat-template when given).

Special tokens are their text; added_tokens_decoder keeps every added token whole, as
tokenizer_config.json writes it:
    {"0": {"content": "<unk>", "lstrip": false, "normalized": false, "rstrip": false,
           "single_word": false, "special": true}, ...}
"""
import json
from typing import Optional

ADDED_TOKEN_FIELDS = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
_PATHS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


def tokenizer_config(tokenizer, chat_template: Optional[str]) -> dict:
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    for key in _PATHS:
        config.pop(key, None)
    added = config.pop("added_tokens_decoder", None)
    config = _jsonable(config)
    if added is not None:
        config["added_tokens_decoder"] = {str(i): _added_token(t) for i, t in added.items()}
    config["tokenizer_class"] = type(tokenizer).__name__
    if chat_template:
        config["chat_template"] = chat_template
    return config


def _added_token(token) -> dict:
    if isinstance(token, dict):
        return {k: token[k] for k in ADDED_TOKEN_FIELDS if k in token}
    return {k: getattr(token, k) for k in ADDED_TOKEN_FIELDS}


def _jsonable(obj):
    if hasattr(obj, "content"):          # AddedToken: its text
        return obj.content
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    try:
        json.dumps(obj)
        return obj
    except (TypeError, ValueError):
        return str(obj)
