"""GGUFFile, the engine's GGUF metadata reader, against gguf-py's GGUFReader: the same keys and
values (every value type, arrays of numbers, strings and arrays), the same tensors (name, type,
GGML shape, data view's dtype, shape and bytes), on files gguf-py's writer makes and on the
default model; malformed files are a ValueError."""
import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T, GGUFValueType as V  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from vllm.model_executor.gguf_file import GGUFFile  # noqa: E402


def _assert_same_as_gguf_py(path, structured=()):
    """structured: keys holding arrays of arrays, which gguf-py's contents() flattens"""
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(ours.keys()) == keys
    for k in set(keys) - set(structured):
        vtype, etype = ours.value_type(k)
        assert vtype == ref.fields[k].types[0], k
        assert etype == (ref.fields[k].types[-1] if vtype == V.ARRAY else None), k
        want = ref.fields[k].contents()
        got = ours.get(k)
        assert got == want and type(got) is type(want), k
    assert ours.get("no.such.key", 7) == 7
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type, a.name
        assert a.shape == tuple(int(d) for d in b.shape), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(np.asarray(a.data).view(np.uint8),
                              np.asarray(b.data).view(np.uint8)), a.name
    return ours


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A GGUF with every value type, string and nested arrays, and float, integer and block
    tensors (rows of 64: two Q8_0 blocks; Q6_K rows of 256, random bytes)."""
    path = str(tmp_path_factory.mktemp("gguf-file") / "all-types.gguf")
    w = gguf.GGUFWriter(path, "llama")
    scalars = [(V.UINT8, 200), (V.INT8, -100), (V.UINT16, 60000), (V.INT16, -30000),
               (V.UINT32, 4_000_000_000), (V.INT32, -2_000_000_000), (V.FLOAT32, 0.1),
               (V.BOOL, True), (V.UINT64, 2 ** 63 + 5), (V.INT64, -(2 ** 62)),
               (V.FLOAT64, 1e-300)]
    for vtype, value in scalars:
        w.add_key_value(f"test.{vtype.name.lower()}", value, vtype)
    w.add_key_value("test.string", "héllo wörld", V.STRING)
    w.add_key_value("test.empty_string", "", V.STRING)
    w.add_key_value("test.ints", [1, -2, 3], V.ARRAY, V.INT32)
    w.add_key_value("test.floats", [0.5, 0.25, 1e9], V.ARRAY, V.FLOAT32)
    w.add_key_value("test.bools", [True, False, True], V.ARRAY, V.BOOL)
    w.add_key_value("tokenizer.ggml.tokens", ["<s>", "</s>", "a b", "ü", ""], V.ARRAY, V.STRING)
    w.add_key_value("test.nested", [[1, 2], [3]], V.ARRAY, V.ARRAY)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 64)).astype(np.float16))
    w.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(3, 4))
    w.add_tensor("q8", quantize(rng.standard_normal((5, 64)).astype(np.float32), T.Q8_0),
                 raw_dtype=T.Q8_0)
    w.add_tensor("experts", quantize(rng.standard_normal((2, 3, 64)).astype(np.float32), T.Q4_0),
                 raw_dtype=T.Q4_0)
    w.add_tensor("q6k", rng.integers(0, 256, (2, 210), dtype=np.uint8), raw_dtype=T.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_value_type_and_tensor_reads_as_gguf_py_reads_it(written):
    f = _assert_same_as_gguf_py(written, structured=["test.nested"])
    assert f.get("tokenizer.ggml.tokens") == ["<s>", "</s>", "a b", "ü", ""]
    assert f.get("test.nested") == [[1, 2], [3]]
    assert f.value_type("test.nested") == (V.ARRAY, V.ARRAY)
    experts = next(t for t in f.tensors if t.name == "experts")
    assert experts.shape == (64, 3, 2) and experts.data.shape == (2, 3, 2 * 18)


def test_the_default_model_reads_as_gguf_py_reads_it():
    from vllm.model_executor import gguf_loader
    try:
        path = gguf_loader.find_default_model_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    f = _assert_same_as_gguf_py(path)
    assert len(f.get("tokenizer.ggml.tokens")) == 49152


def _corrupt(src, dst, at, data):
    blob = bytearray(open(src, "rb").read())
    blob[at:at + len(data)] = data
    open(dst, "wb").write(bytes(blob))
    return str(dst)


def test_malformed_files_are_value_errors(written, tmp_path):
    with pytest.raises(ValueError, match="not a GGUF"):
        GGUFFile(_corrupt(written, tmp_path / "magic.gguf", 0, b"GGUX"))
    with pytest.raises(ValueError, match="big-endian"):
        GGUFFile(_corrupt(written, tmp_path / "be.gguf", 4, struct.pack(">I", 3)))
    with pytest.raises(ValueError, match="version 9"):
        GGUFFile(_corrupt(written, tmp_path / "v9.gguf", 4, struct.pack("<I", 9)))
    blob = open(written, "rb").read()
    short = tmp_path / "short.gguf"
    short.write_bytes(blob[:-100])
    with pytest.raises(ValueError, match="past the end"):
        GGUFFile(str(short))
    short.write_bytes(blob[:200])           # cut inside the metadata
    with pytest.raises(ValueError, match="truncated or corrupt"):
        GGUFFile(str(short))
