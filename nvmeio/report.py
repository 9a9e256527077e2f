"""nvmeio_report: what this nvmeio can do on this machine, and how to fix what it cannot.

    nvmeio_report                       # version, build, backends, memlock, CUDA/GDS
    nvmeio_report --dir /local_nvme     # + can that directory do O_DIRECT?
    python -m nvmeio.report --json      # the same as one JSON object

Like ``ds_report``: one line per piece, ``[OKAY]``, ``[WARN]`` or ``[NO]``, and
under each missing piece the one command (or step) that fixes it. Exit
status 1 when a ``--dir`` cannot be used at all (missing, not writable),
else 0.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import sys
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

__all__ = ["Check", "collect", "main"]

OK, WARN, NO, INFO = "ok", "warn", "no", "info"
_TAGS = {OK: "[OKAY]", WARN: "[WARN]", NO: "[NO]  ", INFO: "      "}
BACKENDS = ("io_uring", "aio", "psync")
LOCK_PROBE = 64 << 20
REINSTALL = "pip install --force-reinstall --no-deps --no-build-isolation ."


@dataclass
class Check:
    section: str
    name: str
    status: str                 # ok / warn / no / info
    detail: str
    fix: Optional[str] = None   # the command (or step) that fixes a warn / no


# -- nvmeio and its build --------------------------------------------------------------

def _install_mode() -> str:
    try:
        dist = importlib.metadata.distribution("nvmeio")
    except importlib.metadata.PackageNotFoundError:
        return "not installed as a distribution (imported from a source tree)"
    text = dist.read_text("direct_url.json")
    if text:
        try:
            info = json.loads(text)
        except ValueError:
            info = {}
        if info.get("dir_info", {}).get("editable"):
            return f"editable install of {info.get('url', '?')}"
    return f"installed {dist.version}"


def _nvmeio_checks() -> list[Check]:
    import nvmeio
    from nvmeio import _native

    s = "nvmeio"
    checks = [
        Check(s, "version", INFO, nvmeio.__version__),
        Check(s, "package", INFO, os.path.dirname(nvmeio.__file__)),
        Check(s, "install", INFO, _install_mode()),
        Check(s, "native module", INFO, getattr(_native, "__file__", "?")),
        Check(s, "python", INFO, f"{platform.python_version()} ({sys.executable})"),
        Check(s, "kernel", INFO, f"{platform.system()} {platform.release()} "
                                 f"{platform.machine()}"),
    ]
    for mod in ("torch", "numpy", "tqdm"):
        checks.append(_module_check(s, mod, f"pip install {mod}"))
    checks.append(_module_check(s, "matplotlib", "pip install 'nvmeio[plot]'",
                                missing_status=WARN, purpose="nvme_tune --plot"))
    return checks


def _module_check(section: str, mod: str, fix: str, missing_status: str = NO,
                  purpose: str = "") -> Check:
    if importlib.util.find_spec(mod) is None:
        why = f"not installed{f' (needed by {purpose})' if purpose else ''}"
        return Check(section, mod, missing_status, why, fix)
    try:
        version = importlib.metadata.version(mod)
    except importlib.metadata.PackageNotFoundError:
        version = "installed"
    return Check(section, mod, OK, version)


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _backend_checks() -> list[Check]:
    import nvmeio
    from nvmeio import _native

    s = "backends"
    available = nvmeio.available_backends()
    uring_built = getattr(_native, "HAVE_IO_URING", None)
    checks = [Check(s, "build", INFO,
                    f"io_uring compiled in: {_yes_no(uring_built)}; O_DIRECT alignment "
                    f"{getattr(_native, 'DIRECT_ALIGNMENT', '?')} bytes; default backend "
                    f"{available[0] if available else '?'}")]
    for name in BACKENDS:
        if name in available:
            checks.append(Check(s, name, OK, "compiled and usable on this kernel"))
        elif name == "io_uring":
            checks.append(_uring_missing(uring_built))
        elif name == "aio":
            checks.append(_aio_missing())
        else:
            checks.append(Check(s, name, NO, "not available (unexpected: it needs only "
                                             "pread/pwrite)", REINSTALL))
    return checks


def _yes_no(flag: Optional[bool]) -> str:
    return "unknown" if flag is None else ("yes" if flag else "no")


def _uring_missing(built: Optional[bool]) -> Check:
    s = "backends"
    if built is False:
        return Check(s, "io_uring", WARN, "not compiled (liburing was not found at build time)",
                     f"apt-get install -y liburing-dev && {REINSTALL}")
    disabled = _read("/proc/sys/kernel/io_uring_disabled")
    if disabled not in (None, "0"):
        return Check(s, "io_uring", WARN,
                     f"compiled, but disabled by the kernel (kernel.io_uring_disabled = "
                     f"{disabled})", "sysctl -w kernel.io_uring_disabled=0")
    major, minor = _kernel_version()
    if (major, minor) < (5, 6):
        return Check(s, "io_uring", WARN, f"compiled, but kernel {platform.release()} is older "
                                          "than 5.6", "upgrade the kernel to 5.6 or newer")
    return Check(s, "io_uring", WARN,
                 "compiled, but io_uring_setup is refused (a container seccomp profile blocks "
                 "it, as Docker's default does)",
                 "run the container with --security-opt seccomp=unconfined (or a profile that "
                 "allows io_uring_setup/io_uring_enter)")


def _aio_missing() -> Check:
    s = "backends"
    nr, max_nr = _read("/proc/sys/fs/aio-nr"), _read("/proc/sys/fs/aio-max-nr")
    if nr is not None and max_nr is not None and int(nr) >= int(max_nr) - 1024:
        return Check(s, "aio", WARN, f"io_setup refused: fs.aio-nr {nr} of fs.aio-max-nr "
                                     f"{max_nr} in use", "sysctl -w fs.aio-max-nr=1048576")
    if max_nr is None:
        return Check(s, "aio", WARN, "the kernel has no AIO support (no /proc/sys/fs/aio-max-nr)",
                     "use a kernel built with CONFIG_AIO=y (nvmeio uses io_uring or psync "
                     "meanwhile)")
    return Check(s, "aio", WARN, "io_setup is refused (a seccomp profile blocks it?)",
                 "run the container with --security-opt seccomp=unconfined")


def _kernel_version() -> tuple[int, int]:
    parts = platform.release().split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return 0, 0


# -- directories -----------------------------------------------------------------------

def _dir_checks(dirs: Sequence[str]) -> list[Check]:
    from nvmeio.tune._dirs import check_dir

    s = "directories"
    if not dirs:
        return [Check(s, "O_DIRECT", INFO, "pass --dir DIR to check a directory")]
    checks = []
    for d in dirs:
        c = check_dir(d)
        if not c.usable:
            fix = f"mkdir -p {d}" if c.problem == "does not exist" else \
                f"chown $(id -u):$(id -g) {d}" if "writable" in (c.problem or "") else \
                "pass a directory"
            checks.append(Check(s, d, NO, c.problem or "unusable", fix))
        elif c.direct_io:
            checks.append(Check(s, d, OK, f"O_DIRECT works ({c.fstype}, "
                                          f"{_gib(c.free_bytes)} free)"))
        else:
            checks.append(Check(s, d, WARN,
                                f"no O_DIRECT on {c.fstype}: {c.direct_error}; nvmeio falls back "
                                "to buffered I/O + fdatasync here",
                                "put nvme_path on a local ext4 or xfs file system on the NVMe "
                                "drive"))
    return checks


def _gib(n: Optional[int]) -> str:
    return "?" if n is None else f"{n / (1 << 30):.1f} GiB"


# -- memory locking ----------------------------------------------------------------------

def _has_cap_ipc_lock() -> bool:
    status = _read("/proc/self/status") or ""
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) & (1 << 14))  # CAP_IPC_LOCK = 14
    return False


def _limit(x: int) -> str:
    return "unlimited" if x == resource.RLIM_INFINITY else f"{x / (1 << 20):g} MiB"


def _memlock_checks() -> list[Check]:
    from nvmeio import _native

    s = "memory"
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limits = f"memlock limit soft {_limit(soft)}, hard {_limit(hard)}"
    cap = _has_cap_ipc_lock()
    region = _native.LockedBuffer(LOCK_PROBE, True)
    locked, why = region.locked, region.lock_error
    region.unlock()
    del region
    if locked:
        extra = " (CAP_IPC_LOCK: the limit does not apply)" if cap else ""
        return [Check(s, "locked memory", OK,
                      f"{limits}; locking {LOCK_PROBE >> 20} MiB works{extra}")]
    if soft != hard and (hard == resource.RLIM_INFINITY or hard > soft):
        fix = "ulimit -l unlimited   (the hard limit allows it)"
    else:
        fix = "echo '* - memlock unlimited' | sudo tee -a /etc/security/limits.conf  (then log in again)"
    return [Check(s, "locked memory", WARN,
                  f"{limits}; locking {LOCK_PROBE >> 20} MiB failed ({why}): "
                  "new_cpu_locked_tensor returns unpinned memory", fix)]


# -- CUDA, cuFile, kvikio ---------------------------------------------------------------

def _find_cufile() -> Optional[str]:
    import ctypes
    import ctypes.util

    names = [ctypes.util.find_library("cufile"), "libcufile.so.0", "libcufile.so"]
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        for base in spec.submodule_search_locations:
            names.append(os.path.join(base, "cufile", "lib", "libcufile.so.0"))
    for name in names:
        if not name:
            continue
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            continue
    return None


def _gpu_checks() -> list[Check]:
    s = "gpu"
    checks = []
    try:
        import torch
    except ImportError:
        return [Check(s, "CUDA", NO, "torch is not installed", "pip install torch")]
    cuda = torch.cuda.is_available()
    if cuda:
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        checks.append(Check(s, "CUDA", OK, f"torch {torch.__version__}, CUDA "
                                           f"{torch.version.cuda}: {names}"))
    elif torch.version.cuda is None:
        checks.append(Check(s, "CUDA", NO, f"torch {torch.__version__} is built without CUDA",
                            "pip install torch --index-url https://download.pytorch.org/whl/cu126"))
    else:
        checks.append(Check(s, "CUDA", NO, f"torch {torch.__version__} has CUDA "
                                           f"{torch.version.cuda} but sees no GPU",
                            "install the NVIDIA driver (nvidia-smi must list the GPU)"))
    lib = _find_cufile()
    checks.append(Check(s, "cuFile", OK, f"loads ({lib})") if lib else
                  Check(s, "cuFile", NO, "libcufile is not found (GPUDirect Storage)",
                        "pip install nvidia-cufile-cu12"))
    if importlib.util.find_spec("kvikio") is None:
        checks.append(Check(s, "kvikio", NO, "not installed (gds_handle uses it)",
                            "pip install 'nvmeio[gds]'   (kvikio-cu12)"))
    else:
        try:
            version = importlib.metadata.version("kvikio-cu12")
        except importlib.metadata.PackageNotFoundError:
            version = "installed"
        checks.append(Check(s, "kvikio", OK, version))
    checks.append(_gds_handle_check(cuda))
    return checks


def _gds_handle_check(cuda: bool) -> Check:
    import nvmeio

    s = "gpu"
    make = getattr(nvmeio, "gds_handle", None)
    if make is None:
        return Check(s, "gds_handle", NO, "this nvmeio has no gds_handle",
                     "pip install --upgrade nvmeio")
    if not cuda:
        return Check(s, "gds_handle", NO, "needs CUDA (see above)", None)
    try:
        make()
    except Exception as e:  # noqa: BLE001 - its message names what is missing
        return Check(s, "gds_handle", NO, str(e), None)
    return Check(s, "gds_handle", OK, "constructs")


# -- output ------------------------------------------------------------------------------

def collect(dirs: Sequence[str] = ()) -> list[Check]:
    return (_nvmeio_checks() + _backend_checks() + _dir_checks(dirs) + _memlock_checks()
            + _gpu_checks())


def render(checks: Sequence[Check]) -> str:
    bar = "-" * 72
    lines = [bar, "nvmeio report", bar]
    section = None
    for c in checks:
        if c.section != section:
            section = c.section
            lines.append(f"{section}:")
        dots = "." * max(2, 22 - len(c.name))
        head = f"  {c.name} {dots} {_TAGS[c.status]} "
        lines.append(head + c.detail)
        if c.fix and c.status in (WARN, NO):
            lines.append(" " * len(head) + f"fix: {c.fix}")
    lines.append(bar)
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="nvmeio_report",
                                description="Report what nvmeio can do here and how to fix "
                                            "what it cannot.")
    p.add_argument("--dir", action="append", default=[], metavar="DIR",
                   help="check O_DIRECT, writability and free space in DIR (repeatable)")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    args = p.parse_args(argv)
    checks = collect(args.dir)
    if args.json:
        print(json.dumps({"checks": [asdict(c) for c in checks]}, indent=2))
    else:
        print(render(checks))
    unusable = [c for c in checks if c.section == "directories" and c.status == NO]
    return 1 if unusable else 0


if __name__ == "__main__":
    sys.exit(main())
