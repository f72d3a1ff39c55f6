"""The GGUF header reader (worker/weights/gguf_header.py) reads what gguf's own reader reads — every
scalar, every tensor's type, shape, offset and size — with a tokenizer's long arrays counted, not
kept, and refuses a file that is not one or is cut short.
"""

import gguf
import numpy as np
import pytest

from worker.weights.gguf import GGUFFile
from worker.weights.gguf_header import SMALL_ARRAY, SkippedArray, read_header


def write_gguf(path, alignment=None):
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -3000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.25)
    w.add_bool("t.bool", True)
    w.add_uint64("t.u64", 1 << 40)
    w.add_int64("t.i64", -(1 << 40))
    w.add_float64("t.f64", 1e-300)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.small", [1, 2, 3])
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}·é" * (i % 5) for i in range(5000)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(3000)])
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((40, 64), dtype=np.float32))
    q8 = rng.integers(0, 255, size=(8, 2 * 34), dtype=np.uint8)  # 8 rows of two Q8_0 blocks
    w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", rng.standard_normal(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_header_reads_as_ggufs_own_reader_reads_it(tmp_path, alignment):
    path = write_gguf(tmp_path / "m.gguf", alignment)
    fields, tensors = read_header(path)
    theirs = gguf.GGUFReader(str(path))
    assert list(tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        mine = tensors[t.name]
        assert (mine.tensor_type, mine.shape, mine.data_offset, mine.n_bytes, mine.n_elements) == (
            t.tensor_type,
            tuple(int(d) for d in t.shape),
            t.data_offset,
            t.n_bytes,
            t.n_elements,
        )
        assert path.read_bytes()[mine.data_offset : mine.data_offset + mine.n_bytes] == bytes(
            t.data.tobytes()
        )
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        if len(field.data) > SMALL_ARRAY:
            assert fields[key] == SkippedArray(fields[key].item_type, len(field.data))
        else:
            assert (
                fields[key] == pytest.approx(field.contents())
                if "f" in key
                else fields[key] == field.contents()
            ), key
    assert fields["t.str"] == "héllo ✓" and fields["t.small"] == [1, 2, 3]
    assert fields["tokenizer.ggml.tokens"].count == 5000


def test_a_file_cut_short_or_not_a_gguf_is_refused(tmp_path):
    data = write_gguf(tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-100])  # inside the last tensor
    with pytest.raises(ValueError, match="ends inside tensor"):
        read_header(tmp_path / "cut.gguf")
    (tmp_path / "header.gguf").write_bytes(data[:2000])  # inside the tokens
    with pytest.raises(Exception, match="unpack|ends inside|requires a buffer"):
        read_header(tmp_path / "header.gguf")
    (tmp_path / "text.gguf").write_text("not a model at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_header(tmp_path / "text.gguf")


def test_a_file_without_an_architecture_is_refused(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "llama")
    w.add_tensor("a", np.zeros(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert GGUFFile(tmp_path / "x.gguf").arch == "llama"
    raw = (
        (tmp_path / "x.gguf").read_bytes().replace(b"general.architecture", b"general.architecturX")
    )
    (tmp_path / "y.gguf").write_bytes(raw)
    with pytest.raises(ValueError, match="names no architecture"):
        GGUFFile(tmp_path / "y.gguf")
