"""``import nvmeio`` (and swapper, zero) changes nothing in the process: the open-file limit is raised
and NVMEIO_FAULTS armed at the first native handle instead (nvmeio/_process.py)."""
import os
import sys

from helpers import run_process

CHILD = """
import resource, sys, warnings
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import nvmeio, swapper, zero
    from nvmeio import faults
    print("after import", resource.getrlimit(resource.RLIMIT_NOFILE)[0], faults._armed is not None, len(caught))
    h = nvmeio.aio_handle()
    print("after a handle", resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 256, faults._armed is not None,
          [str(w.message).split(" (")[0] for w in caught])
    h.close()
"""


def test_importing_raises_no_limit_and_arms_nothing_until_the_first_handle():
    env = dict(os.environ, NVMEIO_FAULTS="fail_nth=1000000, op=read, path_contains=nothing-matches")
    r = run_process([sys.executable, "-c", CHILD], env=env, timeout=120, check=True)
    lines = r.stdout.splitlines()
    assert lines[0] == "after import 256 False 0", r.stdout + r.stderr
    assert lines[1] == "after a handle True True ['nvmeio: fault injection is ON']", r.stdout + r.stderr


def test_an_explicit_plan_meets_the_environments_as_when_it_was_armed_at_import():
    # The environment's plan is armed by the first inject() too, which then refuses to nest.
    code = ("from nvmeio import faults\n"
            "try:\n"
            "    with faults.inject(fail_nth=1):\n"
            "        pass\n"
            "except RuntimeError as e:\n"
            "    print(e)\n")
    env = dict(os.environ, NVMEIO_FAULTS="fail_nth=5")
    r = run_process([sys.executable, "-c", code], env=env, timeout=120, check=True)
    assert "faults are already being injected" in r.stdout, r.stdout + r.stderr
