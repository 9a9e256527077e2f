"""Crash anywhere, resume exactly (the small version of bench/crash_soak.py): a training
job with parameters and optimizer on NVMe, SIGKILLed 20 times at random instants and
restarted from `latest`, ends bit-identical to an uninterrupted run; every restart loads,
every checkpoint reported complete still loads, killed jobs' swap directories are
reclaimed and a live job's beside them is untouched. Some lives get ENOSPC at a random
write instead: each fails naming the file, and the next resumes from the checkpoint before."""
import importlib.util
import os

TESTS = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("crash_soak", os.path.join(TESTS, "..", "bench", "crash_soak.py"))
crash_soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(crash_soak)


def test_twenty_kills_anywhere_resume_bit_identical(tmp_path):
    result = crash_soak.soak(str(tmp_path), kills=20, max_delay=1.0, seed=1, timeout=600, enospc=0.15,
                             enospc_nth_max=40)
    assert result["failures"] == []
    assert result["kills"] == 20 and result["bit_identical"] and result["losses_equal"]
    assert result["enospc_failures"] >= 1
    assert result["loads"] > 0 and result["checkpoints_completed"] > 0
    assert result["completed_checkpoints_lost"] == [] and result["swap_leftovers"] == []
    assert len(result["phases"]) >= 3, result["phases"]  # the kills land in several phases
