"""File-to-file operations on the optimizer swapper's sub-group state files, for
checkpoints: the current file and its digests, linking it into a checkpoint, adopting a
checkpoint's shard as the swap file, importing a shard's bytes through the pool, staging
a shard's bytes (read once, hashed on the way) and publishing them later. Kept
apart from the swap state machine (optimizer_swapper.py), whose states and queues they
use; mixed into :class:`~swapper.PartitionedOptimizerSwapper`.
"""
from __future__ import annotations

import contextlib
import errno
import os
import threading
from typing import Dict, Mapping, Optional, Tuple

import torch

from nvmeio import new_handle

from .buffer_pool import PoolBuffer
from .checksum import ChecksumAlgorithm
from .errors import PoolExhaustedError, SwapStateError
from .io_queue import IoKind
from .staged_state import StagedRegion, StagedState, stream_regions
from .sub_group import HEADER_BYTES, SubGroupState, SubGroupTensors

STAGED_SUFFIX = ".staged"  # a staging file: subgroup<k>.swp.staged, never read by swapping


def _hard_link(src: str, dst: str) -> bool:
    """``os.link``; False where the file system cannot link these two (another device, no
    hard links, too many links): the caller copies instead."""
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.ENOSYS):
            return False
        raise
    return True


def _open_if_last_link(path: str) -> int:
    """A descriptor of ``path`` where its name is the file's last link (so that the rename
    over it frees its blocks at that descriptor's close instead), else -1."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1
    if os.fstat(fd).st_nlink != 1:
        os.close(fd)
        return -1
    return fd


def _close_later(fd: int) -> None:
    """Close ``fd`` on a helper thread: the last close of a replaced swap file frees its blocks,
    which on ext4 mounted with ``discard`` trims them first (measured ~0.15 s per GiB here),
    work the load need not wait for."""
    threading.Thread(target=os.close, args=(fd,), name="nvmeio-free-old-swap", daemon=True).start()


class SubGroupFiles:
    """Checkpoint operations of :class:`~swapper.PartitionedOptimizerSwapper` (see the module
    docstring); every method works on the swapper's own entries, queues and checksums."""

    def stored_file(self, sub_group_id: int) -> Tuple[str, Dict[str, int]]:
        """The swap file holding a sub-group's state, and the byte offset of each of its
        tensors there (``"master"`` and the state names; ``numel * itemsize`` bytes each),
        so that a checkpoint can copy them file to file.

        The file is made current first: a read or write in flight completes, and a
        sub-group held in host memory is written out (its buffer returns to the pool).
        """
        g = self._group(sub_group_id)
        if g.state is SubGroupState.UNWRITTEN:
            raise SwapStateError(f"sub-group {sub_group_id} was never initialized")
        self._await_read(g)
        if g.state is SubGroupState.AVAILABLE:
            self._begin_write(g)
        if g.state is SubGroupState.WRITING:
            self._wait(self._writes, None)
        return self.swap_dir.file(g.file_name), self._offsets(g.layout)

    def stored_checksums(self, sub_group_id: int) -> Optional[Dict[str, int]]:
        """The digests recorded when the sub-group's state was written (of ``"master"`` and
        each state's ``numel * itemsize`` bytes, algorithm :attr:`checksum`), for a checkpoint
        to carry with the bytes it links or copies; None with checksums off (or where one is
        missing). Call it after :meth:`stored_file`, which makes the file current."""
        g = self._group(sub_group_id)
        if self._checksums is None or g.state is not SubGroupState.ON_NVME:
            return None
        path = self.swap_dir.file(g.file_name)
        out = {name: self._checksums.recorded(path, offset, g.layout.tensor_bytes)
               for name, offset in self._offsets(g.layout).items()}
        return None if any(d is None for d in out.values()) else out

    def link_state(self, sub_group_id: int, dest: str, header: bytes) -> bool:
        """Makes the sub-group's swap file also ``dest`` (a hard link: no byte is copied),
        after writing ``header`` into its header page (see [Note: the header page]); the
        next swap-out writes a new file, so ``dest`` keeps this state. False, changing
        nothing, where that cannot be done (another file system, a header of another
        size, a file linked already whose header page holds another header): the caller
        copies instead."""
        g = self._group(sub_group_id)
        if len(header) != HEADER_BYTES:
            return False
        path, _ = self.stored_file(sub_group_id)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            if g.linked:  # a checkpoint's file already: never written again, only linked once more
                if os.pread(fd, HEADER_BYTES, 0) != header:
                    return False
            elif os.pwrite(fd, header, 0) != HEADER_BYTES:
                raise OSError(f"short write of the header page of {path}")
            os.fsync(fd)
        finally:
            os.close(fd)
        if not _hard_link(path, dest):
            return False
        g.linked = True
        return True

    def adopt_file(self, sub_group_id: int, path: str, offsets: Mapping[str, int],
                   checksums: Optional[Tuple[str, Mapping[str, int]]] = None) -> bool:
        """Makes the file ``path`` (a checkpoint shard in this very layout: ``offsets`` of
        "master" and every state equal this swapper's) the sub-group's swap file, by a hard
        link: no byte is copied, and the next swap-out writes a new file, so ``path`` is
        never changed. With checksums on, ``checksums`` = (algorithm name, digest of each
        tensor) that the file carries become the ones its swap-ins verify. False, changing
        nothing, where that cannot be done (another file system or layout; checksums on
        and none carried, or of another algorithm)."""
        g = self._group(sub_group_id)
        if self._checksums is not None and (
                checksums is None or checksums[0] != self._checksums.algorithm.value
                or set(checksums[1]) != set(offsets)):
            return False
        if (dict(offsets) != self._offsets(g.layout)
                or os.path.getsize(path) < g.layout.written_bytes):
            return False
        if g.state in (SubGroupState.READING, SubGroupState.WRITING):
            self.synchronize()
        target = self.swap_dir.file(g.file_name)
        if self.on_rewrite is not None:
            self.on_rewrite(sub_group_id)
        same = os.path.exists(target) and os.path.samefile(path, target)  # loaded right after its save
        if not same:
            tmp = f"{target}.adopt-{os.getpid()}"
            if not _hard_link(path, tmp):
                return False
            os.replace(tmp, target)  # (a rename between two links of one file would do nothing)
        self.swap_dir.create(g.file_name)  # tracked for cleanup (the name, not the checkpoint's)
        if self._checksums is not None:
            self._checksums.forget(target)
            for name, offset in offsets.items():
                self._checksums.assign(target, offset, g.layout.tensor_bytes, checksums[1][name])
        if g.state is SubGroupState.AVAILABLE:
            self._evict(g)
        g.state, g.linked = SubGroupState.ON_NVME, True
        g.grad_ranges.clear()
        g.grad_tickets.clear()
        return True

    @property
    def can_import(self) -> bool:
        """Whether :meth:`import_state` may be used (always: the state is written through
        the pool like any swap-out, checksums included)."""
        return True

    def import_state(self, sub_group_id: int, sources: Mapping[str, Tuple[str, int]],
                     write: bool = True) -> SubGroupTensors:
        """Replaces a sub-group's state with bytes of other files (a checkpoint's tensor
        data), never through torch tensors: ``sources`` maps ``"master"`` and every state
        name to ``(path, byte offset)`` of its ``numel * itemsize`` bytes. They are read
        straight into the sub-group's pool buffer (O_DIRECT, one op each, in parallel)
        and written out as one swap-out; ``write=False`` leaves the sub-group in host
        memory instead (the returned tensors; :meth:`swap_out` it when done)."""
        g = self._group(sub_group_id)
        wanted = {"master", *self.state_names}
        if set(sources) != wanted:
            raise ValueError(f"import_state needs sources for exactly {sorted(wanted)}, got {sorted(sources)}")
        if g.state in (SubGroupState.READING, SubGroupState.WRITING):
            self.synchronize()
        if g.buffer is None:
            g.buffer = self._acquire(g)
        lay, offsets = g.layout, self._offsets(g.layout)
        g.state, g.read_grad, g.read_queue = SubGroupState.READING, False, self._reads
        for name, (src_path, src_offset) in sources.items():
            view = g.buffer.bytes()[offsets[name]:offsets[name] + lay.tensor_bytes]
            self._reads.submit(IoKind.READ, view, os.fspath(src_path), src_offset, lambda error: None)
        try:
            self._wait(self._reads, None)
        except BaseException:
            self._evict(g)  # the swap file still holds the previous state
            raise
        g.state = SubGroupState.AVAILABLE
        g.grad_ranges.clear()
        g.grad_tickets.clear()
        tensors = self._tensors(g, with_grad=False)
        if write:
            self._begin_write(g)
            self._wait(self._writes, None)
        return tensors

    # -- staged loads (staged_state.py [Note: a staged load reads each byte once]) -----------------
    def can_stage(self, sub_group_id: int, sources: Mapping[str, Tuple[str, int]]) -> bool:
        """Whether :meth:`stage_state` takes ``sources``: "master" and every state, each
        4096-aligned in a file that holds its filler up to the next 4096-byte boundary (a
        checkpoint shard in this swapper's layout)."""
        g = self._group(sub_group_id)
        if set(sources) != {"master", *self.state_names}:
            return False
        span = g.layout.region_bytes
        try:
            return all(offset % HEADER_BYTES == 0 and os.path.getsize(path) >= offset + span
                       for path, offset in sources.values())
        except OSError:
            return False

    def stage_state(self, sub_group_id: int, sources: Mapping[str, Tuple[str, int]],
                    algorithm: Optional[ChecksumAlgorithm], link: bool) -> StagedState:
        """Reads the sub-group's state from ``sources`` (see :meth:`can_stage`) into a pool
        buffer once, computing the ``algorithm`` digest of each tensor on the way (the
        returned ``digests``), into a staging file: a hard link of the single source file
        where ``link`` and the file system allow, else a copy written while it is read.
        The sub-group itself is not changed: :meth:`publish_staged` makes the staging file
        its swap file, :meth:`discard_staged` forgets it. Files held in host memory are
        written out first (made current, as for a checkpoint's save), reads ahead dropped, to
        free the pool."""
        g = self._group(sub_group_id)
        lay, offsets = g.layout, self._offsets(g.layout)
        for other in self._groups.values():  # buffers for this read; no sub-group's state changes
            if other.state is SubGroupState.READING:  # a read ahead: its file holds its state
                try:
                    self.release(other.sub_group_id)
                except OSError:
                    pass  # a failed read leaves it on NVMe, as it was
            elif other.state in (SubGroupState.AVAILABLE, SubGroupState.WRITING):
                self.stored_file(other.sub_group_id)
        self.synchronize()
        staged = StagedState(sub_group_id, g.file_name + STAGED_SUFFIX, linked=False)
        path = self.swap_dir.file(staged.file_name)
        self.swap_dir.remove(staged.file_name)  # a leftover of a failed load
        files = {p for p, _ in sources.values()}
        try:
            staged.buffer = self._staging_buffer(g)
            if link and len(files) == 1 and self._link_source(next(iter(files)), path):
                staged.linked = True
                self.swap_dir.track(staged.file_name)  # removed at cleanup like a swap file
                dest = None
            else:
                self.swap_dir.check_free_space(lay.written_bytes, f"staging sub-group {sub_group_id}")
                dest = self.swap_dir.create(staged.file_name)
            regions = [StagedRegion(name, (os.fspath(sources[name][0]), sources[name][1]), offsets[name],
                                    lay.tensor_bytes, lay.region_bytes) for name in ("master", *self.state_names)]
            # Two reads in flight, so that the disk never waits for a digest: a link leaves the
            # write handle free for the second; a copy writes on it and reads on one made for it.
            with contextlib.ExitStack() as stack:
                if dest is None:
                    reads = [self._reads.handle, self._writes.handle]
                else:
                    extra = new_handle(self.aio_config)
                    stack.callback(extra.close)
                    reads = [self._reads.handle, extra]
                staged.digests, staged.bytes_written = stream_regions(
                    reads, self._writes.handle, staged.buffer.bytes(), regions, algorithm, dest)
            staged.bytes_read = lay.region_bytes * len(regions)
            self.io_bytes.read += staged.bytes_read
            self.io_bytes.written += staged.bytes_written
        except BaseException:
            self.discard_staged(staged)
            raise
        self._staged[sub_group_id] = staged
        return staged

    def _staging_buffer(self, g) -> PoolBuffer:
        """A pool buffer; where none is free, the one of the earliest staged sub-group (whose
        publish then returns no master: the caller reads it from the file)."""
        while True:
            try:
                return self._take_buffers(1, f"staging sub-group {g.sub_group_id}")[0]
            except PoolExhaustedError:
                holder = next((s for s in self._staged.values() if s.buffer is not None), None)
                if holder is None:
                    raise
                self._pool.release([holder.buffer])
                holder.buffer = None

    @staticmethod
    def _link_source(source: str, path: str) -> bool:
        try:
            return _hard_link(source, path)
        except OSError:
            return False

    def publish_staged(self, staged: StagedState,
                       checksums: Optional[Tuple[str, Mapping[str, int]]] = None) -> Optional[torch.Tensor]:
        """Makes a staged state the sub-group's swap file (a rename over it), its digests (with
        checksums on: ``checksums`` = (algorithm name, digest of each tensor), those the
        staged bytes were verified against) the ones its swap-ins verify. Returns the master
        as a view of the staging buffer while it is still held (valid until
        :meth:`release_staged`), else None."""
        sub_group_id = staged.sub_group_id
        g = self._group(sub_group_id)
        if self._staged.get(sub_group_id) is not staged:
            raise SwapStateError(f"sub-group {sub_group_id} has no such staged state (published or discarded)")
        if self._checksums is not None and (checksums is None or checksums[0] != self._checksums.algorithm.value):
            raise SwapStateError(f"sub-group {sub_group_id}: publishing needs the staged bytes' digests "
                                 f"by {self._checksums.algorithm.value}")
        if g.state in (SubGroupState.READING, SubGroupState.WRITING):
            self.synchronize()
        if self.on_rewrite is not None:
            self.on_rewrite(sub_group_id)
        if g.state is SubGroupState.AVAILABLE:
            self._evict(g)  # replaced below, as a load replaces it
        source, target = self.swap_dir.file(staged.file_name), self.swap_dir.file(g.file_name)
        if os.path.exists(target) and os.path.samefile(source, target):
            os.unlink(source)  # (a rename between two links of one file would do nothing)
        else:
            old = _open_if_last_link(target)
            os.replace(source, target)
            if old >= 0:
                _close_later(old)
        self.swap_dir.untrack(staged.file_name)
        self.swap_dir.track(g.file_name)
        del self._staged[sub_group_id]
        if self._checksums is not None:
            self._checksums.forget(target)
            offsets = self._offsets(g.layout)
            for name, offset in offsets.items():
                self._checksums.assign(target, offset, g.layout.tensor_bytes, checksums[1][name])
        g.state, g.linked = SubGroupState.ON_NVME, staged.linked
        g.grad_ranges.clear()
        g.grad_tickets.clear()
        if staged.buffer is None:
            return None
        return staged.buffer.view(g.layout.numel, g.layout.dtype, g.layout.offset(0))

    def release_staged(self, staged: StagedState) -> None:
        """Give a published (or discarded) staged state's buffer back to the pool."""
        if staged.buffer is not None:
            self._pool.release([staged.buffer])
            staged.buffer = None

    def discard_staged(self, staged: StagedState) -> None:
        """Forget a staged state: its staging file is removed, its buffer returned; the
        sub-group is as it was."""
        self.release_staged(staged)
        if self._staged.get(staged.sub_group_id) is staged:
            del self._staged[staged.sub_group_id]
        if not self.swap_dir.closed:
            self.swap_dir.remove(staged.file_name)
