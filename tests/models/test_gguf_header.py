"""The struct-based GGUF header reader against gguf's own GGUFReader: same fields, same tensor
directory, same dequantized data for every supported type."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from mindie.model.gguf_header import read_header


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_string("general.name", "tiny ünïcode")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "<s>"])
    w.add_array("tokenizer.ggml.scores", [0.5, -1.0, 0.0])
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    rng = np.random.default_rng(0)
    for name, qtype in (("f32", gguf.GGMLQuantizationType.F32), ("f16", gguf.GGMLQuantizationType.F16),
                        ("q8", gguf.GGMLQuantizationType.Q8_0), ("q4", gguf.GGMLQuantizationType.Q4_0),
                        ("q41", gguf.GGMLQuantizationType.Q4_1)):
        data = rng.standard_normal((3, 64)).astype(np.float32)
        if qtype == gguf.GGMLQuantizationType.F16:
            data = data.astype(np.float16)
        elif qtype not in (gguf.GGMLQuantizationType.F32,):
            data = gguf.quants.quantize(data, qtype)
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_header_matches_gguf_reader(gguf_file):
    ours, theirs = read_header(gguf_file), gguf.GGUFReader(gguf_file)
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = field.contents()
        assert ours.fields[key] == (pytest.approx(expected) if isinstance(expected, (float, list)) and key.endswith(
            ("scores", "freq_base")) else expected), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert mine.qtype == ref.tensor_type
        got = gguf.quants.dequantize(ours.tensor_bytes(mine), ref.tensor_type)
        want = gguf.quants.dequantize(ref.data, ref.tensor_type)
        np.testing.assert_array_equal(np.asarray(got, dtype=np.float32).reshape(-1),
                                      np.asarray(want, dtype=np.float32).reshape(-1))


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ValueError, match="not a GGUF"):
        read_header(str(bad))
