"""A training step that fails on I/O (faults injected in nvmeio's core: the optimizer or the
parameter swap directory refusing writes, or failing reads, for one step) is never half applied
silently: the engine refuses to go on until the step is finished or a checkpoint loaded, says
so, and a run that finishes the step reaches exactly the losses and weights of a run that never
failed; resuming from the last checkpoint works too."""
import errno
import os
import re

import pytest

import zero
from nvmeio import faults
from zero.examples import GPTConfig, make_batches
from helpers import (make_engine, parameter_read_dir, run_ranks, same_weights, scenario_io_fails_on_one_rank,
                     scenario_step_fails_on_one_rank, train_engine, weights)

CFG = GPTConfig()
BATCHES = make_batches(CFG, 4, 4)


# Engines step after backward unless a test asks for STEP_IN_BACKWARD (then a failure hits backward
# instead). Parameters have swap files of their own with bf16 only (fp32 shards live in the
# optimizer's master, zero/stores/param_store.py [Note]): the tests of parameter writes use bf16.
STEP_AFTER_BACKWARD = {"zero_optimization": {"offload_optimizer": {"step_in_backward": False}}}
STEP_IN_BACKWARD = {"zero_optimization": {"offload_optimizer": {"step_in_backward": True}}}


def train_reference(nvme, precision):
    engine = make_engine(nvme, lr=1e-2, precision=precision, overrides=STEP_AFTER_BACKWARD)
    losses = train_engine(engine, BATCHES, 4)
    final = weights(engine.module)
    engine.destroy()
    return losses, final


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train_reference(tmp_path_factory.mktemp("ref"), "fp32")


@pytest.fixture(scope="module")
def bf16_reference(tmp_path_factory):
    return train_reference(tmp_path_factory.mktemp("ref16"), "bf16")


def precision_for(which):
    return "bf16" if which == "params" else "fp32"


def swap_dir(engine, which):
    return (engine.parts.optimizer_store if which == "optimizer" else engine.parts.param_store).swap_dir


@pytest.mark.parametrize("which", ["optimizer", "params"])
def test_a_step_whose_writes_fail_is_refused_until_finished_then_matches(tmp_path, request, which):
    reference = request.getfixturevalue("bf16_reference" if which == "params" else "reference")
    engine = make_engine(tmp_path, lr=1e-2, precision=precision_for(which), overrides=STEP_AFTER_BACKWARD)
    losses = train_engine(engine, BATCHES[:1], 1)
    loss = engine(*BATCHES[1])
    losses.append(loss.item())
    engine.backward(loss)
    with faults.inject(fail_nth=1, fail_count=0, errno="EROFS", path_contains=swap_dir(engine, which),
                       op="write") as fired:
        with pytest.raises(OSError) as info:
            engine.step()
        assert fired()["failed"] >= 1
    assert info.value.errno == errno.EROFS and swap_dir(engine, which) in str(info.value)
    assert engine.optimizer.step_in_progress
    for use in (lambda: engine(*BATCHES[2]), lambda: engine.save_checkpoint(tmp_path / "ckpt")):
        with pytest.raises(zero.EngineStateError, match=r"optimizer step 2 failed \(.*Read-only file system.*"
                                                        r"partly updated.*Call engine.step\(\) again"):
            use()
    assert not (tmp_path / "ckpt").exists()

    engine.step()  # the disk works again: the step is finished
    assert not engine.optimizer.step_in_progress and engine.global_steps == 2
    losses += train_engine(engine, BATCHES[2:], 2)
    expected_losses, expected_weights = reference
    assert losses == expected_losses
    assert same_weights(weights(engine.module), expected_weights)
    engine.destroy()


@pytest.mark.parametrize("which", ["optimizer", "params"])
def test_failed_reads_leave_the_state_as_it_was(tmp_path, request, which):
    reference = request.getfixturevalue("bf16_reference" if which == "params" else "reference")
    engine = make_engine(tmp_path, lr=1e-2, precision=precision_for(which), overrides=STEP_AFTER_BACKWARD)
    losses = train_engine(engine, BATCHES[:1], 1)
    with faults.inject(fail_nth=1, fail_count=0, errno="EIO", path_contains=swap_dir(engine, which), op="read"):
        with pytest.raises(OSError) as info:
            train_engine(engine, BATCHES[1:2], 1)
    assert info.value.errno == errno.EIO and swap_dir(engine, which) in str(info.value)
    if engine.optimizer.step_in_progress:  # the step's first read failed: finish it
        engine.step()
        losses.append(reference[0][1])
    else:  # the forward failed: run the batch again
        losses += train_engine(engine, BATCHES[1:2], 1)
    losses += train_engine(engine, BATCHES[2:], 2)
    assert losses == reference[0]
    assert same_weights(weights(engine.module), reference[1])
    engine.destroy()


def test_after_a_failed_step_the_last_checkpoint_can_be_loaded(tmp_path, reference):
    engine = make_engine(tmp_path / "swap", lr=1e-2, overrides=STEP_AFTER_BACKWARD)
    train_engine(engine, BATCHES[:1], 1)
    engine.save_checkpoint(tmp_path / "ckpt")
    loss = engine(*BATCHES[1])
    engine.backward(loss)
    with faults.inject(fail_nth=1, fail_count=0, errno="ENOSPC", path_contains=swap_dir(engine, "optimizer"),
                       op="write"):
        with pytest.raises(OSError, match="No space left"):
            engine.step()
    engine.load_checkpoint(tmp_path / "ckpt")
    assert not engine.optimizer.step_in_progress and engine.global_steps == 1
    assert train_engine(engine, BATCHES[1:], 3) == reference[0][1:]
    assert same_weights(weights(engine.module), reference[1])
    engine.destroy()


# -- a backward that fails: its window's gradients are dropped, a reload resumes exactly -----------------
# Clipping keeps the step out of backward, and a hold budget of 0 sends every completed gradient
# to NVMe (zero/runtime/grad_stash.py), so that the faults below land on gradient writes.

def clipped_engine(nvme, accumulation):
    engine = make_engine(nvme, lr=1e-2, clip=0.5, accumulation=accumulation, micro=4 // accumulation,
                         stage3_max_reuse_distance=0)  # backward reads parameters
    engine.parts.reducer.stash.hold_budget = 0
    return engine


def micro_batches(accumulation):
    return [b for x, y in BATCHES for b in zip(x.chunk(accumulation), y.chunk(accumulation))]


@pytest.fixture(scope="module")
def clipped_reference(tmp_path_factory):
    runs = {}
    for accumulation in (1, 2):
        engine = clipped_engine(tmp_path_factory.mktemp(f"clipped{accumulation}"), accumulation)
        losses = train_engine(engine, micro_batches(accumulation), 4, accumulation)
        runs[accumulation] = (losses, weights(engine.module))
        engine.destroy()
    return runs


@pytest.mark.parametrize("accumulation, fault", [
    (1, "first gradient write"),  # surfaces half way through backward
    (1, "last gradient write"),  # surfaces at its end (writes are asynchronous), never in the step
    (2, "first gradient write"),  # the window's partial sums are on NVMe already
    (1, "parameter read"),
])
def test_a_backward_that_fails_drops_its_window_and_a_reload_matches(tmp_path, clipped_reference, accumulation,
                                                                      fault):
    engine = clipped_engine(tmp_path / "swap", accumulation)
    batches = micro_batches(accumulation)
    train_engine(engine, batches, 1, accumulation)
    engine.save_checkpoint(tmp_path / "ckpt")
    for batch in batches[accumulation:2 * accumulation - 1]:  # all but the window's last micro-batch
        engine.backward(engine(*batch))
        engine.step()
    loss = engine(*batches[2 * accumulation - 1])
    where = parameter_read_dir(engine) if fault == "parameter read" else swap_dir(engine, "optimizer")
    path = os.path.join(where, "subgroup0.") if fault == "last gradient write" else where  # written last
    with faults.inject(fail_nth=1, fail_count=0, errno="EIO", path_contains=path,
                       op="read" if fault == "parameter read" else "write") as fired:
        with pytest.raises(OSError) as info:
            engine.backward(loss)
        assert fired()["failed"] >= 1
    assert info.value.errno == errno.EIO and where in str(info.value)
    refused = r"backward failed \(.*Input/output error.*reload the last checkpoint with engine.load_checkpoint"
    for use in (lambda: engine(*batches[0]), lambda: engine.backward(loss), engine.step,
                lambda: engine.save_checkpoint(tmp_path / "ckpt2")):
        with pytest.raises(zero.EngineStateError, match=refused):
            use()
    assert not (tmp_path / "ckpt2").exists()

    engine.load_checkpoint(tmp_path / "ckpt")
    assert engine.global_steps == 1 and engine.micro_steps == accumulation
    losses = train_engine(engine, batches[accumulation:], 3, accumulation)
    expected_losses, expected_weights = clipped_reference[accumulation]
    assert losses == expected_losses[accumulation:]
    assert same_weights(weights(engine.module), expected_weights)
    engine.destroy()


# -- two ranks: a step that fails on one rank only ---------------------------------------------------------

def test_a_step_failing_on_one_of_two_ranks_is_finished_there_and_both_match(tmp_path):
    cases = {"reference": {}, "optimizer-write-rank1": dict(fail_rank=1),
             "reference-bf16": dict(precision="bf16"),
             "params-write-rank0": dict(fail_rank=0, which="params", precision="bf16"),
             "optimizer-read-rank1": dict(fail_rank=1, op="read")}
    ranks = run_ranks(2, [(name, scenario_step_fails_on_one_rank, kwargs) for name, kwargs in cases.items()],
                      tmp_path)
    for rank, results in enumerate(ranks):
        for name, got in results.items():
            assert "error" not in got, got["error"]
            expected = ranks[rank]["reference-bf16" if cases[name].get("precision") else "reference"]
            assert got["losses"] == expected["losses"] and got["weights"] == expected["weights"], (name, rank)
            if rank == cases[name].get("fail_rank"):
                assert got["refused"].startswith(f"{errno.EIO}: ") and "Input/output error" in got["refused"]
                assert re.search(r"optimizer step 2 failed .*partly updated.*Call engine.step\(\) again",
                                 got["refused"].splitlines()[-1]), got["refused"]
            else:
                assert got["refused"] == ""
    assert ranks[0]["reference"]["weights"] == ranks[1]["reference"]["weights"]  # gathered: the whole model


def test_io_failing_on_one_of_two_ranks_in_forward_or_backward_fails_on_both_and_they_recover_exactly(tmp_path):
    """The failing rank keeps its error and goes on with the collectives (zeros for a parameter it
    could not read), so the other rank is never left waiting; both raise at the end of forward or
    backward; both run the batch again (forward) or reload (backward) and end bit-identical."""
    cases = {"reference": {}, "reference-unclipped": dict(clip=0.0),
             "gradient-write-rank1": dict(fail_rank=1),
             "step-in-backward-write-rank0": dict(fail_rank=0, clip=0.0),
             "parameter-read-in-backward-rank1": dict(fail_rank=1, fault="parameter read"),
             "parameter-read-in-forward-rank0": dict(fail_rank=0, fault="parameter read", phase="forward")}
    ranks = run_ranks(2, [(n, scenario_io_fails_on_one_rank, kw) for n, kw in cases.items()], tmp_path)
    for rank, results in enumerate(ranks):
        for name, got in results.items():
            assert "Traceback" not in got["error"], got["error"]
            case = cases[name]
            if "fail_rank" not in case:
                assert got["error"] == ""
                continue
            phase, op = case.get("phase", "backward"), case.get("fault", "optimizer write").split()[-1]
            lines = got["error"].split("\n")
            if rank == case["fail_rank"]:
                assert lines[0].startswith(f"AioError: [Errno 5] {op} failed: Input/output error"), lines[0]
            else:
                assert lines[0].startswith(f"EngineStateError: {phase} failed on another rank"), lines[0]
            if phase == "backward":
                assert re.match(r"backward failed .*reload the last checkpoint with engine.load_checkpoint", lines[1])
            reference = results["reference" if case.get("clip", 0.5) else "reference-unclipped"]
            assert got["losses"] == reference["losses"] and got["weights"] == reference["weights"], (name, rank)



@pytest.mark.parametrize("which,nth", [("optimizer", 1), ("optimizer", 4), ("params", 2)])
def test_a_write_failing_while_backward_steps_refuses_use_until_a_checkpoint_is_loaded(tmp_path, request,
                                                                                      which, nth):
    reference = request.getfixturevalue("bf16_reference" if which == "params" else "reference")
    engine = make_engine(tmp_path / "swap", lr=1e-2, precision=precision_for(which), overrides=STEP_IN_BACKWARD)
    train_engine(engine, BATCHES[:1], 1)
    engine.save_checkpoint(tmp_path / "ckpt")
    loss = engine(*BATCHES[1])
    with faults.inject(fail_nth=nth, fail_count=0, errno="EIO", path_contains=swap_dir(engine, which),
                       op="write") as fired:
        with pytest.raises(OSError) as info:
            engine.backward(loss)
    assert fired()["failed"] >= 1 and info.value.errno == errno.EIO and swap_dir(engine, which) in str(info.value)
    message = (r"backward failed .*it had stepped \d+ of \d+ optimizer sub-groups, so the model and optimizer "
               r"are partly updated; reload the last checkpoint")
    for use in (lambda: engine(*BATCHES[1]), engine.step, lambda: engine.save_checkpoint(tmp_path / "bad")):
        with pytest.raises(zero.EngineStateError, match=message):
            use()
    assert not (tmp_path / "bad").exists()
    engine.load_checkpoint(tmp_path / "ckpt")
    assert train_engine(engine, BATCHES[1:], 3) == reference[0][1:]
    assert same_weights(weights(engine.module), reference[1])
    engine.destroy()


def test_a_read_failing_before_backward_stepped_anything_says_the_state_is_untouched(tmp_path, reference):
    engine = make_engine(tmp_path / "swap", lr=1e-2, overrides=STEP_IN_BACKWARD)
    train_engine(engine, BATCHES[:1], 1)
    engine.save_checkpoint(tmp_path / "ckpt")
    loss = engine(*BATCHES[1])
    with faults.inject(fail_nth=1, fail_count=0, errno="EIO", path_contains=swap_dir(engine, "optimizer"),
                       op="read"):
        with pytest.raises(OSError):
            engine.backward(loss)
    assert engine.optimizer.adam_step == 1 and not engine.optimizer.step_in_progress
    with pytest.raises(zero.EngineStateError, match="weights and optimizer states are untouched"):
        engine.step()
    engine.load_checkpoint(tmp_path / "ckpt")
    assert train_engine(engine, BATCHES[1:], 3) == reference[0][1:]
    engine.destroy()
