"""nvme_tune end to end: the real command (python -m nvmeio.tune) with a tiny
--io_size and a 4-point sweep; what it prints is a valid handle config, each
bad input exits non-zero with its message before any I/O, and no temporary
file survives (not even Ctrl-C)."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import nvmeio
from helpers import finish_process, is_root, run_process

BACKEND = nvmeio.available_backends()[0]
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
AIO_KEYS = ["block_size", "queue_depth", "intra_op_parallelism", "single_submit",
            "overlap_events", "backend"]
SWEEP = {"block_size": ["1M"], "queue_depth": [8, 32], "intra_op_parallelism": [1, 2]}


def tune(*args, cwd=None, timeout=60, env=None):
    return run_process([sys.executable, "-m", "nvmeio.tune", *map(str, args)], timeout=timeout,
                       cwd=cwd, env=env)


@pytest.fixture
def sweep_file(tmp_path):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(SWEEP))
    return path


@pytest.fixture
def dirs(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    return nvme, tmp_path / "logs"


def small_run(nvme, logs, sweep_file, *extra):
    return tune("--nvme_dir", nvme, "--io_size", "4M", "--sweep_config", sweep_file,
                "--backend", BACKEND, "--log_dir", logs, *extra)


def sweep_points():
    return {(bs, qd, p) for bs in [1 << 20] for qd in SWEEP["queue_depth"]
            for p in SWEEP["intra_op_parallelism"]}


# -- what a successful run prints ---------------------------------------------------

@pytest.fixture(scope="module")
def json_run(tmp_path_factory):
    """One --json run of the 4-point sweep, --loops 2."""
    base = tmp_path_factory.mktemp("json_run")
    nvme, logs, sweep = base / "nvme", base / "logs", base / "sweep.json"
    nvme.mkdir()
    sweep.write_text(json.dumps(SWEEP))
    r = tune("--nvme_dir", nvme, "--io_size", "4M", "--sweep_config", sweep, "--backend",
             BACKEND, "--log_dir", logs, "--json", "--loops", "2")
    assert r.returncode == 0, r.stderr
    return r, nvme, logs


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """One --verbose text run of the 4-point sweep, logging to the default log dir."""
    base = tmp_path_factory.mktemp("text_run")
    nvme, sweep = base / "nvme", base / "sweep.json"
    nvme.mkdir()
    sweep.write_text(json.dumps(SWEEP))
    r = tune("--nvme_dir", nvme, "--io_size", "4M", "--sweep_config", sweep, "--backend",
             BACKEND, "--verbose", cwd=base)
    assert r.returncode == 0, r.stderr
    return r, nvme, base


def test_json_result_is_an_aio_block_that_aio_handle_accepts(json_run):
    r, _, _ = json_run
    result = json.loads(r.stdout)  # stdout is the JSON object and nothing else
    aio = result["aio"]
    assert list(aio) == AIO_KEYS
    assert isinstance(aio["single_submit"], bool) and isinstance(aio["overlap_events"], bool)
    assert (aio["block_size"], aio["queue_depth"], aio["intra_op_parallelism"]) in sweep_points()
    assert aio["backend"] == BACKEND
    h = nvmeio.aio_handle(**aio)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_intra_op_parallelism(),
            h.get_single_submit(), h.get_overlap_events(), h.get_backend()) == \
        tuple(aio[k] for k in AIO_KEYS)
    assert result["read_gbps"] > 0 and result["write_gbps"] > 0
    assert result["configurations"] == len(sweep_points()) == result["runs"]
    assert result["io_size"] == 4 << 20


def test_log_holds_one_json_line_per_run(json_run):
    r, _, logs = json_run
    result = json.loads(r.stdout)
    (log,) = logs.iterdir()
    assert str(log) == result["log"] and log.suffix == ".jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records[0]["event"] == "start" and records[-1]["event"] == "end"
    runs = [rec for rec in records if rec["event"] == "measure"]
    assert len(runs) == result["runs"]
    assert {(x["config"]["block_size"], x["config"]["queue_depth"],
             x["config"]["intra_op_parallelism"]) for x in runs} == sweep_points()
    assert all(x["read_gbps"] > 0 and x["write_gbps"] > 0 and x["error"] is None for x in runs)
    assert records[-1]["aio"] == result["aio"] and records[0]["loops"] == 2


def test_no_temporary_file_is_left(json_run, text_run):
    assert os.listdir(json_run[1]) == [] and os.listdir(text_run[1]) == []


def test_text_output_has_best_gbps_then_a_pastable_aio_block(text_run):
    r, _, _ = text_run
    lines = r.stdout.splitlines()
    best = next(i for i, line in enumerate(lines) if line.startswith("Best performance"))
    read, write = (float(part.split("=")[1]) for part in lines[best].split(":")[1].split(","))
    assert read > 0 and write > 0
    block = json.loads("\n".join(lines[best + 1:]))
    assert list(block) == ["aio"] and list(block["aio"]) == AIO_KEYS
    nvmeio.aio_handle(**block["aio"])
    text = "\n".join(lines[best + 1:])
    assert "num_threads" not in text and '"false"' not in text and '"true"' not in text


def test_verbose_prints_the_space_and_every_run(text_run):
    r, _, _ = text_run
    assert "space: backend" in r.stdout
    assert r.stderr.count("GB/s  write") == len(sweep_points())


def test_default_log_dir_is_aio_bench_logs_in_the_working_directory(text_run):
    _, _, cwd = text_run
    assert [p.suffix for p in (cwd / "_aio_bench_logs").iterdir()] == [".jsonl"]


def test_several_dirs_are_striped_and_cleaned(tmp_path, sweep_file):
    nvme = [tmp_path / f"nvme{i}" for i in range(3)]
    for d in nvme:
        d.mkdir()
    r = tune("--nvme_dir", *nvme, "--io_size", "4M", "--sweep_config", sweep_file,
             "--backend", BACKEND, "--log_dir", tmp_path / "logs", "--json", "--no_read")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    # 4 MiB in three equal, page-aligned parts
    assert result["io_size"] == 3 * ((4 << 20) // 3 // 4096 * 4096)
    assert result["read_gbps"] is None and result["write_gbps"] > 0
    assert result["nvme_dir"] == [str(d) for d in nvme]
    assert all(os.listdir(d) == [] for d in nvme)


def test_budget_stops_the_default_search_early(dirs):
    nvme, logs = dirs
    r = tune("--nvme_dir", nvme, "--io_size", "4M", "--backend", BACKEND, "--log_dir", logs,
             "--budget", "0.001", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["configurations"] == 64 and 1 <= result["runs"] < 16
    assert "--budget" in result["stopped"]
    nvmeio.aio_handle(**result["aio"])


def test_ds_nvme_tune_sweep_file_loads(dirs, tmp_path):
    nvme, logs = dirs
    ds = tmp_path / "ds_sweep.json"
    ds.write_text(json.dumps({"block_size": ["128K", "1M"], "queue_depth": [32],
                              "sequential_requests": [True], "single_submit": [False],
                              "io_parallel": [2]}))
    r = tune("--nvme_dir", nvme, "--io_size", "4M", "--sweep_config", ds, "--backend", BACKEND,
             "--log_dir", logs, "--json")
    assert r.returncode == 0, r.stderr
    aio = json.loads(r.stdout)["aio"]
    assert aio["overlap_events"] is False  # sequential requests = no overlapped reaping
    assert aio["intra_op_parallelism"] == 2 and aio["block_size"] in (128 << 10, 1 << 20)


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib is not installed (extra 'plot')")
def test_plot_writes_a_png(dirs, sweep_file, tmp_path):
    nvme, logs = dirs
    png = tmp_path / "sweep.png"
    r = small_run(nvme, logs, sweep_file, "--plot", png)
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- bad input: a message, a non-zero exit, nothing done -----------------------------

def assert_refused(r, message, nvme=None, logs=None):
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr
    assert r.stdout == ""
    if nvme is not None:
        assert os.listdir(nvme) == []
    if logs is not None:
        assert not logs.exists()  # nothing half-done: not even the log


def test_missing_dir_is_refused(dirs, tmp_path):
    nvme, logs = dirs
    r = tune("--nvme_dir", nvme, tmp_path / "missing", "--log_dir", logs)
    assert_refused(r, f"--nvme_dir '{tmp_path / 'missing'}' does not exist", nvme, logs)


def test_file_instead_of_dir_is_refused(dirs, tmp_path):
    nvme, logs = dirs
    f = tmp_path / "file"
    f.write_text("x")
    assert_refused(tune("--nvme_dir", f, "--log_dir", logs), "is not a directory", None, logs)


@pytest.fixture
def read_only_dir(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    if is_root():
        if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
            pytest.skip("root, and chattr +i is not available to make a directory read-only")
        yield d
        subprocess.run(["chattr", "-i", str(d)], check=True)
    else:
        d.chmod(0o500)
        yield d
        d.chmod(0o700)


def test_unwritable_dir_is_refused(read_only_dir, dirs):
    _, logs = dirs
    r = tune("--nvme_dir", read_only_dir, "--log_dir", logs)
    assert_refused(r, "is not writable", read_only_dir, logs)


def test_unknown_sweep_key_names_it_with_a_hint(dirs, tmp_path):
    nvme, logs = dirs
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"block_sise": ["1M"], "queue_depth": [8]}))
    r = tune("--nvme_dir", nvme, "--sweep_config", bad, "--log_dir", logs)
    assert_refused(r, "unknown key 'block_sise'; did you mean 'block_size'?", nvme, logs)


@pytest.mark.parametrize("content, message", [
    ({"single_submit": ["false"]}, "single_submit values must be JSON booleans"),
    ({"queue_depth": [0]}, "queue_depth values must be positive integers"),
    ({"queue_depth": 8}, "queue_depth must be a list"),
    ({"backend": ["nope"]}, "backend 'nope' is not available here"),
    ([1, 2], "expected a JSON object"),
    ("{not json", "is not valid JSON"),
])
def test_bad_sweep_config_values_are_refused(dirs, tmp_path, content, message):
    nvme, logs = dirs
    bad = tmp_path / "bad.json"
    bad.write_text(content if isinstance(content, str) else json.dumps(content))
    assert_refused(tune("--nvme_dir", nvme, "--sweep_config", bad, "--log_dir", logs),
                   message, nvme, logs)


def test_unknown_backend_is_refused_with_the_available_ones(dirs):
    nvme, logs = dirs
    r = tune("--nvme_dir", nvme, "--backend", "nonesuch", "--log_dir", logs)
    assert_refused(r, "available backends: " + ", ".join(nvmeio.available_backends()),
                   nvme, logs)


def test_no_read_and_no_write_is_refused(dirs):
    nvme, logs = dirs
    r = tune("--nvme_dir", nvme, "--no_read", "--no_write", "--log_dir", logs)
    assert_refused(r, "leave nothing to measure", nvme, logs)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(cuda_available(), reason="this machine has CUDA")
def test_gpu_without_cuda_is_refused(dirs):
    nvme, logs = dirs
    r = tune("--nvme_dir", nvme, "--gpu", "--log_dir", logs)
    assert_refused(r, "--gpu needs a CUDA device, but torch.cuda.is_available() is False",
                   nvme, logs)


@pytest.mark.skipif(cuda_available(), reason="this machine has CUDA")
def test_gds_without_cuda_prints_the_gds_handle_message(dirs):
    nvme, logs = dirs
    r = tune("--nvme_dir", nvme, "--gds", "--log_dir", logs)
    assert_refused(r, "--gds: ", nvme, logs)
    try:
        nvmeio.gds_handle()
    except Exception as e:  # noqa: BLE001 - whatever it raises, its message is passed on
        assert str(e) in r.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("flag", ["--gpu", "--gds"])
def test_on_a_gpu_the_sweep_moves_gpu_memory_and_prints_a_handle_config(dirs, sweep_file, flag):
    """``nvme_tune --nvme_dir ... --gpu`` as DeepNVMe's users run it (and --gds where a gds_handle can be
    made): every run moves a CUDA tensor, and the result is an aio block the handles accept."""
    if flag == "--gds" and nvmeio.gds_unavailable_reason():
        pytest.skip(f"--gds: {nvmeio.gds_unavailable_reason()}")
    nvme, logs = dirs
    gds = flag == "--gds"  # no backend to choose there: cuFile's (nvme_tune refuses --backend with --gds)
    backend = [] if gds else ["--backend", BACKEND]
    r = tune("--nvme_dir", nvme, "--io_size", "4M", "--sweep_config", sweep_file, *backend,
             "--log_dir", logs, "--json", flag, timeout=300)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    keys = AIO_KEYS[:-1] + ["use_gds"] if gds else AIO_KEYS  # the aio block of a gds_handle
    assert list(result["aio"]) == keys and result["read_gbps"] > 0 and result["write_gbps"] > 0
    handle = nvmeio.new_handle(result["aio"])  # the handle a ZeRO config with this block makes
    assert isinstance(handle, nvmeio.gds_handle if gds else nvmeio.aio_handle)
    records = [json.loads(line) for line in (logs / os.path.basename(result["log"])).read_text().splitlines()]
    assert records[0]["event"] == "start" and records[0]["device"] == "cuda"
    runs = [rec for rec in records if rec["event"] == "measure"]
    assert len(runs) == len(sweep_points()) and all(x["error"] is None for x in runs)
    assert os.listdir(nvme) == []


def test_plot_without_matplotlib_is_refused(dirs, tmp_path):
    """matplotlib hidden from the command (a package of that name first on its path that fails
    to import), whether or not it is installed."""
    nvme, logs = dirs
    hidden = tmp_path / "hidden" / "matplotlib"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('matplotlib is hidden by the test')\n")
    path = os.pathsep.join(p for p in (str(hidden.parent), os.environ.get("PYTHONPATH")) if p)
    r = tune("--nvme_dir", nvme, "--plot", tmp_path / "x.png", "--log_dir", logs,
             env=dict(os.environ, PYTHONPATH=path))
    assert_refused(r, "pip install 'nvmeio[plot]'", nvme, logs)


@pytest.mark.parametrize("args, message", [
    (["--io_size", "12Q"], "size '12Q'"),
    (["--loops", "0"], "expected a positive integer"),
    (["--budget", "-1"], "expected a positive number of seconds"),
])
def test_bad_option_values_are_refused(dirs, args, message):
    nvme, logs = dirs
    assert_refused(tune("--nvme_dir", nvme, "--log_dir", logs, *args), message, nvme, logs)


def test_nvme_dir_is_required():
    r = tune()
    assert r.returncode == 2 and "--nvme_dir" in r.stderr


# -- file systems without O_DIRECT, page cache ---------------------------------------

@pytest.fixture
def ramfs_dir(tmp_path):
    """A ramfs mount: a file system that refuses O_DIRECT (needs root)."""
    d = tmp_path / "ramfs"
    d.mkdir()
    if not is_root() or subprocess.run(["mount", "-t", "ramfs", "ramfs", str(d)],
                                       capture_output=True).returncode != 0:
        pytest.skip("cannot mount a ramfs here (needs root and mount rights)")
    yield d
    subprocess.run(["umount", str(d)], check=True)


def test_dir_without_o_direct_is_tuned_in_buffered_mode_and_says_so(ramfs_dir, tmp_path,
                                                                    sweep_file):
    r = small_run(ramfs_dir, tmp_path / "logs", sweep_file, "--json")
    assert r.returncode == 0, r.stderr
    assert "refuses O_DIRECT" in r.stderr and "buffered mode" in r.stderr
    result = json.loads(r.stdout)
    assert result["direct_io"] is False
    nvmeio.aio_handle(**result["aio"])
    assert os.listdir(ramfs_dir) == []


@pytest.fixture
def two_point_sweep(tmp_path):
    path = tmp_path / "sweep2.json"
    path.write_text(json.dumps({"queue_depth": [8, 32]}))
    return path


def test_flush_page_cache_says_what_it_does(dirs, two_point_sweep):
    nvme, logs = dirs
    r = small_run(nvme, logs, two_point_sweep, "--flush_page_cache", "--json", "--no_read")
    assert r.returncode == 0, r.stderr
    can_drop = os.access("/proc/sys/vm/drop_caches", os.W_OK) and is_root()
    if can_drop:
        assert "page cache dropped before every timed op" in r.stderr
    else:
        assert "the page cache is NOT dropped" in r.stderr


def test_flush_page_cache_without_the_right_says_so(dirs, two_point_sweep):
    nvme, logs = dirs
    cmd = [sys.executable, "-m", "nvmeio.tune", "--nvme_dir", str(nvme), "--io_size", "4M",
           "--sweep_config", str(two_point_sweep), "--backend", BACKEND, "--log_dir", str(logs),
           "--flush_page_cache", "--json", "--no_read"]
    if is_root():
        # A private mount namespace where /proc/sys is read-only, as for a non-root user.
        script = ("mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys && "
                  'exec "$@"')
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *cmd]
        probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
        if probe.returncode != 0:
            pytest.skip("root, and unshare cannot make a mount namespace here")
    r = run_process(cmd, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--flush_page_cache: cannot write /proc/sys/vm/drop_caches" in r.stderr
    assert "the page cache is NOT dropped" in r.stderr
    nvmeio.aio_handle(**json.loads(r.stdout)["aio"])


# -- interruption ------------------------------------------------------------------------

def test_sigterm_and_sighup_interrupt_like_ctrl_c():
    from nvmeio.tune import _cli as cli

    for sig in (signal.SIGTERM, signal.SIGHUP):
        with pytest.raises(KeyboardInterrupt):
            cli._raise_interrupt(sig, None)


def test_ctrl_c_removes_the_temporary_files(dirs):
    sig = signal.SIGINT
    nvme, logs = dirs
    # Ctrl-C must reach the child however the tests were launched: under nohup or
    # in a background job SIGINT is ignored, and a child inherits that; it inherits the
    # signal mask of the thread that started it too (a library an earlier test loaded may
    # have left SIGINT blocked there: then the sweep once ran to its end, the signal pending).
    with_ctrl_c = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                   "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
                   "sys.argv[0] = 'nvme_tune'; runpy.run_module('nvmeio.tune', run_name='__main__')")
    p = subprocess.Popen([sys.executable, "-c", with_ctrl_c, "--nvme_dir", str(nvme),
                          "--io_size", "64M", "--search", "grid", "--log_dir", str(logs)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        start = time.monotonic()
        while not os.listdir(nvme) and time.monotonic() < start + 60 and p.poll() is None:
            time.sleep(0.05)
        if not os.listdir(nvme):  # say why: the child ended (how), or it was still starting
            ended = p.poll() is not None
            _, err = p.communicate(timeout=30) if ended else ("", "")
            pytest.fail(f"the sweep never created its file: after {time.monotonic() - start:.1f} s the child "
                        + (f"had exited with {p.returncode}: {err[-2000:]}" if ended else "was still running"))
        time.sleep(0.3)  # into the sweep proper
        p.send_signal(sig)
        _, err = finish_process(p, timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])  # this thread's mask, which the child inherited
    assert p.returncode == 130, f"signals blocked in the test's thread: {sorted(blocked)}\n{err}"
    assert "interrupted; temporary files removed" in err
    assert os.listdir(nvme) == []
    (log,) = logs.iterdir()
    assert json.loads(log.read_text().splitlines()[-1])["error"] == "interrupted"


def test_help_lists_the_ds_nvme_tune_options_and_ours():
    r = tune("--help")
    assert r.returncode == 0
    for option in ("--nvme_dir", "--sweep_config", "--no_read", "--no_write", "--io_size",
                   "--gpu", "--gds", "--flush_page_cache", "--log_dir", "--loops", "--verbose",
                   "--backend", "--budget", "--json", "--plot", "--search"):
        assert option in r.stdout


def test_the_sweep_files_are_created_exclusively_never_through_a_symlink(tmp_path, monkeypatch):
    # nvme_dir may be shared: a symlink planted at the name (here: a guessed
    # one) makes the sweep refuse to start instead of writing through it.
    from nvmeio.tune import _measure as measure

    monkeypatch.setattr(measure.secrets, "token_hex", lambda n: "guessed")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / f"nvme_tune.{os.getpid()}.0.guessed.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        with measure.Workload([str(tmp_path)], 1 << 20, read=False):
            pass
    assert victim.read_bytes() == b"precious"
    monkeypatch.undo()
    with measure.Workload([str(tmp_path)], 1 << 20, read=False) as w:
        (name,) = w.names
        assert os.path.getsize(name) == 1 << 20 and not os.path.islink(name)
    assert not os.path.exists(name)
