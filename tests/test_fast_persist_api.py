"""DeepSpeed's FastPersist writer API as ``nvmeio.io``: ``torch.save(obj, FastFileWriter(...))``
writes the bytes a plain ``torch.save`` writes, from one writer or from several writing one
file in parallel (threads, and ranks in processes); bad arguments are refused by name."""
from __future__ import annotations

import gc
import io
import os
import struct
import threading
import warnings

import pytest
import torch

import nvmeio
from helpers import file_bytes, run_ranks
from nvmeio.io import FastFileWriter, FastFileWriterConfig, MockFileWriter, PyFileWriter


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(70_000, generator=g), "ids": torch.arange(1234), "half": torch.randn(33, 7, generator=g).half(),
            "step": 7, "name": "model"}


def _plain(obj, legacy: bool = False) -> bytes:
    """What torch.save writes into an open file."""
    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=not legacy)
    return buf.getvalue()


def _config(handle, nbytes: int = 1 << 16, **kwargs) -> FastFileWriterConfig:
    pinned = handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    return FastFileWriterConfig(dnvme_handle=handle, pinned_tensor=pinned, **kwargs)


@pytest.fixture
def handle():
    with nvmeio.aio_handle(intra_op_parallelism=2) as h:
        yield h


# -- one writer ------------------------------------------------------------------------------------

@pytest.mark.parametrize("double_buffer", [True, False])
@pytest.mark.parametrize("legacy", [False, True], ids=["zipfile", "legacy"])
def test_torch_save_into_a_fast_file_writer_writes_what_plain_torch_save_writes(tmp_path, handle, double_buffer,
                                                                                 legacy):
    obj, path = _state(), tmp_path / "model.pt"
    writer = FastFileWriter(file_path=str(path), config=_config(handle, double_buffer=double_buffer))
    torch.save(obj, f=writer, _use_new_zipfile_serialization=not legacy)
    writer.close()
    assert file_bytes(path) == _plain(obj, legacy)
    back = torch.load(path, weights_only=True)
    assert all(torch.equal(back[k], obj[k]) for k in ("w", "ids", "half")) and back["step"] == 7


def test_a_buffer_of_the_smallest_size_dividing_the_alignment_still_writes_every_byte(tmp_path):
    # alignment 512: halves of 1536 bytes, so writes land at offsets that are not 4096-aligned
    with nvmeio.aio_handle(intra_op_parallelism=1) as h:
        obj, path = _state(1), tmp_path / "small.pt"
        writer = FastFileWriter(file_path=str(path), config=_config(h, 3 * 1024))
        torch.save(obj, writer)
        writer.close()
    assert file_bytes(path) == _plain(obj)


def test_one_writer_replaces_an_older_longer_file_whole_at_close(tmp_path, handle):
    path = tmp_path / "model.pt"
    path.write_bytes(b"old" * 1_000_000)
    writer = FastFileWriter(file_path=str(path), config=_config(handle))
    torch.save(_state(), writer)
    assert file_bytes(path) == b"old" * 1_000_000  # nothing replaced before close
    writer.close()
    assert file_bytes(path) == _plain(_state())


def test_the_writer_counts_calls_and_bytes_and_fileno_sends_torch_through_write(tmp_path, handle, capsys):
    writer = FastFileWriter(file_path=str(tmp_path / "m.pt"), config=_config(handle, global_rank=3))
    assert writer.fileno() == -1
    torch.save(_state(), writer)
    writer.close()
    writer.close()  # idempotent
    stats = writer.stats()
    assert stats["bytes"] == stats["aio_bytes"] == len(_plain(_state()))
    assert stats["close"] == 1 and stats["fileno"] == 1 and stats["flush"] >= 1 and stats["rank"] == 3
    assert writer.file_path() == str(tmp_path / "m.pt")
    writer._dump_state()
    assert capsys.readouterr().out.startswith("stats = {")


def test_a_writer_left_by_an_exception_or_dropped_writes_nothing_and_frees_its_buffer(tmp_path, handle):
    config = _config(handle)
    with pytest.raises(RuntimeError, match="boom"):
        with FastFileWriter(file_path=str(tmp_path / "a.pt"), config=config) as writer:
            torch.save(_state(), writer)
            raise RuntimeError("boom")
    writer = FastFileWriter(file_path=str(tmp_path / "b.pt"), config=config)
    writer.write(b"x" * 100)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del writer
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) for w in caught)
    assert sorted(os.listdir(tmp_path)) == []
    with FastFileWriter(file_path=str(tmp_path / "c.pt"), config=config) as writer:  # the buffer is free again
        torch.save(_state(), writer)
    assert file_bytes(tmp_path / "c.pt") == _plain(_state())


def test_save_torch_storage_object_list_writes_each_storage_after_its_element_count(tmp_path, handle):
    a, b = torch.arange(10, dtype=torch.int32), torch.randn(5, dtype=torch.float64)
    writer = FastFileWriter(file_path=str(tmp_path / "s.bin"), config=_config(handle))
    items = [(t.untyped_storage(), t.dtype) for t in (a, b)]
    written = writer.save_torch_storage_object_list(items, True)
    written += writer.save_torch_storage_object_list(items[:1], False)
    writer.close()
    expected = (struct.pack("<q", 10) + a.numpy().tobytes() + struct.pack("<q", 5) + b.numpy().tobytes()
                + a.numpy().tobytes())
    assert written == len(expected) and file_bytes(tmp_path / "s.bin") == expected


def test_py_file_writer_writes_plain_bytes_and_mock_file_writer_writes_nothing(tmp_path):
    obj = _state()
    writer = PyFileWriter(str(tmp_path / "py.pt"))
    torch.save(obj, writer)
    writer.close()
    assert file_bytes(tmp_path / "py.pt") == _plain(obj)
    with pytest.raises(KeyError):
        with PyFileWriter(str(tmp_path / "left.pt")) as writer:
            torch.save(obj, writer)
            raise KeyError("stop")
    assert not (tmp_path / "left.pt").exists()
    mock = MockFileWriter(str(tmp_path / "mock.pt"))
    torch.save(obj, mock)
    mock.close()
    assert mock.stats()["bytes"] == len(_plain(obj)) and not (tmp_path / "mock.pt").exists()


# -- several writers of one file -------------------------------------------------------------------

def _parallel_save(path, obj, writers: int, stripe_bytes: int, order=None) -> None:
    """``writers`` writers of ``path``, each with its own handle and buffer; in threads at
    once, or one after the other in ``order``."""
    def save(rank):
        with nvmeio.aio_handle() as h:
            config = _config(h, 1 << 14, num_parallel_writers=writers, writer_rank=rank, stripe_bytes=stripe_bytes)
            writer = FastFileWriter(file_path=str(path), config=config)
            torch.save(obj, writer)
            writer.close()
            h.free_cpu_locked_tensor(config.pinned_tensor)

    if order is not None:
        for rank in order:
            save(rank)
        return
    errors = []
    threads = [threading.Thread(target=lambda r=r: _record(errors, save, r)) for r in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def _record(errors, fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


@pytest.mark.parametrize("writers,stripe", [(2, 4096), (2, 65536), (3, 8192)])
def test_parallel_writers_in_threads_write_one_file_identical_to_plain_torch_save(tmp_path, writers, stripe):
    obj, path = _state(), tmp_path / "model.pt"
    _parallel_save(path, obj, writers, stripe)
    assert file_bytes(path) == _plain(obj)
    assert torch.equal(torch.load(path, weights_only=True)["w"], obj["w"])


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_parallel_writers_may_finish_in_any_order_and_cut_an_older_longer_file(tmp_path, order):
    obj, path = _state(), tmp_path / "model.pt"
    path.write_bytes(os.urandom(3 * len(_plain(obj))))
    _parallel_save(path, obj, 2, 4096, order=order)
    assert file_bytes(path) == _plain(obj)


def scenario_parallel_save(rank, world_size, scratch):
    import torch.distributed as dist

    path = os.path.join(scratch, "model.pt")
    obj = _state(5)
    with nvmeio.aio_handle() as h:
        config = _config(h, 1 << 14, num_parallel_writers=world_size, writer_rank=rank, global_rank=rank,
                         stripe_bytes=4096)
        writer = FastFileWriter(file_path=path, config=config)
        torch.save(obj, writer)
        writer.close()
        share = writer.stats()["aio_bytes"]
        h.free_cpu_locked_tensor(config.pinned_tensor)
    dist.barrier()  # the file is whole once every writer closed
    return {"same": file_bytes(path) == _plain(obj), "share": share}


def test_parallel_writers_in_two_ranks_write_one_file_identical_to_plain_torch_save(tmp_path):
    results = run_ranks(2, [("save", scenario_parallel_save, {})], tmp_path, timeout=180)
    assert all(r["save"]["same"] for r in results)
    assert sum(r["save"]["share"] for r in results) == len(_plain(_state(5)))
    assert all(r["save"]["share"] > 0 for r in results)


# -- bad arguments ------------------------------------------------------------------------------------

def _pinned(handle, n=1 << 14):
    return handle.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))


@pytest.mark.parametrize("change,error,message", [
    ({"dnvme_handle": object()}, TypeError, "dnvme_handle must be an nvmeio.aio_handle"),
    ({"pinned_tensor": bytearray(4096)}, TypeError, "pinned_tensor must be a torch.Tensor"),
    ({"pinned_tensor": torch.zeros(4096, dtype=torch.float32)}, ValueError, "contiguous 1-D torch.uint8"),
    ({"pinned_tensor": torch.zeros(64, 64, dtype=torch.uint8)}, ValueError, "contiguous 1-D torch.uint8"),
    ({"pinned_tensor": torch.zeros(8192, dtype=torch.uint8)[::2]}, ValueError, "not contiguous"),
    ({"pinned_tensor": torch.zeros(3000, dtype=torch.uint8)}, ValueError, "positive multiple of 2048"),
    ({"pinned_tensor": torch.empty(4096, dtype=torch.uint8, device="meta")}, ValueError, "host buffer"),
    ({"double_buffer": 1}, TypeError, "double_buffer must be True or False"),
    ({"num_parallel_writers": 0}, ValueError, "num_parallel_writers must be an int >= 1"),
    ({"num_parallel_writers": True}, ValueError, "num_parallel_writers must be an int >= 1"),
    ({"num_parallel_writers": 2, "writer_rank": 2}, ValueError, r"writer_rank must be an int in \[0, "),
    ({"writer_rank": -1}, ValueError, "writer_rank must be an int in"),
    ({"global_rank": -1}, ValueError, "global_rank must be an int >= 0"),
    ({"stripe_bytes": 1000}, ValueError, "stripe_bytes must be a positive multiple of 4096"),
])
def test_bad_config_arguments_are_refused_naming_them(handle, change, error, message):
    args = {"dnvme_handle": handle, "pinned_tensor": _pinned(handle)}
    args.update(change)
    with pytest.raises(error, match=message):
        FastFileWriterConfig(**args)


def test_a_pinned_tensor_of_an_odd_size_is_refused_only_when_split_in_two(handle):
    odd = torch.zeros(3 * 1024, dtype=torch.uint8)  # alignment 1024 (intra_op_parallelism 2)
    FastFileWriterConfig(dnvme_handle=handle, pinned_tensor=odd, double_buffer=False)
    with pytest.raises(ValueError, match="times 2 halves with double_buffer"):
        FastFileWriterConfig(dnvme_handle=handle, pinned_tensor=odd)


def test_a_closed_handle_and_a_config_of_another_type_are_refused(tmp_path):
    h = nvmeio.aio_handle()
    pinned = torch.zeros(4096, dtype=torch.uint8)
    h.close()
    with pytest.raises(ValueError, match="dnvme_handle is closed"):
        FastFileWriterConfig(dnvme_handle=h, pinned_tensor=pinned)
    with pytest.raises(TypeError, match="config must be an nvmeio.io.FastFileWriterConfig"):
        FastFileWriter(file_path=str(tmp_path / "m.pt"), config={"dnvme_handle": h})


def test_two_open_writers_on_one_pinned_tensor_are_refused(tmp_path, handle):
    config = _config(handle)
    first = FastFileWriter(file_path=str(tmp_path / "a.pt"), config=config)
    with pytest.raises(RuntimeError, match="pinned_tensor is in use by the open FastFileWriter of"):
        FastFileWriter(file_path=str(tmp_path / "b.pt"), config=config)
    first.close()
    FastFileWriter(file_path=str(tmp_path / "b.pt"), config=config).close()
    assert file_bytes(tmp_path / "b.pt") == b""


def test_a_bare_base_writer_says_which_writers_write(tmp_path):
    from nvmeio.io import BaseFileWriter

    with pytest.raises(TypeError, match="BaseFileWriter has no file to write through: use FastFileWriter"):
        BaseFileWriter(tmp_path / "x.bin").write(b"abc")
    assert not (tmp_path / "x.bin").exists()
