"""Files that are not regular files: a FIFO or socket is refused before it is
opened (opening a FIFO would wait for a peer for ever); character devices and
/proc files are read and written, and what goes wrong is said as it is (a
character device has no size, a /proc file reports a size of 0, O_DIRECT is
refused by the device, not by a file system)."""

import errno
import mmap
import os
import re
import warnings

import numpy as np
import pytest

import nvmeio
from helpers import fifo_unblocked_after, random_bytes, special_file

NO_OFFSETS = ("refused: {what} has no file offsets, and nvmeio reads and writes at offsets "
              "(regular files, block and character devices)")
KINDS = [("fifo", "a FIFO (named pipe)"), ("socket", "a socket")]


@pytest.fixture
def h():
    return nvmeio.aio_handle(queue_depth=8, intra_op_parallelism=2)


# For the tests that are about something else than the "no O_DIRECT" warning.
quiet_no_direct = pytest.mark.filterwarnings("ignore:nvmeio. no O_DIRECT")


@pytest.mark.parametrize("kind,what", KINDS)
@pytest.mark.parametrize("op", ["sync_pread", "async_pread", "sync_pwrite", "async_pwrite", "read"])
def test_positional_io_on_a_fifo_or_socket_is_refused_at_submission(h, tmp_path, kind, what, op):
    path = special_file(tmp_path / kind, kind)
    step = "open for reading" if "read" in op else "open for writing"
    with fifo_unblocked_after(path), pytest.raises(nvmeio.AioError) as e:
        getattr(h, op)(np.zeros(4, np.uint8), path)
    assert e.value.errno == errno.ESPIPE
    assert str(e.value) == (f"[Errno {errno.ESPIPE}] {step} {NO_OFFSETS.format(what=what)}: "
                            f"{str(path)!r} (offset 0, length 4)")
    assert h.wait() == 0                      # nothing was submitted
    assert os.listdir(tmp_path) == [kind]


def test_a_descriptor_of_a_fifo_is_refused(h, tmp_path):
    path = special_file(tmp_path / "fifo", "fifo")
    fd = os.open(path, os.O_RDWR)             # both ends: this open never waits
    try:
        with pytest.raises(nvmeio.AioError) as e:
            h.async_pwrite(np.zeros(4, np.uint8), fd=fd)
    finally:
        os.close(fd)
    assert e.value.errno == errno.ESPIPE
    assert e.value.strerror == "writing " + NO_OFFSETS.format(what="a FIFO (named pipe)")
    assert h.wait() == 0


@quiet_no_direct
def test_a_character_device_is_read(h):
    buf = np.full(10_000, 7, np.uint8)
    assert h.sync_pread(buf, "/dev/zero", file_offset=123) == 1
    assert not buf.any()


@quiet_no_direct
def test_reading_past_what_a_character_device_gives_says_it_has_no_size(h):
    with pytest.raises(nvmeio.ShortReadError) as e:
        h.sync_pread(np.zeros(4, np.uint8), "/dev/null")
    assert e.value.strerror == ("short read: the character device ended at offset 0 (a character "
                                "device has no size to check a read against before it starts)")
    assert (e.value.filename, e.value.offset, e.value.length) == ("/dev/null", 0, 4)


def test_read_of_a_whole_character_device_says_it_has_no_size(h):
    with pytest.raises(ValueError) as e:
        h.read(np.zeros(100, np.uint8), "/dev/zero")
    assert str(e.value) == ("read: '/dev/zero' is a character device, which has no size to check "
                            "the buffer's 100 bytes against; use pread to read 100 bytes from it")


@quiet_no_direct
def test_a_proc_file_is_read_though_it_reports_a_size_of_0(h):
    assert os.stat("/proc/self/status").st_size == 0
    buf = np.zeros(64, np.uint8)
    assert h.sync_pread(buf, "/proc/self/status") == 1
    with open("/proc/self/status", "rb") as f:
        first_line = f.readline()
    assert buf.tobytes().startswith(first_line) and first_line.startswith(b"Name:\t")


@quiet_no_direct
def test_a_proc_file_shorter_than_the_buffer_says_its_reported_size_is_0(h):
    with pytest.raises(nvmeio.ShortReadError) as e:
        h.sync_pread(np.zeros(1 << 20, np.uint8), "/proc/self/status")
    assert re.fullmatch(r"short read: the file ended at offset \d+ \(it reports a size of 0, as "
                        r"files of /proc, /sys and other pseudo file systems do, so its size could "
                        r"not be checked before reading\)", e.value.strerror), e.value.strerror


def test_read_of_a_whole_proc_file_says_its_reported_size_is_0(h):
    with pytest.raises(ValueError) as e:
        h.read(np.zeros(100, np.uint8), "/proc/self/status")
    assert str(e.value) == ("read: '/proc/self/status' reports a size of 0 bytes, as files of "
                            "/proc, /sys and other pseudo file systems do whatever they hold, so "
                            "there is no size to check the buffer's 100 bytes against; use pread "
                            "to read 100 bytes from it")


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))


@quiet_no_direct
def test_a_proc_file_that_cannot_be_synced_is_written_without_error(backend):
    # /proc answers fdatasync with EINVAL: the write took effect, so the op succeeded.
    # Writing "5" to clear_refs starts the peak resident set (VmHWM) again from now.
    # An anonymous map of its own is given back on close; a malloc'ed array may come from the
    # heap's top, which the engine's malloc settings (zero/stores/malloc_settings.py) keep.
    with mmap.mmap(-1, 256 << 20) as big:
        np.frombuffer(big, np.uint8)[:] = 1
    before = peak_rss_bytes()
    h = nvmeio.aio_handle(backend=backend)
    assert h.sync_pwrite(np.frombuffer(b"5", np.uint8), "/proc/self/clear_refs") == 1
    assert peak_rss_bytes() < before - (128 << 20)


def test_o_direct_refused_by_character_devices_is_warned_once_per_process(tmp_path, monkeypatch):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):                   # two handles, two devices: one warning
            h = nvmeio.aio_handle()
            h.sync_pwrite(random_bytes(5000), "/dev/null")
            with pytest.raises(nvmeio.AioError):
                h.sync_pwrite(random_bytes(5000), "/dev/full")
        monkeypatch.setenv("NVMEIO_DIRECT_IO", "0")   # another kind: warned on its own
        nvmeio.aio_handle().sync_pwrite(random_bytes(5000), tmp_path / "f.bin")
    assert [str(w.message) for w in seen] == [
        "nvmeio: no O_DIRECT for '/dev/null': character devices refuse it, so its ops use plain "
        "reads and writes (warned once per process for all character devices)",
        f"nvmeio: no O_DIRECT for {str(tmp_path / 'f.bin')!r}: NVMEIO_DIRECT_IO=0 turns it off: "
        "every handle falls back to buffered I/O + fdatasync (warned once per process)"]
