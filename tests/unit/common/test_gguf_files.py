"""`FastGGUFReader` reads what `gguf.GGUFReader` reads, field by field, part by part and
tensor by tensor: on files written here with every value type (both byte orders) and on
SmolLM2's file; `reading_gguf_once()` hands every opener one reader per file, then lets go."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFWriter

from llmserve.gguf_files import FastGGUFReader, open_gguf, reading_gguf_once
from llmserve.model_spec import resolve_model


def _write(path: Path, endianess: GGUFEndian = GGUFEndian.LITTLE) -> Path:
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, "llama", endianess=endianess)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -3)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1.5)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", -2.25)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "ünïcödé 日本語")
    writer.add_string("t.empty_str", "")
    writer.add_array("t.strings", ["a", "", "bc", "<|im_end|>", "🙂" * 40] * 50)
    writer.add_array("t.ints", list(range(-500, 500)))
    writer.add_array("t.floats", [0.5, -1.25, 3.0])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.nested", [[1, 2], [3, 4, 5]])
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((4, 7)).astype(np.float16))
    q8 = rng.integers(0, 256, (2, 34 * 2), dtype=np.uint8)  # 2 rows of 2 Q8_0 blocks
    writer.add_tensor("q8", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _assert_same(a: GGUFReader, b: GGUFReader) -> None:
    assert (a.byte_order, a.alignment, a.data_offset) == (b.byte_order, b.alignment, b.data_offset)
    assert list(a.fields) == list(b.fields)
    for name, fa in a.fields.items():
        fb = b.fields[name]
        assert (fa.offset, fa.name, fa.data, fa.types) == (fb.offset, fb.name, fb.data, fb.types)
        assert len(fa.parts) == len(fb.parts), name
        for pa, pb in zip(fa.parts, fb.parts, strict=True):
            assert (pa.dtype, pa.shape, pa.tobytes()) == (pb.dtype, pb.shape, pb.tobytes()), name
        assert fa.contents() == fb.contents(), name
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors, strict=True):
        assert (ta.tensor_type, ta.n_elements, ta.n_bytes, ta.data_offset) == (
            tb.tensor_type, tb.n_elements, tb.n_bytes, tb.data_offset,
        )  # fmt: skip
        assert ta.shape.tolist() == tb.shape.tolist()
        assert ta.data.dtype == tb.data.dtype and ta.data.shape == tb.data.shape
        assert np.array_equal(ta.data, tb.data), ta.name


@pytest.mark.parametrize("endianess", [GGUFEndian.LITTLE, GGUFEndian.BIG], ids=["little", "big"])
def test_a_file_with_every_value_type_reads_the_same(tmp_path: Path, endianess) -> None:
    path = _write(tmp_path / "all.gguf", endianess)
    library, fast = GGUFReader(path), FastGGUFReader(path)
    _assert_same(library, fast)
    assert fast.fields["t.strings"].contents()[:5] == ["a", "", "bc", "<|im_end|>", "🙂" * 40]
    assert fast.fields["t.ints"].contents() == list(range(-500, 500))
    assert fast.fields["t.nested"].contents() == library.fields["t.nested"].contents()
    assert fast.fields["t.u64"].contents() == 2**63 + 5
    if endianess == GGUFEndian.BIG:
        assert fast.byte_order == "S"  # read through the library's walk, swapped


def test_smollm2s_file_reads_the_same() -> None:
    source = resolve_model("smollm2")
    path = Path(source.path) / str(source.gguf_file)
    fast = FastGGUFReader(path)
    _assert_same(GGUFReader(path), fast)
    assert len(fast.fields["tokenizer.ggml.tokens"].contents()) == 49152


def test_inside_reading_gguf_once_every_opener_shares_one_reader(tmp_path: Path) -> None:
    first, second = _write(tmp_path / "a.gguf"), _write(tmp_path / "b.gguf")
    library_reader = gguf.GGUFReader
    assert open_gguf(first) is not open_gguf(first)  # outside: nothing is kept
    with reading_gguf_once():
        shared = gguf.GGUFReader(first)  # as transformers' loaders open it
        assert isinstance(shared, FastGGUFReader)
        with reading_gguf_once():  # nested: the same readers
            assert open_gguf(str(first)) is shared
        assert open_gguf(first) is shared
        assert open_gguf(second) is not shared
        st = first.stat()
        os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # the file on disk changed
        assert open_gguf(first) is not shared
    assert gguf.GGUFReader is library_reader
    assert open_gguf(second) is not open_gguf(second)


def test_the_memo_is_let_go_even_when_loading_fails(tmp_path: Path) -> None:
    library_reader = gguf.GGUFReader
    with pytest.raises(ValueError, match="GGUF magic"), reading_gguf_once():
        (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
        gguf.GGUFReader(tmp_path / "bad.gguf")
    assert gguf.GGUFReader is library_reader
