"""Which files the model loader reads, and which token ids end a request, as upstream vLLM:

- safetensors: an index's weight_map names exactly the files and tensors read; without one,
  Mistral's consolidated*.safetensors is skipped beside other shards; no tensor is read twice;
- EOS: the tokenizer's eos_token_id plus generation_config.json's eos_token_id (int or list)
  each end a request (unless ignore_eos), and min_tokens masks all of them;
- the GGUF converter lists the EOS, EOT and EOM tokens in its generation_config.json.
"""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import build_tiny_model
from vllm import LLM, SamplingParams
from vllm.engine.llm_engine import generation_eos_token_ids
from vllm.model_executor import gguf_loader
from vllm.model_executor.model_loader import load_state_dict, safetensors_files

INDEX = "model.safetensors.index.json"
PROMPT = {"prompt_token_ids": [5, 17, 42, 99, 7, 250, 31]}
MAX_NEW = 24


@pytest.fixture(scope="module")
def single_dir(tmp_path_factory):
    """A tiny random Llama saved the usual way: one model.safetensors."""
    return Path(build_tiny_model(str(tmp_path_factory.mktemp("single") / "llama")))


@pytest.fixture(scope="module")
def sharded_dir(single_dir, tmp_path_factory):
    """The same weights in several shards with an index, plus two files the index does not name:
    consolidated.safetensors (Mistral's names and one HF name, other values) and a stray shard
    that repeats an indexed tensor with other values."""
    import transformers
    out = tmp_path_factory.mktemp("sharded") / "llama"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(single_dir),
                                                             dtype=torch.float32)
    model.save_pretrained(str(out), max_shard_size="100KB")
    for f in single_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    save_file({"tok_embeddings.weight": torch.full((512, 64), 7.0),
               "model.norm.weight": torch.full((64,), 7.0)}, str(out / "consolidated.safetensors"))
    save_file({"model.norm.weight": torch.full((64,), -3.0),
               "stray.weight": torch.ones(4)}, str(out / "zz-stray.safetensors"))
    return out


def _shard_tensors(model_dir: Path):
    """Every tensor of the index's shards, read directly."""
    weight_map = json.loads((model_dir / INDEX).read_text())["weight_map"]
    tensors = {}
    for file in set(weight_map.values()):
        tensors.update(load_file(str(model_dir / file)))
    return weight_map, tensors


def _greedy(model_dir, **params):
    llm = LLM(str(model_dir), num_gpu_blocks_override=64)
    p = SamplingParams(temperature=0, max_tokens=MAX_NEW, **params)
    return llm.generate(PROMPT, p, use_tqdm=False)[0].outputs[0], llm


# ---- safetensors selection ---------------------------------------------------------------------
def test_index_names_exactly_the_tensors_read(sharded_dir):
    weight_map, shards = _shard_tensors(sharded_dir)
    assert len(set(weight_map.values())) > 1          # really sharded
    files = safetensors_files(str(sharded_dir))
    assert sorted(Path(f).name for f in files) == sorted(set(weight_map.values()))
    got = load_state_dict(str(sharded_dir))
    assert set(got) == set(weight_map) == set(shards)
    for name, t in got.items():
        assert torch.equal(t, shards[name]), name
    assert not torch.equal(got["model.norm.weight"], torch.full((64,), 7.0))


def test_consolidated_skipped_without_an_index(sharded_dir, tmp_path):
    weight_map, shards = _shard_tensors(sharded_dir)
    for f in set(weight_map.values()) | {"consolidated.safetensors"}:
        shutil.copy(sharded_dir / f, tmp_path / f)
    files = safetensors_files(str(tmp_path))
    assert sorted(Path(f).name for f in files) == sorted(set(weight_map.values()))
    got = load_state_dict(str(tmp_path))
    assert set(got) == set(shards)
    assert torch.equal(got["model.norm.weight"], shards["model.norm.weight"])
    # consolidated alone is the model
    (tmp_path / "alone").mkdir()
    shutil.copy(sharded_dir / "consolidated.safetensors", tmp_path / "alone")
    assert set(load_state_dict(str(tmp_path / "alone"))) == {"tok_embeddings.weight",
                                                            "model.norm.weight"}


def test_a_tensor_in_two_files_is_an_error(sharded_dir, tmp_path):
    weight_map, _ = _shard_tensors(sharded_dir)
    for f in set(weight_map.values()) | {"zz-stray.safetensors"}:
        shutil.copy(sharded_dir / f, tmp_path / f)
    with pytest.raises(ValueError, match="model.norm.weight is in more than one file"):
        load_state_dict(str(tmp_path))


def test_engine_on_the_sharded_folder_matches_the_single_file(single_dir, sharded_dir):
    ref, _ = _greedy(single_dir, ignore_eos=True)
    got, _ = _greedy(sharded_dir, ignore_eos=True)
    assert got.token_ids == ref.token_ids and len(ref.token_ids) == MAX_NEW


# ---- EOS ids from generation_config.json -------------------------------------------------------
def _set_generation_eos(model_dir: Path, eos) -> None:
    path = model_dir / "generation_config.json"
    gen = json.loads(path.read_text())
    gen["eos_token_id"] = eos
    path.write_text(json.dumps(gen))


def test_generation_eos_token_ids_reads_int_list_and_model_config(tmp_path):
    import transformers
    cfg = transformers.LlamaConfig(eos_token_id=[5, 6])
    cfg.save_pretrained(tmp_path)
    assert generation_eos_token_ids(str(tmp_path)) == frozenset()      # no file, no config
    assert generation_eos_token_ids(str(tmp_path), cfg) == {5, 6}      # the model config's
    transformers.GenerationConfig(eos_token_id=9).save_pretrained(tmp_path)
    assert generation_eos_token_ids(str(tmp_path), cfg) == {9}         # the file wins
    transformers.GenerationConfig(eos_token_id=[9, 11]).save_pretrained(tmp_path)
    assert generation_eos_token_ids(str(tmp_path), cfg) == {9, 11}


@pytest.fixture(scope="module")
def eos_case(tmp_path_factory):
    """A tiny model whose generation_config.json adds an EOS id that greedy decoding of PROMPT
    first produces at output step `step` -> (model dir, the ignore_eos outputs, step, id)."""
    model_dir = Path(build_tiny_model(str(tmp_path_factory.mktemp("eos") / "llama")))
    ref, llm = _greedy(model_dir, ignore_eos=True)
    eos = llm.get_tokenizer().eos_token_id
    ids = ref.token_ids
    step = next(k for k in range(2, len(ids) - 2)
                if ids[k] not in ids[:k] and eos not in ids[:k + 1])
    _set_generation_eos(model_dir, [eos, ids[step]])
    return model_dir, ref, step, ids[step]


def test_generation_config_eos_stops_the_request(eos_case):
    model_dir, ref, step, token = eos_case
    out, llm = _greedy(model_dir)
    assert llm.llm_engine.eos_token_ids == {llm.get_tokenizer().eos_token_id, token}
    assert out.token_ids == ref.token_ids[:step + 1]
    # as upstream: an EOS id beside the tokenizer's acts as a stop token id
    assert out.finish_reason == "stop" and out.stop_reason == token
    assert out.text == llm.get_tokenizer().decode(ref.token_ids[:step])


def test_ignore_eos_runs_past_generation_config_eos(eos_case):
    model_dir, ref, step, token = eos_case
    out, _ = _greedy(model_dir, ignore_eos=True)
    assert out.token_ids == ref.token_ids and out.finish_reason == "length"


def test_min_tokens_masks_generation_config_eos(eos_case):
    model_dir, ref, step, token = eos_case
    out, _ = _greedy(model_dir, min_tokens=step + 1)
    assert out.token_ids[:step] == ref.token_ids[:step]     # same up to the masked step
    assert token not in out.token_ids[:step + 1]
    assert len(out.token_ids) > step + 1 or out.finish_reason == "length"


# ---- GGUF converter: EOS, EOT and EOM in generation_config.json ----------------------------------
class _Reader:
    """A GGUFFile's get(key, default) over the given token ids"""
    def __init__(self, **ids):
        self.get = {f"tokenizer.ggml.{k}_token_id": v for k, v in ids.items()}.get


@pytest.mark.parametrize("ids,want", [
    (dict(eos=2, eot=7, eom=8), [2, 7, 8]),
    (dict(eos=2, eot=7), [2, 7]),
    (dict(eos=7, eot=7), 7),                 # one distinct id: an int
    (dict(eos=0), 0),
])
def test_gguf_generation_config_lists_eos_and_eot(tmp_path, ids, want):
    from transformers import LlamaConfig
    config = LlamaConfig(bos_token_id=1, eos_token_id=ids["eos"])
    eos_ids = gguf_loader._generation_eos_ids(_Reader(**ids), config)
    gguf_loader._save_generation_config(config, eos_ids, tmp_path)
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == want and gen["bos_token_id"] == 1


def test_gguf_without_eos_keys_keeps_the_config_eos(tmp_path):
    from transformers import LlamaConfig
    eos_ids = gguf_loader._generation_eos_ids(_Reader(), LlamaConfig(eos_token_id=5))
    assert eos_ids == [5]


def test_gguf_conversion_writes_eot_and_eom_as_eos(tmp_path, monkeypatch):
    """A real GGUF (tests/gguf_kquants.py's) with EOT and EOM tokens, converted."""
    gguf = pytest.importorskip("gguf")
    from tests.gguf_kquants import write_llama_gguf
    add_eos = gguf.GGUFWriter.add_eos_token_id

    def add_eos_eot_eom(writer, token_id):
        add_eos(writer, token_id)
        writer.add_eot_token_id(298)
        writer.add_eom_token_id(299)
    monkeypatch.setattr(gguf.GGUFWriter, "add_eos_token_id", add_eos_eot_eom)
    path = write_llama_gguf(str(tmp_path / "eot.gguf"))
    out = Path(gguf_loader.convert_gguf(path, cache_dir=str(tmp_path / "cache")))
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 298, 299]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 2
    assert generation_eos_token_ids(str(out)) == {2, 298, 299}
