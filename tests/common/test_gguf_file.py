"""common.gguf_file against gguf-py's reference reader: the same metadata, the same tensors
(names, kinds, shapes, bytes), on the default model's file and on a file holding every
metadata value type; damaged files refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from common.gguf_file import GGUFFile
from common.model_files import ModelLoadError, find_default_model


def _reference_value(field: Any) -> Any:
    """A GGUFReader field as a Python value (strings decoded, arrays as lists)."""
    def one(part: Any, kind: Any) -> Any:
        if kind == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part[0].item()

    if field.types[0] == gguf.GGUFValueType.ARRAY:
        if len(field.types) > 2:  # an array of arrays: GGUFReader keeps no per-item grouping
            return None
        return [one(field.parts[i], field.types[-1]) for i in field.data]
    return one(field.parts[field.data[0]], field.types[0])


def _assert_same_as_reference(path: Path) -> GGUFFile:
    ours, reference = GGUFFile(path), gguf.GGUFReader(path)
    expected = {
        name: value for name, field in reference.fields.items()
        if not name.startswith("GGUF.") and (value := _reference_value(field)) is not None
    }
    got = {name: value for name, value in ours.metadata.items() if name in expected}
    assert got == expected
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert mine.ggml_type == theirs.tensor_type
        assert mine.dims == tuple(int(d) for d in theirs.shape)
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data)
    assert ours.data_offset == reference.data_offset
    return ours


def test_the_default_model_reads_as_the_reference_reader_reads_it() -> None:
    ours = _assert_same_as_reference(find_default_model())
    assert ours.metadata["general.architecture"] == "llama"
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    kinds = {t.kind for t in ours.tensors}
    assert {"Q4_1", "Q8_0"} <= kinds


def _write_every_kind(path: Path, alignment: int | None = None) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 250)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -300)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.5)
    writer.add_uint64("t.u64", 2**60)
    writer.add_int64("t.i64", -(2**60))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.strings", ["a", "", "ü", "a b"])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.25, -1.5])
    rng = np.random.default_rng(0)
    writer.add_tensor("plain.f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("plain.f16", rng.standard_normal((2, 7)).astype(np.float16))
    for kind in (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0):
        q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), kind)
        writer.add_tensor(f"quant.{kind.name}", q, raw_shape=q.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_kind_reads_as_written(
    tmp_path: Path, alignment: int | None
) -> None:
    path = tmp_path / "kinds.gguf"
    _write_every_kind(path, alignment)
    ours = _assert_same_as_reference(path)
    meta = ours.metadata
    assert (meta["t.u8"], meta["t.i8"], meta["t.i64"], meta["t.bool"]) == (250, -7, -(2**60), True)
    assert meta["t.str"] == "héllo ✓" and meta["t.strings"] == ["a", "", "ü", "a b"]
    assert meta["t.ints"] == [1, -2, 3] and meta["t.floats"] == [0.25, -1.5]
    by_name = {t.name: t for t in ours.tensors}
    assert by_name["plain.f32"].shape == (3, 5) and by_name["plain.f16"].data.dtype == np.float16
    q4 = by_name["quant.Q4_1"]
    assert q4.shape == (4, 64) and q4.data.shape == (4, 2 * 20)  # two 32-value blocks of 20 B
    assert not q4.data.flags.writeable


def test_damaged_files_are_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "kinds.gguf"
    _write_every_kind(path)
    whole = path.read_bytes()
    (tmp_path / "magic.gguf").write_bytes(b"GGML" + whole[4:])
    with pytest.raises(ModelLoadError, match=r"magic\.gguf: not a readable GGUF file \(it does not"):
        GGUFFile(tmp_path / "magic.gguf")
    (tmp_path / "header.gguf").write_bytes(whole[:200])
    with pytest.raises(ModelLoadError, match=r"header\.gguf: not a readable GGUF file"):
        GGUFFile(tmp_path / "header.gguf")
    (tmp_path / "data.gguf").write_bytes(whole[:-100])  # into the last tensor (272 bytes)
    with pytest.raises(ModelLoadError, match=r"data\.gguf: tensor quant\.Q8_0 runs past the end"):
        GGUFFile(tmp_path / "data.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"empty\.gguf: not a readable GGUF file"):
        GGUFFile(tmp_path / "empty.gguf")
