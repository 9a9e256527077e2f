#!/usr/bin/env bash
# Prepares the kit that `python -m bench.gpu_check` installs from on a GPU machine with no network:
# what that machine lacks, fetched here, where PyPI and Debian's packages are reachable.
#
#     bash tools/gpu_kit.sh            # -> gpu_kit/ at the repository root (git-ignored)
#     bash tools/gpu_kit.sh DIR        # -> DIR
#
# The kit (the layout bench/gpu_check.py's find_kit reads):
#     wheels/*.whl                     cp312 manylinux x86_64 wheels, no dependencies resolved:
#                                      pydantic and its own, kvikio-cu13 and its native parts
#     liburing/include/liburing.h      liburing's headers and static library (Debian's
#     liburing/include/liburing/*.h    liburing-dev), so that the io_uring backend builds
#     liburing/lib/liburing.a
#     fio/bin/fio, fio/lib/*           fio and the libraries it loads, only if they fit
#     MANIFEST.txt                     what the kit holds, written last
# Exit status: 0 the kit is complete and under the size limit (GPU_KIT_LIMIT_MIB, 40), 1 not.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KIT=${1:-$ROOT/gpu_kit}
LIMIT_MIB=${GPU_KIT_LIMIT_MIB:-40}
PYTHON=${PYTHON:-python3}
# Versions that go together: pydantic pins pydantic-core; pydantic 2.13 needs typing-extensions
# >= 4.14.1 (the torch image may hold an older one); kvikio-cu13 26.10 pins libkvikio-cu13 26.10,
# which pins rapids-logger 0.3 (its other needs, cupy-cuda13x, cuda-toolkit[cufile] and
# cuda-pathfinder, are in the GPU machine's image).
WHEELS=(pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
        typing-extensions==4.16.0 kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 rapids-logger==0.3.0)
# glibc's own libraries: the GPU machine has its own (newer) ones, and fio must use those.
GLIBC_LIBS='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libresolv)[.-]'

say() { printf 'gpu_kit: %s\n' "$*"; }
die() { printf 'gpu_kit: error: %s\n' "$*" >&2; exit 1; }
mib() { du -sb "$@" | awk '{s += $1} END {printf "%.1f", s / 1048576}'; }

# A folder is replaced only if it is empty or a kit (MANIFEST.txt): never someone's other files.
if [[ -e $KIT ]]; then
  if [[ -n $(ls -A "$KIT") && ! -f $KIT/MANIFEST.txt ]]; then
    die "$KIT exists and is not a kit (no MANIFEST.txt): choose another folder"
  fi
  rm -rf "$KIT"
fi
mkdir -p "$KIT/wheels" "$KIT/liburing/include" "$KIT/liburing/lib"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

say "wheels for CPython 3.12, manylinux x86_64: ${WHEELS[*]}"
# pip matches each platform tag exactly: these cover the tags the wheels above carry.
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$KIT/wheels" "${WHEELS[@]}" || die "pip download failed (is PyPI reachable?)"
[[ $(ls "$KIT/wheels" | wc -l) -eq ${#WHEELS[@]} ]] || die "expected ${#WHEELS[@]} wheels, got: $(ls "$KIT/wheels")"

say "liburing: Debian's liburing-dev (header and static library)"
chmod 777 "$WORK"  # apt-get download writes as its sandbox user where it can
if ! (cd "$WORK" && apt-get download -qq liburing-dev 2>/dev/null); then
  say "apt-get download failed: apt-get update, then again"
  apt-get update -qq
  (cd "$WORK" && apt-get download -qq liburing-dev) || die "apt-get download liburing-dev failed"
fi
dpkg-deb -x "$WORK"/liburing-dev_*.deb "$WORK/liburing-dev"
cp "$WORK/liburing-dev/usr/include/liburing.h" "$KIT/liburing/include/"
cp -r "$WORK/liburing-dev/usr/include/liburing" "$KIT/liburing/include/"
find "$WORK/liburing-dev" -name liburing.a -exec cp {} "$KIT/liburing/lib/" \;
[[ -f $KIT/liburing/lib/liburing.a ]] || die "liburing-dev holds no liburing.a"
LIBURING_VERSION=$(dpkg-deb -f "$WORK"/liburing-dev_*.deb Version)

# fio: the binary installed here and every library it loads but glibc's, if the kit stays under
# its limit with them; else it is left out and gpu_check takes nvme_tune's best as the disk's time.
FIO_NOTE="left out: fio is not installed here (apt-get install fio)"
if FIO=$(command -v fio); then
  mkdir -p "$WORK/fio/bin" "$WORK/fio/lib"
  cp "$FIO" "$WORK/fio/bin/fio.bin"
  ldd "$FIO" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r name path; do
    if [[ ! $name =~ $GLIBC_LIBS ]]; then cp -L "$path" "$WORK/fio/lib/$name"; fi
  done
  # The wrapper: fio's libraries for fio alone, never on the path of the Python that runs the check.
  cat > "$WORK/fio/bin/fio" <<'EOF'
#!/bin/sh
here=$(cd "$(dirname "$0")" && pwd)
LD_LIBRARY_PATH="$here/../lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/fio.bin" "$@"
EOF
  chmod +x "$WORK/fio/bin/fio"
  with=$(mib "$KIT" "$WORK/fio")
  if awk -v a="$with" -v b="$LIMIT_MIB" 'BEGIN {exit !(a <= b)}'; then
    mv "$WORK/fio" "$KIT/fio"
    FIO_NOTE="$("$FIO" --version) with $(ls "$KIT/fio/lib" | wc -l) libraries"
  else
    FIO_NOTE="left out: $("$FIO" --version) and its $(ls "$WORK/fio/lib" | wc -l) libraries take $(mib "$WORK/fio") MiB, the kit would be $with MiB (limit $LIMIT_MIB); gpu_check uses nvme_tune's best as the disk's reference"
  fi
fi
say "fio: $FIO_NOTE"

{
  echo "gpu_kit made $(date -u '+%Y-%m-%d %H:%M UTC') by tools/gpu_kit.sh"
  echo "wheels: ${WHEELS[*]}"
  echo "liburing-dev: $LIBURING_VERSION"
  echo "fio: $FIO_NOTE"
  echo
  (cd "$KIT" && find . -type f ! -name MANIFEST.txt -printf '%10s  %P\n' | sort -k2)
} > "$KIT/MANIFEST.txt"

SIZE=$(mib "$KIT")
say "$KIT holds ($SIZE MiB):"
sed -n '/^$/,$p' "$KIT/MANIFEST.txt" | sed 1d
if ! awk -v a="$SIZE" -v b="$LIMIT_MIB" 'BEGIN {exit !(a <= b)}'; then
  die "$KIT is $SIZE MiB, over the $LIMIT_MIB MiB limit"
fi
say "done: $SIZE MiB (limit $LIMIT_MIB MiB). On the GPU machine, carrying it: python -m bench.gpu_check --out \$OUT"
