"""target/gguf_file.py reads what gguf-py's GGUFReader reads: every metadata value and every
tensor (name, type, GGUF shape, the bytes as the same dtype and shape), on the shipped default
model and on a file written here with every value type, arrays, nested arrays and block types."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from specserve.core.errors import ModelLoadError
from specserve.engine.models import resolve_model_path
from specserve.target.gguf_file import GGUFFile


def _assert_same(path) -> None:
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    ref_keys = {k for k in ref.fields if not k.startswith("GGUF.")}  # the header, not metadata
    assert set(ours.fields) == ref_keys
    for key, value in ours.fields.items():
        want = ref.fields[key].contents()
        if value and isinstance(value, list) and isinstance(value[0], list):
            value = [x for inner in value for x in inner]  # gguf-py flattens nested arrays
        assert value == want and type(value) is type(want), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert a.tensor_type == b.tensor_type, a.name
        assert a.shape == tuple(int(x) for x in b.shape), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
        assert not a.data.flags.writeable  # a view of the read-only map, never a copy


def test_default_model_reads_as_gguf_py_reads_it():
    _assert_same(resolve_model_path(None))


def test_every_value_type_and_block_type(tmp_path):
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.25])
    w.add_array("t.strs", ["a", "", "日本", "x" * 300])
    w.add_array("t.nested", [[1, 2], [3]])  # read nested here, flat by gguf-py
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64), dtype=np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    for kind in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0):
        x = rng.standard_normal((4, 64), dtype=np.float32)
        w.add_tensor(kind.name.lower(), gguf.quantize(x, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _assert_same(path)
    assert GGUFFile(path).fields["t.nested"] == [[1, 2], [3]]


def test_not_a_gguf_file_is_refused_by_name(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        GGUFFile(bad)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        GGUFFile(tmp_path / "empty.gguf")
