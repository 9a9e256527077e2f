"""Property tests: what is written at (path, offset) reads back byte for byte,
for any size, offset, buffer alignment and handle setting, on every backend;
bytes around the written range are left as they were."""

import os
import uuid

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nvmeio
from helpers import BACKENDS, file_bytes, random_bytes, unaligned_view

MiB = 1 << 20

sizes = st.one_of(
    st.integers(0, 10_000),                      # tiny, inside one block
    st.integers(4096, 4 * MiB).map(lambda n: n - n % 4096),  # aligned
    st.integers(10_000, 24 * MiB),               # odd sizes up to tens of MiB
)
offsets = st.one_of(st.just(0), st.integers(0, 64).map(lambda k: k * 4096), st.integers(0, 3 * MiB))
handle_settings = st.fixed_dictionaries({
    "block_size": st.sampled_from([4096, 10_000, 65536, MiB]),
    "queue_depth": st.sampled_from([1, 2, 4, 32, 128]),
    "single_submit": st.booleans(),
    "overlap_events": st.booleans(),
    "intra_op_parallelism": st.integers(1, 8),
    "backend": st.sampled_from(BACKENDS),
})
memory = st.sampled_from(["locked", "unaligned", "numpy", "tensor"])


def make_buffer(h, kind: str, n: int):
    if kind == "locked":
        return h.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8)).numpy()
    if kind == "unaligned":
        return unaligned_view(n, shift=3)
    if kind == "tensor":
        return torch.empty(n, dtype=torch.uint8).numpy()
    return np.empty(n, dtype=np.uint8)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=sizes, offset=offsets, cfg=handle_settings, src_kind=memory, dst_kind=memory,
       background=st.integers(0, 6 * MiB), seed=st.integers(0, 2**31))
def test_write_then_read_roundtrip(nvme_dir, n, offset, cfg, src_kind, dst_kind, background, seed):
    h = nvmeio.aio_handle(**cfg)
    path = nvme_dir / f"rt_{uuid.uuid4().hex}.bin"
    old = random_bytes(background, seed + 1).tobytes()
    if background:
        path.write_bytes(old)
    src = make_buffer(h, src_kind, n)
    src[:] = random_bytes(n, seed)

    assert h.sync_pwrite(src, path, file_offset=offset) == 1

    # Everything outside [offset, offset+n) is as before; the file ends at
    # max(old size, offset + n); a gap before offset reads as zeros. An empty
    # write changes nothing (as pwrite(2) of 0 bytes).
    expected = bytearray(old.ljust(offset, b"\0") if n else old)
    expected[offset:offset + n] = src.tobytes()
    assert os.path.getsize(path) == (max(background, offset + n) if n else background)
    assert file_bytes(path) == bytes(expected)

    dst = make_buffer(h, dst_kind, n)
    dst[:] = 0xAB
    assert h.sync_pread(dst, path, file_offset=offset) == 1
    assert np.array_equal(dst, src)
    path.unlink()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool,
                              torch.uint8, torch.float64, torch.int8]),
       numel=st.integers(0, 300_000), backend=st.sampled_from(BACKENDS))
def test_tensor_dtypes_roundtrip(nvme_dir, dtype, numel, backend):
    h = nvmeio.aio_handle(queue_depth=8, intra_op_parallelism=3, backend=backend)
    g = torch.Generator().manual_seed(numel)
    src = (torch.rand(numel, generator=g) * 100).to(dtype)
    path = nvme_dir / f"t_{uuid.uuid4().hex}.bin"
    h.sync_pwrite(src, path)
    assert os.path.getsize(path) == numel * src.element_size()
    dst = torch.empty_like(src)
    h.sync_pread(dst, path)
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
