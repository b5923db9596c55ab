"""Where the values of a JSON object (or array of objects) lie in text that may still be growing.

Tool calls stream as the model writes them, so the scanner reports raw spans, not parsed
values: a call's arguments are sent as the exact text the model produced, and text that is
only a prefix of the final value is a prefix of the final arguments too. Malformed text raises
ValueError; text that merely stops early is reported as incomplete.

    '{"name": "f", "arguments": {"a": 1'  ->  fields {"name": (9, 12), "arguments": (27, None)}
"""
import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

_WS = " \t\n\r"
_SCALAR_END = ",}] \t\n\r"


@dataclass
class PartialObject:
    """fields: key -> (value start, value end or None while the value is incomplete);
    end: the index after the closing brace, None while the object is open."""
    fields: Dict[str, Tuple[int, Optional[int]]] = field(default_factory=dict)
    end: Optional[int] = None

    @property
    def done(self) -> bool:
        return self.end is not None

    def text(self, s: str, key: str) -> Optional[str]:
        """The raw text of key's value so far ("" before it starts), None if key is absent."""
        if key not in self.fields:
            return None
        start, end = self.fields[key]
        return s[start:len(s) if end is None else end]

    def string(self, s: str, key: str) -> Optional[str]:
        """key's value once it is a complete JSON string, else None."""
        start, end = self.fields.get(key, (0, None))
        if end is None or s[start] != '"':
            return None
        return json.loads(s[start:end])


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def string_end(s: str, i: int) -> Optional[int]:
    """s[i] is '"': the index after the closing quote, None if s ends first."""
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
        elif s[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def value_end(s: str, i: int) -> Optional[int]:
    """The index after the JSON value that starts at s[i], None if s ends before it does.
    Brackets are matched, not validated: json.loads has the last word on complete text."""
    if i >= len(s):
        return None
    if s[i] == '"':
        return string_end(s, i)
    if s[i] in "{[":
        depth, j = 0, i
        while j < len(s):
            if s[j] == '"':
                j = string_end(s, j)
                if j is None:
                    return None
                continue
            if s[j] in "{[":
                depth += 1
            elif s[j] in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    if s[i] in _SCALAR_END:
        raise ValueError(f"expected a JSON value at {i}")
    j = i
    while j < len(s) and s[j] not in _SCALAR_END:
        j += 1
    return None if j == len(s) else j     # a number at the end may still grow


def scan_object(s: str, i: int = 0) -> PartialObject:
    """The object starting at the first non-blank character at or after i; text after its
    closing brace is ignored."""
    obj = PartialObject()
    i = skip_ws(s, i)
    if i == len(s):
        return obj
    if s[i] != "{":
        raise ValueError(f"expected '{{' at {i}")
    i += 1
    while True:
        i = skip_ws(s, i)
        if i == len(s):
            return obj
        if s[i] == "}":
            obj.end = i + 1
            return obj
        if s[i] == ",":
            i += 1
            continue
        if s[i] != '"':
            raise ValueError(f"expected a key at {i}")
        key_end = string_end(s, i)
        if key_end is None:
            return obj
        key = json.loads(s[i:key_end])
        i = skip_ws(s, key_end)
        if i == len(s):
            return obj
        if s[i] != ":":
            raise ValueError(f"expected ':' at {i}")
        i = skip_ws(s, i + 1)
        end = value_end(s, i)
        obj.fields[key] = (i, end)
        if end is None:
            return obj
        i = end


def scan_object_array(s: str) -> Tuple[List[PartialObject], bool]:
    """A JSON array of objects: (the objects so far, whether the array is closed)."""
    items: List[PartialObject] = []
    i = skip_ws(s, 0)
    if i == len(s):
        return items, False
    if s[i] != "[":
        raise ValueError("expected '['")
    i += 1
    while True:
        i = skip_ws(s, i)
        if i == len(s):
            return items, False
        if s[i] == "]":
            return items, True
        if s[i] == ",":
            i += 1
            continue
        obj = scan_object(s, i)
        items.append(obj)
        if not obj.done:
            return items, False
        i = obj.end
