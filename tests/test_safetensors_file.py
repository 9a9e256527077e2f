"""nvmeio's streaming safetensors writer/reader: bytes the safetensors package reads
(and the other way round), tensors one at a time, clear errors on damaged headers."""
import json
import os
import struct

import pytest
import safetensors
import safetensors.torch
import torch

from nvmeio import SafetensorsError, SafetensorsReader, SafetensorsWriter
from nvmeio.safetensors_file import load_file, save_file

from helpers import all_dtypes, random_tensor, same_bits


def package_dtypes():
    """The dtypes both we and the installed safetensors package know."""
    out = []
    for d in all_dtypes():
        try:
            safetensors.torch.save({"x": torch.zeros(1, dtype=d)})
            out.append(d)
        except Exception:  # noqa: BLE001 - the package does not know this dtype
            pass
    return out


def sample_tensors():
    tensors = {f"t.{i}.{d}": random_tensor(d, shape, i)
               for i, (d, shape) in enumerate((d, s) for d in package_dtypes()
                                               for s in [(3, 5), (0,), (), (7,)])}
    tensors["big"] = torch.randn(300_001)
    return tensors


def test_package_reads_what_we_write(tmp_path):
    tensors = sample_tensors()
    path = tmp_path / "m.safetensors"
    save_file(tensors, path, metadata={"format": "pt", "step": "3"})
    back = safetensors.torch.load_file(str(path))
    assert same_bits(tensors, back)
    with safetensors.safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt", "step": "3"}
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"


def test_we_read_what_the_package_writes(tmp_path):
    tensors = sample_tensors()
    path = tmp_path / "m.safetensors"
    safetensors.torch.save_file(tensors, str(path), metadata={"a": "b"})
    with SafetensorsReader(path, buffer_size=8192) as r:
        assert set(r.keys()) == set(tensors)
        assert r.metadata() == {"a": "b"}
        for name in reversed(r.keys()):  # any order
            assert same_bits(tensors[name], r.get_tensor(name))
    assert same_bits(tensors, load_file(path))


def test_streaming_writer_one_tensor_at_a_time(tmp_path):
    """Tensors sit back to back in the declared order (here not the names' order)."""
    spec = {f"layer{i}.weight": (torch.bfloat16, (64, 33)) for i in (3, 1, 4, 0, 2)}
    path = tmp_path / "m.safetensors"
    with SafetensorsWriter(path, spec, {"format": "pt"}, buffer_size=8192) as w:
        for i, name in enumerate(spec):
            w.write(name, random_tensor(torch.bfloat16, (64, 33), i))  # made, written, dropped
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    assert header.pop("__metadata__") == {"format": "pt"} and set(header) == set(spec)
    nbytes = 64 * 33 * 2
    assert [header[name]["data_offsets"] for name in spec] == [[k * nbytes, (k + 1) * nbytes]
                                                               for k in range(len(spec))]
    back = safetensors.torch.load_file(str(path))
    assert set(back) == set(spec)
    for i, name in enumerate(spec):
        assert same_bits(back[name], random_tensor(torch.bfloat16, (64, 33), i))


def test_read_into_existing_tensor_and_non_contiguous_write(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    path = tmp_path / "m.safetensors"
    save_file({"t": base.t()}, path)  # non-contiguous source
    with SafetensorsReader(path) as r:
        out = torch.empty(24)
        assert r.get_tensor("t", out=out) is out
        assert torch.equal(out.reshape(6, 4), base.t())
        with pytest.raises(ValueError, match="contiguous CPU torch.float32 tensor of 24"):
            r.get_tensor("t", out=torch.empty(23))
        with pytest.raises(KeyError, match="no tensor 'u'"):
            r.get_tensor("u")


@pytest.mark.parametrize("via", ["buffers", "kernel"])
def test_copy_from_another_file(tmp_path, via):
    src = tmp_path / "swap.bin"
    payload = torch.randn(10_000)
    src.write_bytes(b"\0" * 4096 + payload.numpy().tobytes())
    path = tmp_path / "m.safetensors"
    with SafetensorsWriter(path, {"a": (torch.int8, (3,)), "b": (torch.float32, (10_000,)),
                                  "c": (torch.float32, (2,))}, buffer_size=8192) as w:
        w.write("a", torch.tensor([1, 2, 3], dtype=torch.int8))
        w.copy_from("b", str(src), 4096, via=via)  # lands at an unaligned offset of the file
        w.write("c", torch.tensor([5.0, 6.0]))
    back = safetensors.torch.load_file(str(path))
    assert torch.equal(back["b"], payload) and back["c"].tolist() == [5.0, 6.0]
    assert back["a"].tolist() == [1, 2, 3]


def test_writer_errors(tmp_path):
    path = tmp_path / "m.safetensors"
    spec = {"a": (torch.float32, (2,)), "b": (torch.float32, (3,))}
    with pytest.raises(SafetensorsError, match="expected 'a' next, got 'b'"):
        with SafetensorsWriter(path, spec) as w:
            w.write("b", torch.zeros(3))
    with pytest.raises(SafetensorsError, match=r"declared torch.float32 \[2\], got torch.float32 \[3\]"):
        with SafetensorsWriter(path, spec) as w:
            w.write("a", torch.zeros(3))
    w = SafetensorsWriter(path, spec)
    w.write("a", torch.zeros(2))
    with pytest.raises(SafetensorsError, match="missing: b"):
        w.close()
    with pytest.raises(SafetensorsError, match="metadata must map str to str"):
        SafetensorsWriter(path, spec, {"step": 3})
    with pytest.raises(SafetensorsError, match="no safetensors code"):
        SafetensorsWriter(path, {"q": (torch.quint8, (1,))})
    assert os.listdir(tmp_path) == []  # no file, no temporary left by any of these


def damaged(tmp_path, header, data=b"", length=None):
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


@pytest.mark.parametrize("header,data,length,message", [
    ({}, b"", 1 << 40, "length field says 1099511627776 bytes"),
    (b"{not json", b"", None, "not valid JSON"),
    ([1, 2], b"", None, "a JSON object was expected"),
    ({"x": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, None, "unknown dtype 'F99'"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, None, "out of range"),
    ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}, b"\0" * 4, None, "out of range"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "y": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, None, "overlap"),
    ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None, "needs 12"),
    ({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b"", None, "bad shape"),
    ({"x": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, None, "exactly dtype, shape and data_offsets"),
    ({"__metadata__": {"a": 1}}, b"", None, "__metadata__ must map str to str"),
])
def test_damaged_headers_are_refused_clearly(tmp_path, header, data, length, message):
    path = damaged(tmp_path, header, data, length)
    with pytest.raises(SafetensorsError, match=message) as e:
        SafetensorsReader(path)
    assert str(path) in str(e.value)


def test_too_short_file(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\1\0")
    with pytest.raises(SafetensorsError, match="too short"):
        SafetensorsReader(path)
