"""A file name that is not UTF-8 (issue 34): the kernel takes any bytes but NUL, and Python
hands such a name around as bytes or as a str with surrogate escapes (os.fsdecode). Every
op writes and reads it byte-exact, under the very name given, and an error names the str
the caller passed (see [Note: paths cross the binding as bytes] in native/bindings.cpp)."""

import os
import pathlib

import numpy as np
import pytest

import nvmeio
from nvmeio import atomic_file
from helpers import BACKENDS, file_bytes, random_bytes

NAME = b"\xff\xfe-not-utf8.bin"  # not valid UTF-8 in any position
SIZE = 3 * 4096 + 123            # an unaligned tail: the buffered descriptor opens the name too
OFFSET = 4096 + 7                # an unaligned head


def as_kind(path_bytes: bytes, kind: str):
    """The same name as a str with surrogate escapes, as bytes, or as a pathlib.Path."""
    return {"surrogates": os.fsdecode(path_bytes), "bytes": path_bytes,
            "pathlib": pathlib.Path(os.fsdecode(path_bytes))}[kind]


def write_then_read(h, call: str, data: np.ndarray, path, offset: int) -> np.ndarray:
    """``data`` written at ``offset`` and read back through the pair of ops ``call`` names."""
    back = np.zeros_like(data)
    if call == "sync":
        assert h.sync_pwrite(data, path, offset) == 1
        assert h.sync_pread(back, path, offset) == 1
    elif call == "async":
        assert h.async_pwrite(data, path, offset) == 0
        assert h.wait() == 1
        assert h.async_pread(back, path, offset) == 0
        assert h.wait() == 1
    elif call == "combined":
        assert h.pwrite(data, path, False, False, offset) == 1
        assert h.pread(back, path, False, True, offset) == 0
        assert h.wait() == 1
    elif call == "combined_validate":
        assert h.pwrite(data, path, True, False, offset) == 1
        assert h.pread(back, path, True, False, offset) == 1
    return back


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["surrogates", "bytes", "pathlib"])
@pytest.mark.parametrize("call", ["sync", "async", "combined", "combined_validate"])
def test_positional_ops_write_and_read_a_name_that_is_not_utf8(nvme_dir, backend, kind, call):
    raw = os.fsencode(nvme_dir) + b"/" + NAME
    data = random_bytes(SIZE, seed=1)
    with nvmeio.aio_handle(backend=backend) as h:
        back = write_then_read(h, call, data, as_kind(raw, kind), OFFSET)
    assert np.array_equal(back, data)
    assert os.listdir(os.fsencode(nvme_dir)) == [NAME]  # that very name, nothing else
    assert file_bytes(raw) == bytes(OFFSET) + data.tobytes()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["surrogates", "bytes", "pathlib"])
def test_whole_file_write_and_read_of_a_name_that_is_not_utf8(nvme_dir, backend, kind):
    raw = os.fsencode(nvme_dir) + b"/" + NAME
    path = as_kind(raw, kind)
    first, second = random_bytes(SIZE, seed=2), random_bytes(SIZE + 5, seed=3)
    with nvmeio.aio_handle(backend=backend) as h:
        assert h.write(first, path) == 0
        assert h.write(second, path, validate=True) == 0   # replaces the existing file
        back = np.zeros_like(second)
        assert h.read(back, path, validate=True) == 0
    assert np.array_equal(back, second)
    assert os.listdir(os.fsencode(nvme_dir)) == [NAME]
    assert file_bytes(raw) == second.tobytes()


@pytest.mark.parametrize("kind", ["surrogates", "bytes", "pathlib"])
def test_a_missing_file_that_is_not_utf8_is_named_in_the_error(nvme_dir, kind):
    raw = os.fsencode(nvme_dir) + b"/" + NAME
    with nvmeio.aio_handle() as h:
        with pytest.raises(FileNotFoundError) as caught:
            h.sync_pread(np.zeros(10, np.uint8), as_kind(raw, kind))
    assert caught.value.filename == os.fsdecode(raw)
    assert (caught.value.offset, caught.value.length) == (0, 10)


def test_a_missing_directory_that_is_not_utf8_is_named_in_the_error(nvme_dir):
    raw = os.fsencode(nvme_dir) + b"/\xff-dir/x.bin"
    with nvmeio.aio_handle() as h:
        with pytest.raises(FileNotFoundError, match="directory .* does not exist") as caught:
            h.sync_pwrite(np.zeros(10, np.uint8), raw)
    assert caught.value.filename == os.fsdecode(raw)
    assert os.fsdecode(os.path.dirname(raw)) in caught.value.strerror
    assert os.listdir(nvme_dir) == []


def test_a_short_read_of_a_file_that_is_not_utf8_is_an_error_naming_it(nvme_dir):
    raw = os.fsencode(nvme_dir) + b"/" + NAME
    with open(raw, "wb") as f:
        f.write(b"x" * 100)
    with nvmeio.aio_handle() as h:
        with pytest.raises(nvmeio.ShortReadError) as caught:
            h.sync_pread(np.zeros(200, np.uint8), raw)
    assert caught.value.filename == os.fsdecode(raw)


def test_fast_files_and_atomic_writes_take_a_name_that_is_not_utf8(nvme_dir):
    raw = os.fsencode(nvme_dir) + b"/" + NAME
    data = random_bytes(3 << 20, seed=4).tobytes()  # past direct_min: goes through the handle
    with nvmeio.FastFileWriter(os.fsdecode(raw)) as f:
        f.write(data)
    assert file_bytes(raw) == data
    with nvmeio.FastFileReader(raw) as f:
        assert f.read() == data
    atomic_file.write_atomically(raw, b"replaced")
    assert file_bytes(raw) == b"replaced"
    assert os.listdir(os.fsencode(nvme_dir)) == [NAME]
