"""FastIO: one aio_handle and its locked I/O buffers, lent to one fast file at a time.

    with nvmeio.FastIO() as io:                      # 2 x 64 MiB locked buffers
        with io.writer("model.pt") as f:
            torch.save(state, f)                     # at disk speed, atomic
        with io.reader("model.pt") as f:
            state = torch.load(f, weights_only=True)

A writer or reader made on its own (``FastFileWriter(path)``) makes private
buffers and closes them with the file. Saving many files (a checkpoint's shards)
through one FastIO sets the handle and the buffers up once. The buffers and
their lending are :class:`~nvmeio._fast_buffers.IOBuffers`.
"""
from __future__ import annotations

from ._fast_buffers import DEFAULT_BUFFER_SIZE, FastIOStats, IOBuffers
from ._fast_reader import FastFileReader
from ._fast_writer import FastFileWriter

__all__ = ["FastIO", "FastIOStats", "DEFAULT_BUFFER_SIZE"]


class FastIO(IOBuffers):
    __doc__ = IOBuffers.__doc__

    def writer(self, path, atomic: bool = True) -> FastFileWriter:
        """A :class:`~nvmeio.FastFileWriter` of ``path`` on this FastIO."""
        return FastFileWriter(path, atomic=atomic, io=self)

    def reader(self, path) -> FastFileReader:
        """A :class:`~nvmeio.FastFileReader` of ``path`` on this FastIO."""
        return FastFileReader(path, io=self)
