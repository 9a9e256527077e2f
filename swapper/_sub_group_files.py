"""The file operations of checkpoints on an optimizer swapper's sub-group state files: their
recorded digests, linking one into a checkpoint, adopting a checkpoint's shard as a swap file,
staging a shard's bytes into a staging file (read once, hashed on the way) and publishing it.

:class:`SubGroupFiles` is a collaborator of :class:`~swapper.PartitionedOptimizerSwapper`,
which makes one and forwards these operations to it. It does the file work; the sub-groups'
states stay the swapper's, and it moves them only through the swapper's public methods
(:class:`SubGroupOwner`): ``stored_file`` (make a file current), ``share_file`` and
``replace_file`` (a file linked elsewhere, a file put in place of another), ``release`` and
``synchronize``. What it needs besides, the swapper hands it when making it: the checksum
table, its two handles (idle whenever it calls here) and a way to take a pool buffer.
"""
from __future__ import annotations

import contextlib
import errno
import os
import threading
from typing import Callable, Dict, List, Mapping, Optional, Protocol, Set, Tuple

import torch

from nvmeio import AioSettings, StripedFile, new_handle
from nvmeio.atomic_file import create_exclusive
from nvmeio.striping import file_size, fspath

from ._buffer_pool import PoolBuffer
from .checksum import ChecksumAlgorithm, ChecksumTable
from ._errors import PoolExhaustedError, SwapStateError
from ._io_queue import IoBytes
from ._staged_state import StagedRegion, StagedState, stream_regions
from ._sub_group import HEADER_BYTES, SubGroupLayout, SubGroupState
from ._swap_dir import SwapDirectory

Sources = Mapping[str, Tuple[str, int]]  # "master" and each state -> (path, byte offset) of its bytes
Carried = Tuple[str, Mapping[str, int]]  # (checksum algorithm name, digest of each tensor)

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


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


class SubGroupOwner(Protocol):
    """What :class:`SubGroupFiles` uses of its swapper: public attributes and methods only."""

    swap_dir: SwapDirectory
    io_bytes: IoBytes
    aio_config: AioSettings

    @property
    def sub_group_ids(self) -> List[int]: ...
    def state(self, sub_group_id: int) -> SubGroupState: ...
    def layout(self, sub_group_id: int) -> SubGroupLayout: ...
    def master_location(self, sub_group_id: int) -> Tuple[str, int]: ...
    def stored_file(self, sub_group_id: int) -> Tuple[str, Dict[str, int]]: ...
    def share_file(self, sub_group_id: int, link: Callable[[str, bool], bool]) -> bool: ...
    def replace_file(self, sub_group_id: int, replace: Callable[[str], bool], shared: bool) -> bool: ...
    def release(self, sub_group_id: int) -> None: ...
    def synchronize(self) -> None: ...


class SubGroupFiles:
    """The checkpoint file operations of ``owner`` (see the module docstring). ``handles``: the
    owner's read and write handles; ``take_buffer(nbytes, holder)`` a buffer of its pool,
    ``release_buffer(buffer)`` gives one back."""

    def __init__(self, owner: SubGroupOwner, checksums: Optional[ChecksumTable], handles: Tuple[object, object], *,
                 take_buffer: Callable[[int, str], PoolBuffer], release_buffer: Callable[[PoolBuffer], None]):
        self.owner = owner
        self.checksums = checksums
        self.read_handle, self.write_handle = handles
        self.take_buffer = take_buffer
        self.release_buffer = release_buffer
        self.staged: Dict[int, StagedState] = {}  # sub-group id -> state staged, not published yet

    def stored_checksums(self, sub_group_id: int) -> Optional[Dict[str, int]]:
        """The digests recorded when the sub-group's state was written (of ``"master"`` and
        each state's ``numel * itemsize`` bytes, algorithm :attr:`checksum`), for a checkpoint
        to carry with the bytes it links or copies; None with checksums off (or where one is
        missing). Call it after ``stored_file``, which makes the file current."""
        layout = self.owner.layout(sub_group_id)
        if self.checksums is None or self.owner.state(sub_group_id) is not SubGroupState.ON_NVME:
            return None
        path = self.owner.master_location(sub_group_id)[0]
        out = {name: self.checksums.recorded(path, offset, layout.tensor_bytes)
               for name, offset in layout.offsets().items()}
        return None if any(d is None for d in out.values()) else out

    def link_state(self, sub_group_id: int, dest, header: bytes,
                   copy: Optional[Callable[[str, str], None]] = None) -> bool:
        """Makes the sub-group's swap file also ``dest`` (a hard link: no byte is copied),
        after writing ``header`` into its header page (see [Note: the header page]); the
        next swap-out writes a new file, so ``dest`` keeps this state. A swap file striped
        over drives takes ``dest`` as one path per part, its header page being the start of
        its first part: each part is linked to its path, or where it cannot be (another file
        system) copied by ``copy(part, path)`` (zero/checkpoint/format.py [Note: striped
        shards]). False, changing nothing, where that cannot be done (another file system
        for a plain file, ``dest`` of another kind than the file, a header of another size,
        a file linked already whose header page holds another header): the caller copies
        instead."""
        self.owner.layout(sub_group_id)  # (registered)
        if len(header) != HEADER_BYTES:
            return False

        def link(path, shared: bool) -> bool:
            striped = isinstance(path, StripedFile)
            if striped != (not isinstance(dest, str)) or (striped and (copy is None or len(dest) != len(path.parts))):
                return False  # a shard of another kind than the file: the caller copies it whole
            parts = path.parts if striped else (path,)
            fd = os.open(parts[0], os.O_RDWR | os.O_CLOEXEC)
            try:
                if shared:  # a checkpoint's file already: never written again, only linked once more
                    if os.pread(fd, HEADER_BYTES, 0) != header:
                        return False
                elif os.pwrite(fd, header, 0) != HEADER_BYTES:
                    raise OSError(f"short write of the header page of {path}")
                os.fsync(fd)
            finally:
                os.close(fd)
            for part in parts[1:]:  # durable before a checkpoint names them, as the first part just was
                _fsync_path(part)
            if not striped:
                return _hard_link(path, dest)
            linked = [_hard_link(part, target) for part, target in zip(parts, dest)]
            if not any(linked):
                return False  # no part shares the checkpoint's file system after all: one plain copy
            for part, target, done in zip(parts, dest, linked):
                if not done:
                    copy(part, target)
            return True

        return self.owner.share_file(sub_group_id, link)

    def adopt_file(self, sub_group_id: int, path: str, offsets: Mapping[str, int],
                   checksums: Optional[Carried] = None) -> bool:
        """Makes the file ``path`` (a checkpoint shard in this very layout: ``offsets`` of
        "master" and every state equal the swapper's) the sub-group's swap file, by a hard
        link: no byte is copied, and the next swap-out writes a new file, so ``path`` is
        never changed. With checksums on, ``checksums`` = (algorithm name, digest of each
        tensor) that the file carries become the ones its swap-ins verify. A shard striped
        over several files (zero/checkpoint/format.py [Note: striped shards]) becomes the
        swap file of a swapper striped alike, part by part. False, changing nothing, where
        that cannot be done (another file system, layout or cut of stripes; checksums on
        and none carried, or of another algorithm)."""
        layout = self.owner.layout(sub_group_id)
        if self.checksums is not None and (
                checksums is None or checksums[0] != self.checksums.algorithm.value
                or set(checksums[1]) != set(offsets)):
            return False
        if dict(offsets) != layout.offsets() or file_size(path) < layout.written_bytes:
            return False

        def adopt(target) -> bool:
            pairs = _part_pairs(path, target)
            if pairs is None:
                return False  # a plain file cannot become stripes, nor stripes of another cut: the caller stages it
            # Every part is linked under a temporary name first: a link refused leaves the swap file as it was.
            moves = []
            try:
                for source, dest in pairs:
                    if os.path.exists(dest) and os.path.samefile(source, dest):
                        continue  # loaded right after its save (a rename between two links would do nothing)
                    tmp = f"{dest}.adopt-{os.getpid()}"
                    if not _hard_link(source, tmp):
                        raise _NoLink
                    moves.append((tmp, dest))
            except BaseException as error:
                for tmp, _ in moves:
                    os.unlink(tmp)
                if isinstance(error, _NoLink):
                    return False
                raise
            done = []
            try:
                for tmp, dest in moves:
                    os.replace(tmp, dest)
                    done.append(dest)
            except BaseException:
                # Half the parts are the checkpoint's now: remove them and the rest, so that no
                # swap-out ever writes into a checkpoint's file (the sub-group's file is missing:
                # the load fails and the engine asks for another).
                for tmp, dest in moves[len(done):]:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                for dest in done:
                    with contextlib.suppress(OSError):
                        os.unlink(dest)
                raise
            self.owner.swap_dir.create(_file_name(target))  # tracked for cleanup (the name, not the checkpoint's)
            self._assign_digests(target, layout, checksums)
            return True

        return self.owner.replace_file(sub_group_id, adopt, shared=True)

    # -- staged loads (_staged_state.py [Note: a staged load reads each byte once]) -----------------
    def can_stage(self, sub_group_id: int, sources: Sources) -> bool:
        """Whether :meth:`stage_state` takes ``sources``: "master" and every state, each
        4096-aligned in a file that holds its filler up to the next 4096-byte boundary (a
        checkpoint shard in the swapper's layout)."""
        layout = self.owner.layout(sub_group_id)
        if set(sources) != {"master", *layout.state_names}:
            return False
        try:
            return all(offset % HEADER_BYTES == 0 and file_size(path) >= offset + layout.region_bytes
                       for path, offset in sources.values())
        except OSError:
            return False

    def stage_state(self, sub_group_id: int, sources: Sources, algorithm: Optional[ChecksumAlgorithm],
                    link: bool) -> StagedState:
        """Reads the sub-group's state from ``sources`` (see :meth:`can_stage`) into a pool
        buffer once, computing the ``algorithm`` digest of each tensor on the way (the
        returned ``digests``), into a staging file: a hard link of the single source file
        where ``link`` and the file system allow, else a copy written while it is read; where
        it and the swap files are striped alike, each part linked where its drive allows and
        the other parts written.
        The sub-group itself is not changed: :meth:`publish_staged` makes the staging file
        its swap file, :meth:`discard_staged` forgets it. Files held in host memory are
        written out first (made current, as for a checkpoint's save), reads ahead dropped, to
        free the pool."""
        owner = self.owner
        layout = owner.layout(sub_group_id)
        for other in owner.sub_group_ids:  # buffers for this read; no sub-group's state changes
            state = owner.state(other)
            if state is SubGroupState.READING:  # a read ahead: its file holds its state
                try:
                    owner.release(other)
                except OSError:
                    pass  # a failed read leaves it on NVMe, as it was
            elif state in (SubGroupState.AVAILABLE, SubGroupState.WRITING):
                owner.stored_file(other)
        owner.synchronize()
        swap_dir = owner.swap_dir
        file_name = _file_name(owner.master_location(sub_group_id)[0])
        staged = StagedState(sub_group_id, file_name + STAGED_SUFFIX, linked=False)
        path = swap_dir.file(staged.file_name)
        swap_dir.remove(staged.file_name)  # a leftover of a failed load
        files = {p for p, _ in sources.values()}
        offsets = layout.offsets()
        try:
            staged.buffer = self._staging_buffer(sub_group_id, layout)
            linked = _link_each_part(next(iter(files)), path) if link and len(files) == 1 else set()
            parts = path.parts if isinstance(path, StripedFile) else (path,)
            skip = frozenset()
            if len(linked) == len(parts):
                staged.linked = True
                swap_dir.track(staged.file_name)  # removed at cleanup like a swap file
                dest = None
            elif linked:  # some parts are the shard's (the drives on its file system): the others are written
                staged.linked = True  # shared: never written in place once published
                swap_dir.check_free_space(layout.written_bytes, f"staging sub-group {sub_group_id}")
                for k, part in enumerate(parts):
                    if k not in linked:
                        os.close(create_exclusive(part))
                dest, skip = swap_dir.track(staged.file_name), frozenset(linked)
            else:
                swap_dir.check_free_space(layout.written_bytes, f"staging sub-group {sub_group_id}")
                dest = swap_dir.create(staged.file_name)
            regions = [StagedRegion(name, (fspath(sources[name][0]), sources[name][1]), offsets[name],
                                    layout.tensor_bytes, layout.region_bytes)
                       for name in ("master", *layout.state_names)]
            # Two reads in flight, so that the disk never waits for a digest: a link leaves the
            # write handle free for the second; a copy writes on it and reads on one made for it.
            with contextlib.ExitStack() as stack:
                if dest is None:
                    reads = [self.read_handle, self.write_handle]
                else:
                    extra = new_handle(owner.aio_config)
                    stack.callback(extra.close)
                    reads = [self.read_handle, extra]
                staged.digests, staged.bytes_written = stream_regions(
                    reads, self.write_handle, staged.buffer.bytes(), regions, algorithm, dest, skip)
            staged.bytes_read = layout.region_bytes * len(regions)
            owner.io_bytes.read += staged.bytes_read
            owner.io_bytes.written += staged.bytes_written
        except BaseException:
            self.discard_staged(staged)
            raise
        self.staged[sub_group_id] = staged
        return staged

    def _staging_buffer(self, sub_group_id: int, layout: SubGroupLayout) -> PoolBuffer:
        """A pool buffer; where none is free, the one of the earliest staged sub-group (whose
        publish then returns no master: the caller reads it from the file)."""
        while True:
            try:
                return self.take_buffer(layout.file_bytes, f"staging sub-group {sub_group_id}")
            except PoolExhaustedError:
                holder = next((s for s in self.staged.values() if s.buffer is not None), None)
                if holder is None:
                    raise
                self.release_staged(holder)

    def publish_staged(self, staged: StagedState, checksums: Optional[Carried] = None) -> Optional[torch.Tensor]:
        """Makes a staged state the sub-group's swap file (a rename over it), its digests (with
        checksums on: ``checksums`` = (algorithm name, digest of each tensor), those the
        staged bytes were verified against) the ones its swap-ins verify. Returns the master
        as a view of the staging buffer while it is still held (valid until
        :meth:`release_staged`), else None."""
        sub_group_id = staged.sub_group_id
        layout = self.owner.layout(sub_group_id)
        if self.staged.get(sub_group_id) is not staged:
            raise SwapStateError(f"sub-group {sub_group_id} has no such staged state (published or discarded)")
        if self.checksums is not None and (checksums is None or checksums[0] != self.checksums.algorithm.value):
            raise SwapStateError(f"sub-group {sub_group_id}: publishing needs the staged bytes' digests "
                                 f"by {self.checksums.algorithm.value}")
        swap_dir = self.owner.swap_dir

        def publish(target: str) -> bool:
            source = swap_dir.file(staged.file_name)
            if isinstance(source, StripedFile):
                for source_part, target_part in zip(source.parts, target.parts):
                    _replace(source_part, target_part)
            else:
                _replace(source, target)
            swap_dir.untrack(staged.file_name)
            swap_dir.track(_file_name(target))
            del self.staged[sub_group_id]
            self._assign_digests(target, layout, checksums)
            return True

        self.owner.replace_file(sub_group_id, publish, shared=staged.linked)
        if staged.buffer is None:
            return None
        return staged.buffer.view(layout.numel, layout.dtype, layout.offset(0))

    def release_staged(self, staged: StagedState) -> None:
        """Give a published (or discarded) staged state's buffer back to the pool."""
        if staged.buffer is not None:
            self.release_buffer(staged.buffer)
            staged.buffer = None

    def discard_staged(self, staged: StagedState) -> None:
        """Forget a staged state: its staging file is removed, its buffer returned; the
        sub-group is as it was."""
        self.release_staged(staged)
        if self.staged.get(staged.sub_group_id) is staged:
            del self.staged[staged.sub_group_id]
        if not self.owner.swap_dir.closed:
            self.owner.swap_dir.remove(staged.file_name)

    def _assign_digests(self, path: str, layout: SubGroupLayout, checksums: Optional[Carried]) -> None:
        if self.checksums is None:
            return
        self.checksums.forget(path)
        for name, offset in layout.offsets().items():
            self.checksums.assign(path, offset, layout.tensor_bytes, checksums[1][name])


def _file_name(path) -> str:
    """The name of a swap file (a path, or a striped file's parts' name)."""
    return path.name if isinstance(path, StripedFile) else os.path.basename(path)


def _replace(source: str, target: str) -> None:
    """Renames ``source`` over ``target``; the old file's blocks are freed later (_close_later)."""
    if os.path.exists(target) and os.path.samefile(source, target):
        os.unlink(source)  # (a rename between two links of one file would do nothing)
        return
    old = _open_if_last_link(target)
    os.replace(source, target)
    if old >= 0:
        _close_later(old)


class _NoLink(Exception):
    """A part that the file system cannot link (raised and caught inside this module)."""


def _part_pairs(source, dest) -> Optional[List[Tuple[str, str]]]:
    """(source part, dest part) of two files cut alike: both plain, or striped over as many
    parts in units of the same size; None where they are cut differently."""
    if isinstance(source, StripedFile) != isinstance(dest, StripedFile):
        return None
    if not isinstance(source, StripedFile):
        return [(source, dest)]
    if len(source.parts) != len(dest.parts) or source.unit != dest.unit:
        return None
    return list(zip(source.parts, dest.parts))


def _link_each_part(source, dest) -> Set[int]:
    """The parts of ``dest`` made hard links of ``source``'s (both cut alike; a plain file is
    one part): those whose file system allows it; none where they are cut differently."""
    pairs = _part_pairs(source, dest) or []
    linked = set()
    for k, (a, b) in enumerate(pairs):
        try:
            if _hard_link(a, b):
                linked.add(k)
        except OSError:
            pass
    return linked
