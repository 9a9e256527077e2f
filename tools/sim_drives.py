"""Simulated drives: loop devices over files of this disk, each with its own ext4 file system and
mount, throttled to a fixed speed by the cgroup v1 blkio controller (root only).

    with SimulatedDrives("/var/tmp/drives", count=4, bytes_per_s=200 << 20, log=print) as drives:
        drives.mounts            # one directory per drive
        drives.join(os.getpid()) # this process's I/O to them is now throttled

[Note: a throttled loop device stands in for a drive]
This machine has one disk. A loop device set up with ``--direct-io=on`` passes O_DIRECT requests
to its backing file without the page cache; a blkio cgroup's ``blkio.throttle.read_bps_device``
and ``write_bps_device`` ("major:minor bytes_per_second") then hold the requests of the processes
in that cgroup to each device to that rate, each device separately. N such devices are N drives
of that speed, as long as N times the speed stays below the real disk's (about 2-3 GiB/s here).
The throttle applies to the processes in the cgroup (``cgroup.procs``): the benchmark moves its
child processes there, never itself, and the kernel's own writes (the ext4 journal) are not held.

Everything set up is torn down by :meth:`close` (also on an error and on Ctrl-C, through the
context manager): the cgroup (its processes moved back to the root group first), the mounts, the
loop devices and their backing files, each step tried whatever the one before did, and said.
"""
from __future__ import annotations

import os
import subprocess
import time
from typing import Callable, List, Optional

BLKIO = "/sys/fs/cgroup/blkio"

__all__ = ["SimulatedDrives", "BLKIO", "join", "unavailable_reason"]


def unavailable_reason() -> Optional[str]:
    """Why simulated drives cannot be set up here, or None."""
    if os.geteuid() != 0:
        return "not root (loop devices, mounts and cgroups need root)"
    if not os.path.exists(os.path.join(BLKIO, "blkio.throttle.read_bps_device")):
        return f"no cgroup v1 blkio controller with throttling at {BLKIO}"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode:
            return f"{tool} is not installed"
    return None


def join(cgroup: str, pid: int) -> None:
    """Moves process ``pid`` into the throttled ``cgroup`` (its I/O to the drives is held to the speed)."""
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
        f.write(str(pid))


def _retry(step: Callable[[], object], seconds: float = 15.0):
    """``step()``, tried again for up to ``seconds`` while it fails: a process that just ended may
    still hold a mount or its cgroup for a moment (io_uring rings are freed after the exit)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return step()
        except (OSError, RuntimeError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _run(cmd: List[str]) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {p.returncode}): {(p.stderr or p.stdout).strip()}")
    return p.stdout.strip()


class SimulatedDrives:
    """``count`` drives of ``size`` bytes each (sparse backing files under ``root``), each
    throttled to ``bytes_per_s`` for reads and for writes (see the [Note])."""

    def __init__(self, root: str, count: int, bytes_per_s: int, size: int = 16 << 30,
                 log: Callable[[str], None] = lambda _line: None):
        self.root, self.count, self.bytes_per_s, self.size, self.log = root, count, bytes_per_s, size, log
        self.backing: List[str] = []
        self.devices: List[str] = []
        self.mounts: List[str] = []
        self.cgroup = os.path.join(BLKIO, f"nvmeio-drives-{os.getpid()}")
        self._cgroup_made = False

    def __enter__(self) -> "SimulatedDrives":
        try:
            self._set_up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _set_up(self) -> None:
        why = unavailable_reason()
        if why:
            raise RuntimeError(f"cannot simulate drives: {why}")
        os.makedirs(self.root, exist_ok=True)
        self.log(f"setting up {self.count} simulated drives under {self.root} (root): a loop device "
                 f"(--direct-io=on) over a sparse {self.size >> 30} GiB file each, ext4, mounted, throttled to "
                 f"{self.bytes_per_s / (1 << 20):.0f} MiB/s read and write by the blkio cgroup {self.cgroup}")
        os.mkdir(self.cgroup)
        self._cgroup_made = True
        for i in range(self.count):
            backing = os.path.join(self.root, f"drive{i}.img")
            with open(backing, "wb") as f:
                f.truncate(self.size)
            self.backing.append(backing)
            device = _run(["losetup", "--direct-io=on", "--find", "--show", backing])
            self.devices.append(device)
            _run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", device])
            mount = os.path.join(self.root, f"drive{i}")
            os.makedirs(mount, exist_ok=True)
            _run(["mount", "-o", "noatime,discard", device, mount])
            self.mounts.append(mount)
            rdev = os.stat(device).st_rdev
            rule = f"{os.major(rdev)}:{os.minor(rdev)} {self.bytes_per_s}"
            for key in ("blkio.throttle.read_bps_device", "blkio.throttle.write_bps_device"):
                with open(os.path.join(self.cgroup, key), "w") as f:
                    f.write(rule)

    def join(self, pid: int) -> None:
        join(self.cgroup, pid)

    def close(self) -> None:
        """Tears down everything set up, each step whatever the others did; says what it did."""
        problems = []
        if self._cgroup_made:
            try:
                with open(os.path.join(self.cgroup, "cgroup.procs")) as f:
                    left = [line.strip() for line in f if line.strip()]
                for pid in left:  # a child still running: back to the root group, so the cgroup can go
                    with open(os.path.join(BLKIO, "cgroup.procs"), "w") as f:
                        f.write(pid)
                _retry(lambda: os.rmdir(self.cgroup))
                self._cgroup_made = False
            except OSError as e:
                problems.append(f"cgroup {self.cgroup}: {e}")
        for mount in reversed(self.mounts):
            try:
                _retry(lambda m=mount: _run(["umount", m]))
                os.rmdir(mount)
            except (OSError, RuntimeError) as e:
                problems.append(str(e))
        for device in reversed(self.devices):
            try:
                _retry(lambda d=device: _run(["losetup", "--detach", d]))
            except RuntimeError as e:
                problems.append(str(e))
        for backing in self.backing:
            try:
                os.unlink(backing)
            except OSError as e:
                problems.append(f"{backing}: {e}")
        if self.mounts or self.devices or self.backing:
            self.log(f"tore down the simulated drives: cgroup, {len(self.mounts)} mounts, {len(self.devices)} loop "
                     f"devices, {len(self.backing)} backing files" + (f"; problems: {problems}" if problems else ""))
        self.mounts, self.devices, self.backing = [], [], []
