"""bench/gpu_check.py's install stage: the kit tools/gpu_kit.sh makes, what of it to install, and the
commands that build nvmeio from the tree without build isolation or network.

Only the standard library: the check runs it before anything is installed.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from typing import Optional

TARGET_PYTHON = (3, 12)  # the GPU machine's: the kit's wheels are for it
IO_URING_ON = "nvmeio: io_uring backend enabled"  # CMakeLists.txt's messages
IO_URING_OFF = "nvmeio: liburing not found"


@dataclass(frozen=True)
class Kit:
    """The folder tools/gpu_kit.sh makes (its header gives the layout); what it lacks is None or
    empty, and a missing kit is the empty one (``path`` None)."""

    path: Optional[str] = None
    wheels: list = field(default_factory=list)  # paths
    liburing_include: Optional[str] = None  # the folder holding liburing.h
    liburing_library: Optional[str] = None  # liburing.a
    fio_bin: Optional[str] = None  # the folder holding fio
    manifest: Optional[str] = None


def find_kit(path: Optional[str]) -> Kit:
    if not path or not os.path.isdir(path):
        return Kit()
    path = os.path.abspath(path)

    def at(*parts: str) -> Optional[str]:
        p = os.path.join(path, *parts)
        return p if os.path.exists(p) else None

    wheels_dir = os.path.join(path, "wheels")
    wheels = sorted(os.path.join(wheels_dir, w) for w in os.listdir(wheels_dir)
                    if w.endswith(".whl")) if os.path.isdir(wheels_dir) else []
    include = at("liburing", "include")
    return Kit(path=path, wheels=wheels,
               liburing_include=include if include and os.path.isfile(os.path.join(include, "liburing.h")) else None,
               liburing_library=at("liburing", "lib", "liburing.a"),
               fio_bin=os.path.dirname(at("fio", "bin", "fio")) if at("fio", "bin", "fio") else None,
               manifest=at("MANIFEST.txt"))


# -- wheels ----------------------------------------------------------------------------------------

def wheel_fields(filename: str) -> dict:
    """A wheel file name's distribution (normalized), version and tags (PEP 427)."""
    parts = os.path.basename(filename)[:-len(".whl")].split("-")
    return {"name": re.sub(r"[-_.]+", "-", parts[0]).lower(), "version": parts[1],
            "python": parts[-3], "abi": parts[-2], "platform": parts[-1]}


def fits(filename: str, python: tuple = TARGET_PYTHON) -> bool:
    """Whether the wheel installs on CPython ``python`` on manylinux x86_64."""
    w = wheel_fields(filename)
    tag_ok = False
    for tag in w["python"].split("."):
        m = re.fullmatch(r"(py|cp)(\d)(\d*)", tag)
        if not m or int(m.group(2)) != python[0]:
            continue
        minor = int(m.group(3)) if m.group(3) else None
        if m.group(1) == "py" or minor == python[1] or (w["abi"] == "abi3" and minor is not None
                                                         and minor <= python[1]):
            tag_ok = True
    platform_ok = w["platform"] == "any" or any(p.startswith("manylinux") and p.endswith("x86_64")
                                                 for p in w["platform"].split("."))
    return tag_ok and platform_ok


def _version_key(version: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", version))


def installed_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# -- the plan --------------------------------------------------------------------------------------

def install_plan(kit: Kit, root: str, python: str = sys.executable) -> dict:
    """What the install stage runs: the kit's wheels whose distribution is missing here or older
    (pip --no-index --no-deps: each need is named in the kit or already installed), then nvmeio
    from ``root`` without build isolation, liburing from the kit where it holds it. ``warnings``:
    what may keep it from working, found without running anything."""
    problems, wheels, chosen = [], [], []
    if kit.path is None:
        problems.append("no kit (bash tools/gpu_kit.sh makes gpu_kit/): pydantic, kvikio and liburing "
                        "must then be installed already")
    for path in kit.wheels:
        w = wheel_fields(path)
        have = installed_version(w["name"])
        install = have is None or _version_key(have) < _version_key(w["version"])
        wheels.append({"wheel": os.path.basename(path), "fits_cp312": fits(path), "installed": have,
                       "install": install})
        if install:
            chosen.append(path)
        if not fits(path):
            problems.append(f"{os.path.basename(path)} is not for CPython 3.12 manylinux x86_64")
    cmake_defines = []
    if kit.liburing_include and kit.liburing_library:  # the cache entries CMakeLists.txt's find_path/find_library fill
        cmake_defines = [f"--config-settings=cmake.define.LIBURING_INCLUDE_DIR={kit.liburing_include}",
                         f"--config-settings=cmake.define.LIBURING_LIBRARY={kit.liburing_library}"]
    commands = []
    if chosen:
        commands.append(("pip install the kit's wheels",
                         [python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-cache-dir", *chosen]))
    commands.append(("pip install nvmeio from the tree",
                     [python, "-m", "pip", "install", "-v", "--no-index", "--no-deps", "--no-build-isolation",
                      "--no-cache-dir", *cmake_defines, root]))
    needs = {"scikit_build_core": "scikit-build-core", "pybind11": "pybind11"}
    for module, dist in needs.items():
        if importlib.util.find_spec(module) is None:
            problems.append(f"{dist} is not installed (the build runs without isolation)")
    include = sysconfig.get_paths().get("include") or ""
    if not os.path.isfile(os.path.join(include, "Python.h")):
        problems.append(f"no Python.h in {include}: the native module cannot build")
    if not (shutil.which("cmake") or importlib.util.find_spec("cmake")):
        problems.append("cmake is not installed")
    return {"wheels": wheels, "commands": commands, "warnings": problems,
            "liburing": "from the kit" if cmake_defines else "the system's, if CMake finds one"}


def io_uring_line(build_output: str) -> Optional[str]:
    """CMake's line saying whether the io_uring backend was built (pip -v shows it)."""
    for line in build_output.splitlines():
        if IO_URING_ON in line or IO_URING_OFF in line:
            return line.strip().lstrip("-").strip()
    return None


# -- where children import from ----------------------------------------------------------------------

def bench_and_tools_only(root: str) -> str:
    """A new folder holding links to ``root``'s bench/ and tools/ alone: first on a child's path, it
    finds the benchmarks and the installed nvmeio, swapper and zero (not the tree's)."""
    folder = tempfile.mkdtemp(prefix="gpu-check-path-")
    for name in ("bench", "tools"):
        os.symlink(os.path.join(root, name), os.path.join(folder, name))
    return folder


def scratch_parent(requested: Optional[str], root: str) -> str:
    """Where swap and test files go: ``requested``, else the temporary folder unless it lives in
    memory (tmpfs, ramfs: no O_DIRECT and no disk to measure), else ``root``."""
    if requested:
        return requested
    tmp = tempfile.gettempdir()
    try:
        fs = subprocess.run(["df", "-P", "-T", tmp], capture_output=True, text=True).stdout.splitlines()[-1].split()[1]
    except (OSError, IndexError):
        fs = "?"
    return root if fs in ("tmpfs", "ramfs") else tmp
