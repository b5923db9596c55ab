"""grammar_after_reasoning: a structured-output constraint that starts where the reasoning ends.

The engine's grammar follows every output token from the first, so the reasoning is made part
of the grammar: free text up to the end tag, then the client's constraint. For deepseek_r1 and
a JSON schema the grammar is

    root ::= reasoning | reasoning "</think>" [\\n]* <the schema's grammar>

where `reasoning` is any text without "</think>"; qwen3's reasoning must open with "<think>"
and its content may also stand alone. An output may end inside its reasoning (no content), as
upstream's unconstrained reasoning may.
"""
from vllm.sampling_params import StructuredOutputsParams
from vllm.structured_output.manager import choice_grammar

_REASONING = "reasoning_text"


def grammar_after_reasoning(params: StructuredOutputsParams, start: str, end: str,
                            content_alone: bool) -> StructuredOutputsParams:
    """start: the EBNF that opens the reasoning ("" when it opens implicitly); end: the tag that
    closes it; content_alone: the content may also come without any reasoning."""
    import xgrammar as xgr
    rules = text_without(end, _REASONING)
    unfinished = xgr.Grammar.from_ebnf(f"root ::= {start} {_REASONING}\n{rules}")
    finished = xgr.Grammar.from_ebnf(f"root ::= {start} {_REASONING} {_literal(end)} [\\n]*\n"
                                     f"{rules}")
    content = _content_grammar(params)
    options = [unfinished, xgr.Grammar.concat(finished, content)]
    if content_alone:
        options.append(content)
    return StructuredOutputsParams(grammar=str(xgr.Grammar.union(*options)))


def text_without(tag: str, name: str) -> str:
    """EBNF rules where `name` matches any text in which `tag` does not occur. The tag's first
    character must not recur in it ("</think>"), so a broken partial match can restart only at
    that character. With tag "</think>":

        name         ::= ([^<] | "<" name_restart* name_diverge)* ("<" name_restart* name_partial)?
        name_partial ::= "" | "/" | "/t" | ... | "/think"        a proper prefix of the tag's rest
        name_restart ::= name_partial "<"                         ... broken by a new "<"
        name_diverge ::= [^/<] | "/" [^t<] | ... | "/think" [^><]  ... broken by another character
    """
    first, rest = tag[0], tag[1:]
    assert rest and first not in rest, f"{tag!r}: its first character recurs"
    prefixes = [rest[:k] for k in range(len(rest))]
    partial = " | ".join(_literal(p) for p in prefixes)
    diverge = " | ".join(f"{_literal(p) if p else ''} [^{_in_class(rest[k])}{_in_class(first)}]"
                         for k, p in enumerate(prefixes))
    lt = _literal(first)
    return (f"{name} ::= ([^{_in_class(first)}] | {lt} {name}_restart* {name}_diverge)* "
            f"({lt} {name}_restart* {name}_partial)?\n"
            f"{name}_partial ::= {partial}\n"
            f"{name}_restart ::= {name}_partial {lt}\n"
            f"{name}_diverge ::= {diverge}\n")


def _content_grammar(params: StructuredOutputsParams):
    """The constraint as an xgrammar Grammar, as the engine's StructuredOutputManager compiles
    each kind."""
    import xgrammar as xgr
    kind, any_ws = params.kind, not params.disable_any_whitespace
    if kind == "json":
        return xgr.Grammar.from_json_schema(params.json, any_whitespace=any_ws)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_ws,
                                            strict_mode=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(params.regex)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_grammar(params.choice))
    return xgr.Grammar.from_ebnf(params.grammar)


def _literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _in_class(ch: str) -> str:
    return "\\" + ch if ch in "\\]^-[" else ch
