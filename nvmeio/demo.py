"""nvmeio demo: write a tensor to disk and read it back, and say how fast.

    python -m nvmeio.demo [--dir DIR] [--size-mib 512]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

import nvmeio

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="directory on the NVMe (default: a temp dir)")
    p.add_argument("--size-mib", type=int, default=512)
    args = p.parse_args(argv)

    h = nvmeio.aio_handle(queue_depth=32, intra_op_parallelism=4, overlap_events=True)
    n = args.size_mib << 20
    src = h.new_cpu_locked_tensor(n // 4, torch.empty(0, dtype=torch.float32))
    src.copy_(torch.randn(n // 4))
    dst = h.new_cpu_locked_tensor(n // 4, torch.empty(0, dtype=torch.float32))
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, "demo_tensor.bin")
        t0 = time.perf_counter()
        h.async_pwrite(src, path)
        h.wait()
        t1 = time.perf_counter()
        h.sync_pread(dst, path)
        t2 = time.perf_counter()
        size = os.path.getsize(path)
    ok = torch.equal(src, dst)
    gib = n / 2**30
    print(f"nvmeio {nvmeio.__version__}: {h!r}, backends {nvmeio.available_backends()}")
    print(f"wrote {size} bytes: {gib / (t1 - t0):.2f} GiB/s; read back: {gib / (t2 - t1):.2f} GiB/s; "
          f"bytes equal: {ok}")
    return 0 if ok and size == n else 1


if __name__ == "__main__":
    raise SystemExit(main())
