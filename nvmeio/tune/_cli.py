"""nvme_tune: find the aio_handle settings that move bytes fastest on your NVMe.

    nvme_tune --nvme_dir /local_nvme                       # smart search, all backends
    nvme_tune --nvme_dir /nvme0 /nvme1 --io_size 1G        # striped over two drives
    nvme_tune --nvme_dir /local_nvme --search grid --plot sweep.png
    python -m nvmeio.tune --nvme_dir /local_nvme --json    # machine-readable result only

The options of ds_nvme_tune, plus --backend, --budget, --search, --json and
--plot. It prints the best read and write GB/s (GB = 1024^3) and the "aio"
block to paste into a ZeRO config. Every run is logged (JSON lines) in
--log_dir. Exit status: 0 done, 1 the measurements failed, 2 bad arguments or
an environment that cannot run them (checked before any I/O), 130
interrupted (temporary files are removed in every case).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any, Optional, Sequence

from .. import env
from ._dirs import check_dir
from ._log import PlotUnavailable, RunLog, plot_results, require_matplotlib
from ._measure import PageCache, Workload, split_io_size
from ._search import METHODS, SearchResult, grid_search, planned_evals, smart_search
from ._space import (Config, SweepConfigError, SweepSpace, build_space, format_size,
                    load_sweep_config, parse_size)

__all__ = ["main", "build_parser"]

PROG = "nvme_tune"
DEFAULT_LOG_DIR = "./_aio_bench_logs"


class UsageError(Exception):
    """Bad input or an environment that cannot run the sweep: exit 2, nothing done."""


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return x


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Sweep nvmeio.aio_handle settings on NVMe directories and print the best "
                    "read/write GB/s and the \"aio\" block for a ZeRO config.")
    p.add_argument("--nvme_dir", nargs="+", required=True, metavar="NVME_DIR",
                   help="writable directory(ies) on the NVMe device(s); with several, every op is "
                        "striped over them (stripe unit = block size) as the swap files of a list "
                        "nvme_path are")
    p.add_argument("--sweep_config", metavar="SWEEP_CONFIG",
                   help="JSON file of lists per key (block_size, queue_depth, "
                        "intra_op_parallelism, single_submit, overlap_events, backend; "
                        "ds_nvme_tune's io_parallel and sequential_requests are accepted); "
                        "a key left out keeps the handle default")
    p.add_argument("--no_read", action="store_true", help="skip read measurements")
    p.add_argument("--no_write", action="store_true",
                   help="skip write measurements (the files are still written once, untimed)")
    p.add_argument("--io_size", type=_size_arg, default=parse_size("400M"), metavar="IO_SIZE",
                   help="bytes per read/write measurement, e.g. 400M, 1G (default 400M)")
    p.add_argument("--gpu", action="store_true",
                   help="transfer between GPU memory and NVMe (needs CUDA)")
    p.add_argument("--gds", action="store_true",
                   help="sweep the GPUDirect Storage handle (nvmeio.gds_handle)")
    p.add_argument("--flush_page_cache", action="store_true",
                   help="drop the page cache before every timed op (needs root)")
    p.add_argument("--log_dir", default=DEFAULT_LOG_DIR,
                   help=f"per-run JSON-lines logs (default {DEFAULT_LOG_DIR})")
    p.add_argument("--loops", type=_positive_int, default=1,
                   help="repetitions of each operation per measurement (default 1)")
    p.add_argument("--verbose", action="store_true", help="print every measurement")
    p.add_argument("--backend", nargs="+", metavar="BACKEND",
                   help="backends to sweep (default: every one available here)")
    p.add_argument("--budget", type=_positive_float, metavar="SECONDS",
                   help="stop the search after this many seconds and report the best so far")
    p.add_argument("--search", choices=METHODS, default="smart",
                   help="smart: coarse grid + coordinate descent in a quarter of the grid's "
                        "runs (default); grid: every configuration once, as ds_nvme_tune")
    p.add_argument("--json", action="store_true",
                   help="print only a JSON object with the result (no progress bar)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="save GB/s against block size and queue depth (needs matplotlib)")
    return p


# -- checks before any I/O -------------------------------------------------------------

def _check_devices(args: argparse.Namespace) -> None:
    import nvmeio

    if args.gds:
        make = getattr(nvmeio, "gds_handle", None)
        if make is None:
            raise UsageError("--gds: this nvmeio has no gds_handle (GPUDirect Storage support "
                             "is not installed); see nvmeio_report")
        try:
            make()  # constructs only where CUDA and kvikio are there
        except Exception as e:  # noqa: BLE001 - its message says what is missing (CUDA, cuFile, kvikio)
            raise UsageError(f"--gds: {e}") from None
    if args.gpu or args.gds:
        import torch

        if not torch.cuda.is_available():
            flag = "--gds" if args.gds else "--gpu"
            build = (f"torch {torch.__version__} is built without CUDA"
                     if torch.version.cuda is None else "no CUDA device is visible")
            raise UsageError(f"{flag} needs a CUDA device, but torch.cuda.is_available() is "
                             f"False ({build})")


def _check_dirs(dirs: Sequence[str], part: int) -> list[str]:
    """Refuses unusable directories; returns those without O_DIRECT."""
    problems, buffered = [], []
    for d in dirs:
        c = check_dir(d)
        if not c.usable:
            problems.append(f"--nvme_dir {d!r} {c.problem}")
            continue
        if c.free_bytes is not None and c.free_bytes < part:
            problems.append(f"--nvme_dir {d!r} has {format_size(c.free_bytes)} free, the sweep "
                            f"needs {format_size(part)} there")
        if not c.direct_io:
            buffered.append(f"{d} ({c.fstype}: {c.direct_error})")
    if problems:
        raise UsageError("; ".join(problems))
    return buffered


def _prepare(args: argparse.Namespace) -> tuple[SweepSpace, int, list[str]]:
    import nvmeio

    if args.no_read and args.no_write:
        raise UsageError("--no_read and --no_write together leave nothing to measure")
    if args.plot:
        try:
            require_matplotlib()
        except PlotUnavailable as e:
            raise UsageError(str(e)) from None
    available = nvmeio.available_backends()
    try:
        sweep = load_sweep_config(args.sweep_config, available) if args.sweep_config else None
        space = build_space(sweep, args.backend, available, gds=args.gds)
    except SweepConfigError as e:
        raise UsageError(str(e)) from None
    try:
        part = split_io_size(args.io_size, len(args.nvme_dir))
    except ValueError as e:
        raise UsageError(str(e)) from None
    _check_devices(args)
    buffered = _check_dirs(args.nvme_dir, part)
    return space, part, buffered


# -- output ----------------------------------------------------------------------------

def _say(args: argparse.Namespace, text: str) -> None:
    if not args.json:
        print(text, flush=True)


def _note(text: str) -> None:
    print(f"{PROG}: note: {text}", file=sys.stderr, flush=True)


def _summary(result: SearchResult, args: argparse.Namespace, workload: Workload,
             buffered: list[str], log: RunLog) -> dict:
    best = result.best
    res = result.results
    return {
        "aio": best.aio_block() if best else None,
        "read_gbps": _r(res.mean(best, "read_gbps")) if best else None,
        "write_gbps": _r(res.mean(best, "write_gbps")) if best else None,
        "samples_of_pick": res.count(best) if best else 0,
        "search": result.method,
        "configurations": result.grid_size,
        "configurations_measured": len(res.samples),
        "runs": result.evals,
        "elapsed_s": round(result.elapsed_s, 2),
        "stopped": result.stopped,
        "io_size": workload.nbytes,
        "nvme_dir": list(args.nvme_dir),
        "direct_io": not buffered,
        "errors": len(res.errors()),
        "log": log.path,
    }


def _r(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 3)


def _print_result(args: argparse.Namespace, summary: dict) -> None:
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    stopped = f", stopped early: {summary['stopped']}" if summary["stopped"] else ""
    print(f"search {summary['search']}: {summary['runs']} runs of "
          f"{summary['configurations_measured']} of {summary['configurations']} configurations "
          f"in {summary['elapsed_s']:.1f} s{stopped}")
    if summary["errors"]:
        print(f"{summary['errors']} runs failed (see the log)")
    print(f"log: {summary['log']}")
    read = "n/a" if summary["read_gbps"] is None else f"{summary['read_gbps']:5.2f}"
    write = "n/a" if summary["write_gbps"] is None else f"{summary['write_gbps']:5.2f}"
    print(f"Best performance (GB/sec): read = {read}, write = {write}")
    print(json.dumps({"aio": summary["aio"]}, indent=2), flush=True)


# -- the run ---------------------------------------------------------------------------

class _Interrupted(KeyboardInterrupt):
    pass


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise _Interrupted(signal.Signals(signum).name)


def _tune(args: argparse.Namespace, space: SweepSpace, buffered: list[str]) -> int:
    from tqdm import tqdm

    page_cache = PageCache(args.flush_page_cache)
    if page_cache.describe():
        _note(page_cache.describe())
    if buffered:
        _note("no O_DIRECT in " + "; ".join(buffered) + ": tuning anyway in buffered mode "
              "(page cache + fdatasync; the files are evicted before every read), so the "
              "numbers are not those of direct I/O")
    elif not env.get("NVMEIO_DIRECT_IO"):
        _note("NVMEIO_DIRECT_IO=0: tuning in buffered mode")
        buffered = ["NVMEIO_DIRECT_IO=0"]
    try:
        log = RunLog(args.log_dir)
    except OSError as e:
        raise UsageError(f"--log_dir {args.log_dir!r}: {e.strerror}") from None
    planned = planned_evals(space, args.search)
    device = "cuda" if (args.gpu or args.gds) else "cpu"
    ndirs = len(args.nvme_dir)
    _say(args, f"{PROG}: {args.search} search over {len(space)} configurations, at most "
               f"{planned} runs; io_size {format_size(split_io_size(args.io_size, ndirs) * ndirs)}"
               f" striped over {ndirs} director{'y' if ndirs == 1 else 'ies'}"
               f"{' from GPU memory' if device == 'cuda' else ''}"
               f"{' with GDS' if args.gds else ''}")
    if args.verbose:
        _say(args, f"space: {space.describe()}")
        _say(args, f"log: {log.path}")
    log.write("start", argv=sys.argv[1:], space=space.as_dict(), search=args.search,
              planned_runs=planned, io_size=args.io_size, loops=args.loops,
              nvme_dir=list(args.nvme_dir), buffered=buffered, device=device,
              flush_page_cache=page_cache.describe(), nvmeio=_version())
    bar = tqdm(total=planned, desc=PROG, unit="run", file=sys.stderr, disable=args.json,
               dynamic_ncols=True)
    t0 = time.monotonic()
    summary: Optional[dict] = None
    try:
        with Workload(args.nvme_dir, args.io_size, loops=args.loops, read=not args.no_read,
                      write=not args.no_write, device=device, gds=args.gds,
                      page_cache=page_cache, buffered_dirs=buffered) as workload:
            for note in workload.notes:
                _note(note)
            best: dict = {}

            def measure(config: Config, phase: str):
                sample = workload.measure(config)
                log.measurement(config, sample, phase, time.monotonic() - t0)
                bar.update(1)
                if not sample.error and sample.score > best.get("score", -1.0):
                    best.update(score=sample.score, label=config.label())
                    bar.set_postfix_str(f"best {sample.score:.2f} GB/s r+w: {config.label()}")
                if args.verbose:
                    r = "-" if sample.read_gbps is None else f"{sample.read_gbps:6.2f}"
                    w = "-" if sample.write_gbps is None else f"{sample.write_gbps:6.2f}"
                    line = sample.error or f"read {r} GB/s  write {w} GB/s"
                    bar.write(f"  [{phase:7}] {config.label():42} {line}", file=sys.stderr)
                return sample

            if args.search == "grid":
                result = grid_search(space, measure, budget_s=args.budget)
            else:
                result = smart_search(space, measure, budget_s=args.budget)
            bar.total = bar.n
            bar.refresh()
            bar.close()
            summary = _summary(result, args, workload, buffered, log)
            errors = result.results.errors()
        if summary["aio"] is None:
            first = errors[0] if errors else (None, "no run finished")
            log.write("end", ok=False, error=first[1])
            print(f"{PROG}: every run failed; the first: {first[1]}", file=sys.stderr)
            return 1
        log.write("end", ok=True, **{k: v for k, v in summary.items() if k != "log"})
        if args.plot:
            title = (f"nvme_tune {summary['search']}: {format_size(summary['io_size'])} over "
                     f"{', '.join(args.nvme_dir)}")
            plot_results(result.results, args.plot, title, read=not args.no_read,
                         write=not args.no_write)
            _say(args, f"plot: {args.plot}")
        _print_result(args, summary)
        return 0
    except KeyboardInterrupt:
        bar.close()
        log.write("end", ok=False, error="interrupted")
        print(f"\n{PROG}: interrupted; temporary files removed", file=sys.stderr)
        return 130
    except OSError as e:
        bar.close()
        log.write("end", ok=False, error=str(e))
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    finally:
        log.close()


def _version() -> str:
    import nvmeio

    return nvmeio.__version__


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    old = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        space, _, buffered = _prepare(args)
        return _tune(args, space, buffered)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
