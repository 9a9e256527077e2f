"""The publish protocol of a checkpoint directory: written under a partial name, made
visible whole, never deleting the only complete copy of a tag.

[Note: a checkpoint becomes visible only when complete]
Every rank writes into ``<save_dir>/.partial-<random>/`` (made by rank 0,
exclusively, and its name broadcast; the name leaves the tag out, so that any
tag a directory can be named, up to 255 bytes, saves); after a barrier rank 0
publishes it as ``<tag>`` and only then rewrites ``latest`` (an exclusive
temporary file, renamed: nvmeio.atomic_file). Each file is fsynced before the rename. A crash
at any point therefore leaves ``latest`` naming the previous complete
checkpoint. Re-saving an existing tag swaps the two directories in one step
(``renameat2(RENAME_EXCHANGE)``), so ``<tag>`` always names a complete copy;
where the file system cannot exchange, the old copy is renamed to
``.<tag>.old-<random>`` first, a load finds it there if a crash came between
the two renames, and the next save renames it back rather than deleting it:
no step ever deletes the only complete copy of a tag. (That name must hold the
tag for a load and the next save to know whose copy it is, so there a tag of
more than 241 bytes cannot be saved again: refused before either rename, the
new copy removed, the old one untouched.) A copy is deleted only
after a rename to a partial name, so a deletion stopped half way never leaves
an incomplete directory where a load or a recovery looks. Partial directories
are removed by the next save (which assumes one job saves into a directory
at a time). Re-saving a tag never mixes old and new shards (a checkpoint saved
again with another world size has no stale rank files).

Files are created exclusively (never through a planted symlink, see
nvmeio/atomic_file.py) with mode ``checkpoint.file_mode`` (0600) and directories
with the same bits plus search (0700): model state is the user's data.
"""
from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil

from nvmeio.atomic_file import create_exclusive, exchange, fsync_directory

from .format import NAME_MAX, OLD_COPY

PARTIAL = ".partial-"  # in ".partial-<random>": a save in progress (or one that died); older
                       # saves named theirs ".<tag>.partial-<random>", which cleanup finds alike
PROBE = ".node-probe-"  # in ".node-probe-<random>": a file that tells which ranks share a directory
                        # (storage.py); removed by the save that made it, or by the next one


def create_file(path: str, mode: int):
    """A new file, created exclusively (an existing file or symlink is refused), ``mode`` exactly."""
    fd = create_exclusive(path, mode)
    try:
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


def make_dir(path: str, mode: int) -> None:
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        if os.path.islink(path) or not os.path.isdir(path):
            raise
    os.chmod(path, mode)


def discard(save_dir: str, path: str) -> None:
    """Delete a complete copy: renamed to a partial name first, so that a deletion stopped half
    way never leaves a damaged directory under a name a load or a recovery trusts."""
    doomed = os.path.join(save_dir, f".discarded{PARTIAL}{secrets.token_hex(4)}")
    os.rename(path, doomed)
    fsync_directory(save_dir)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_leftovers(save_dir: str) -> None:
    """Partial directories of saves that died go (and their probe files); a complete copy moved
    aside by a re-save cut between its renames is renamed back to its tag when the tag is
    missing, else deleted. Every ``.old`` directory is complete (:func:`discard`), so whichever
    is renamed back is."""
    entries = sorted(os.listdir(save_dir), key=lambda e: -_mtime(os.path.join(save_dir, e)))
    for entry in entries:
        path = os.path.join(save_dir, entry)
        if entry.startswith(PROBE) and not os.path.isdir(path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            continue
        if not entry.startswith(".") or os.path.islink(path) or not os.path.isdir(path):
            continue
        if PARTIAL in entry or entry.endswith(".partial"):
            shutil.rmtree(path, ignore_errors=True)
        elif OLD_COPY in entry:
            tag = entry[1:entry.rindex(OLD_COPY)]
            if os.path.isdir(os.path.join(save_dir, tag)):
                discard(save_dir, path)
            else:
                os.rename(path, os.path.join(save_dir, tag))  # the newest moved-aside copy comes first
                fsync_directory(save_dir)


def _mtime(path: str) -> float:
    try:
        return os.lstat(path).st_mtime
    except FileNotFoundError:  # a probe its maker removed meanwhile
        return 0.0


def publish(save_dir: str, partial: str, tag: str) -> None:
    """Make the complete ``partial`` the directory of ``tag`` (see the [Note] above)."""
    final = os.path.join(save_dir, tag)
    if not os.path.lexists(final):
        os.rename(partial, final)
        fsync_directory(save_dir)
        return
    if exchange(partial, final):  # final is the new copy, partial the old one
        fsync_directory(save_dir)
        shutil.rmtree(partial)
        return
    old_name = f".{tag}{OLD_COPY}{secrets.token_hex(4)}"
    _check_old_copy_name(old_name, tag, partial, final)
    old = os.path.join(save_dir, old_name)
    os.rename(final, old)
    os.rename(partial, final)  # a crash just before: checkpoint_path() finds the copy at `old`
    fsync_directory(save_dir)
    discard(save_dir, old)


def _check_old_copy_name(old_name: str, tag: str, partial: str, final: str) -> None:
    """Refuses (ENAMETOOLONG, before either rename) a moved-aside name longer than a file name
    can be; the new copy is removed, the old one is untouched (see the [Note] above)."""
    length = len(os.fsencode(old_name))
    if length <= NAME_MAX:
        return
    longest_tag = NAME_MAX - (length - len(os.fsencode(tag)))
    shutil.rmtree(partial, ignore_errors=True)  # under a partial name: a deletion cut short is safe
    raise OSError(errno.ENAMETOOLONG,
                  f"cannot save checkpoint {tag!r} again: this file system cannot exchange two "
                  f"directories in one step, and the name the previous copy is moved aside to "
                  f"(.<tag>{OLD_COPY}<random>) would be {length} bytes, over the {NAME_MAX}-byte "
                  f"limit of a file name. The previous copy is untouched and what this save wrote "
                  f"is removed; save under another tag, or re-save tags of at most {longest_tag} "
                  f"bytes here", final)


def set_file_modes(directory: str, mode: int) -> None:
    """The writers create files 0600; another ``checkpoint.file_mode`` is set once they are written."""
    if mode == 0o600:
        return
    for entry in os.scandir(directory):
        if entry.is_file(follow_symlinks=False):
            os.chmod(entry.path, mode)
