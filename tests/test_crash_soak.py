"""Crash anywhere, resume exactly (tests/crash_soak.py, in the small; the long soak is
bench/crash_soak.py): a training job with parameters and optimizer on NVMe, SIGKILLed 12
times at random instants (up to twice the time the uninterrupted run takes between checkpoints:
tests/crash_soak.py [Note: kills reach a checkpoint]) and restarted from `latest`, ends
bit-identical to an uninterrupted run; every restart loads,
every checkpoint reported complete still loads, killed jobs' swap directories are
reclaimed and a live job's beside them is untouched. Some lives get ENOSPC at a random
write instead: each fails naming the file, and the next resumes from the checkpoint before.
The same on two gloo ranks: one rank killed (or given the ENOSPC) per life, the other must
fail on its own within a bound, and both resume."""
import crash_soak


def test_kills_anywhere_resume_bit_identical(tmp_path):
    result = crash_soak.soak(str(tmp_path), kills=12, max_delay=1.0, seed=1, timeout=600, enospc=0.15,
                             enospc_nth_max=40)
    assert result["failures"] == []
    assert result["kills"] == 12 and result["bit_identical"] and result["losses_equal"]
    assert result["enospc_failures"] >= 1
    assert result["loads"] > 0 and result["checkpoints_completed"] > 0
    assert result["completed_checkpoints_lost"] == [] and result["swap_leftovers"] == []
    assert len(result["phases"]) >= 3, result["phases"]  # the kills land in several phases


def test_two_ranks_one_killed_the_other_fails_within_bound_both_resume_bit_identical(tmp_path):
    # No kill during start-up here: the survivor would wait out the rendezvous (pg_timeout),
    # which the long soak does (bench/RELIABILITY.md). Every wait is bounded by the soak:
    # a rank still running `bound` s after its peer died is stopped and reported, and a life
    # longer than `timeout` s too.
    result = crash_soak.soak(str(tmp_path), kills=6, steps=6, save_every=2, max_delay=1.0, seed=3, timeout=300,
                             enospc=0.15, enospc_nth_max=40, ranks=2, pg_timeout=30, start_kills=0.0)
    assert result["failures"] == []
    assert result["kills"] == 6 and result["bit_identical"] and result["losses_equal"]
    assert result["survivor_fail_s"]  # survivors failed on their own (a hung one is a failure above)
    assert result["loads"] > 0 and result["checkpoints_completed"] > 0
    assert result["completed_checkpoints_lost"] == [] and result["swap_leftovers"] == []
    assert len(result["phases"]) >= 2, result["phases"]
