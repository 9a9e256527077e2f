"""The ZeRO-3 engine under injected faults: faults of nvmeio.faults in the swap-ins and swap-outs
of parameters and optimizer states during training (in the step, in backward, on one of two
ranks), and swap files damaged between steps. A case passes when the error is clear (an OSError
naming the swap file, or a SwapCorruptionError naming file and unit), nothing partly updated is
trained on or saved, and the run then reaches exactly the losses and weights of a run without
faults (finishing the step, running the batch again, or loading the last checkpoint).

The engine, batches and weights of these cases serve checkpoints.py's too.
"""
from __future__ import annotations

import errno
import os

import torch

from nvmeio import resources

from .cases import Expectation, Row, Section, expect, run_guarded, settled_snapshot

BATCHES_N = 4


def nvme_engine(nvme: str, step_in_backward: bool = False, precision: str = "fp32", **zero_extra):
    """Without ``step_in_backward`` the optimizer's I/O happens in step() (what the step cases
    fail); with it, sub-groups are stepped during backward (what the in-backward cases fail).
    Parameters have swap files of their own in bf16 only (fp32 shards are read from the
    optimizer's master, zero/stores/param_store.py): the cases aimed at parameter files use bf16."""
    import zero
    from tests.helpers import base_config
    from zero.examples import GPT, GPTConfig

    os.makedirs(nvme, exist_ok=True)
    torch.manual_seed(0)
    config = base_config("nvme", "nvme", nvme, lr=1e-2, precision=precision, **zero_extra)
    config["zero_optimization"]["offload_optimizer"]["step_in_backward"] = step_in_backward
    engine, _, _, _ = zero.initialize(model=GPT(GPTConfig()), config=config)
    return engine


def train_batches():
    from zero.examples import GPTConfig, make_batches

    return make_batches(GPTConfig(), BATCHES_N, 4)


def weights_of(engine):
    import zero

    with zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _precision(which: str) -> str:
    return "bf16" if which == "params" else "fp32"


def _reference(d: str, precision: str = "fp32"):
    from tests.helpers import train_engine

    engine = nvme_engine(os.path.join(d, "ref"), precision=precision)
    try:
        return train_engine(engine, train_batches(), BATCHES_N), weights_of(engine)
    finally:
        engine.destroy()


def _lost_elements(engine, reference) -> int:
    """Parameter elements that differ from the fault-free run (the report's 'bytes lost', x4)."""
    mine = weights_of(engine)
    return sum(int((mine[k] != v).sum()) * v.element_size() for k, v in reference[1].items())


def _swap_dir(engine, which: str) -> str:
    return (engine.parts.optimizer_store if which == "optimizer" else engine.parts.param_store).swap_dir


# -- engine cases: (d, row, reference) -> None; raise to fail ------------------------------------

def _failed_write_step(which: str, error: str):
    def case(d, row, reference):
        import zero
        from tests.helpers import train_engine
        from nvmeio import faults

        if which == "params":
            reference = _reference(d, "bf16")
        engine = nvme_engine(os.path.join(d, "swap"), precision=_precision(which))
        batches = train_batches()
        losses = train_engine(engine, batches[:1], 1)
        loss = engine(*batches[1])
        losses.append(loss.item())
        engine.backward(loss)
        with faults.inject(fail_nth=1, fail_count=0, errno=error, path_contains=_swap_dir(engine, which),
                           op="write"):
            try:
                engine.step()
                raise Expectation("the step did not raise")
            except OSError as e:
                expect(e.errno == getattr(errno, error) and _swap_dir(engine, which) in str(e),
                         f"unclear error: {e}")
        try:
            engine(*batches[2])
            raise Expectation("a forward ran on a partly updated model")
        except zero.EngineStateError:
            pass
        engine.step()
        losses += train_engine(engine, batches[2:], 2)
        expect(losses == reference[0], "losses differ from the run without faults")
        row.bytes_lost += _lost_elements(engine, reference)
        engine.destroy()
    return case


def _failed_read(which: str):
    """``params`` (bf16: parameter files) and ``master`` (fp32: parameters read from the
    optimizer's master): a forward read fails, the batch is run again. ``optimizer``: a read of
    the step fails, the step is finished."""
    def case(d, row, reference):
        from tests.helpers import parameter_read_dir, train_engine
        from nvmeio import faults

        if which == "params":
            reference = _reference(d, "bf16")
        engine = nvme_engine(os.path.join(d, "swap"), precision=_precision(which))
        batches = train_batches()
        losses = train_engine(engine, batches[:1], 1)
        where = parameter_read_dir(engine) if which != "optimizer" else _swap_dir(engine, which)
        if which == "optimizer":  # forward and backward first: the fault hits the step's reads
            loss = engine(*batches[1])
            losses.append(loss.item())
            engine.backward(loss)
        with faults.inject(fail_nth=1, fail_count=0, errno="EIO", path_contains=where, op="read"):
            try:
                engine.step() if which == "optimizer" else train_engine(engine, batches[1:2], 1)
                raise Expectation("no error raised")
            except OSError as e:
                expect(e.errno == errno.EIO and where in str(e), f"unclear error: {e}")
        if which == "optimizer":
            expect(engine.optimizer.step_in_progress, "the failed step is not marked in progress")
            engine.step()
        else:
            expect(not engine.optimizer.step_in_progress, "a forward read failure touched the step")
            losses += train_engine(engine, batches[1:2], 1)
        losses += train_engine(engine, batches[2:], 2)
        expect(losses == reference[0], "losses differ from the run without faults")
        row.bytes_lost += _lost_elements(engine, reference)
        engine.destroy()
    return case


def _damaged_swap_file(which: str, how: str, linked: bool = False):
    """Damaged after a step (the checkpoint is then a separate file), or, ``linked``, right after
    a save whose shard is the swap file itself (a hard link; README: until the next step the two
    are one file, so that checkpoint is damaged too and its load must refuse it, naming the file;
    the checkpoint before it is separate and resumes exactly)."""
    def case(d, row, reference):
        import numpy as np

        from tests.helpers import train_engine
        from swapper import SwapCorruptionError

        if which == "params":
            reference = _reference(d, "bf16")
        engine = nvme_engine(os.path.join(d, "swap"), precision=_precision(which))
        batches = train_batches()
        ckpt = os.path.join(d, "ckpt")
        losses = train_engine(engine, batches[:1], 1)
        engine.save_checkpoint(ckpt)
        losses += train_engine(engine, batches[1:2], 1)
        if linked:
            engine.save_checkpoint(ckpt)
        directory = _swap_dir(engine, which)
        state_files = sorted(f for f in os.listdir(directory) if not f.endswith(".grad"))  # gradients: consumed
        path = os.path.join(directory, state_files[0])
        n = min(os.path.getsize(path), 1 << 16)
        data = {"zeros": bytes(n), "random": np.random.default_rng(1).integers(0, 256, n, np.uint8).tobytes(),
                "nans": np.full(n // 4, np.nan, np.float32).tobytes()}[how]
        with open(path, "r+b") as f:
            f.write(data)
        try:
            train_engine(engine, batches[2:3], 1)
            raise Expectation("the damage went unnoticed")
        except SwapCorruptionError as e:
            expect(path in str(e) and ("partition" in str(e) or "sub-group" in str(e)),
                     f"the error does not name the file and unit: {e}")
        if linked:
            shard = os.path.join(ckpt, "global_step2")
            expect(os.path.samefile(path, os.path.join(shard, "rank00000", "subgroup00000.safetensors")),
                     "the latest checkpoint's shard is not the swap file (no hard link): case needs updating")
            try:
                engine.load_checkpoint(ckpt)
                raise Expectation("the checkpoint sharing the damaged swap file loaded")
            except Exception as e:  # noqa: BLE001 - any clear refusal naming the shard
                expect(shard in str(e), f"the refusal does not name the damaged shard: {e}")
        engine.load_checkpoint(ckpt, tag="global_step1")
        losses = losses[:1] + train_engine(engine, batches[1:], 3)
        expect(losses == reference[0], "losses differ from the run without faults after resuming")
        row.bytes_lost += _lost_elements(engine, reference)
        engine.destroy()
    return case


def _failed_backward(fault: str, accumulation: int = 1):
    """Backward fails (a gradient write to NVMe, or a parameter read): the window is dropped, the
    engine refuses all use until a checkpoint is loaded, then matches a run without the fault.
    Clipping keeps the gradients going to NVMe during backward (zero/runtime/grad_stash.py)."""
    def case(d, row, _reference):
        from tests.helpers import parameter_read_dir, train_engine
        from nvmeio import faults

        extra = dict(clip=0.5, accumulation=accumulation, micro=4 // accumulation, stage3_max_reuse_distance=0)
        batches = [b for x, y in train_batches() for b in zip(x.chunk(accumulation), y.chunk(accumulation))]
        ref = nvme_engine(os.path.join(d, "ref"), **extra)
        reference = train_engine(ref, batches, BATCHES_N, accumulation), weights_of(ref)
        ref.destroy()
        engine = nvme_engine(os.path.join(d, "swap"), **extra)
        train_engine(engine, batches, 1, accumulation)
        engine.save_checkpoint(os.path.join(d, "ckpt"))
        for batch in batches[accumulation:2 * accumulation - 1]:
            engine.backward(engine(*batch))
            engine.step()
        loss = engine(*batches[2 * accumulation - 1])
        where = parameter_read_dir(engine) if fault == "parameter read" else _swap_dir(engine, "optimizer")
        path = os.path.join(where, "subgroup0.") if fault == "last gradient write" else where
        with faults.inject(fail_nth=1, fail_count=0, errno="EIO", path_contains=path,
                           op="read" if fault == "parameter read" else "write"):
            try:
                engine.backward(loss)
                raise Expectation("backward did not raise")
            except OSError as e:
                expect(e.errno == errno.EIO and where in str(e), f"unclear error: {e}")
        _refused_until_reloaded(engine, batches, d, row, reference, accumulation)
    return case



def _refused_until_reloaded(engine, batches, d, row, reference, accumulation: int) -> None:
    """After a failed backward: forward, step and saves are refused until the checkpoint in
    ``d``/ckpt is loaded; from there training matches ``reference`` (losses, weights)."""
    import zero
    from tests.helpers import train_engine

    for use in (lambda: engine(*batches[0]), engine.step, lambda: engine.save_checkpoint(os.path.join(d, "c2"))):
        try:
            use()
            raise Expectation("the engine went on after a failed backward")
        except zero.EngineStateError as e:
            expect("reload the last checkpoint" in str(e), f"unclear refusal: {e}")
    engine.load_checkpoint(os.path.join(d, "ckpt"))
    losses = train_engine(engine, batches[accumulation:], BATCHES_N - 1, accumulation)
    expect(losses == reference[0][accumulation:], "losses differ from the run without faults after the reload")
    row.bytes_lost += _lost_elements(engine, reference)
    engine.destroy()

def _failed_in_backward_step(which: str, op: str):
    """Sub-groups stepped during backward: a write (or the first read) fails; backward raises,
    the engine refuses all use until a checkpoint is loaded, then matches a run without faults."""
    def case(d, row, _reference):
        from tests.helpers import train_engine
        from nvmeio import faults

        batches = train_batches()
        ref = nvme_engine(os.path.join(d, "ref"), step_in_backward=True, precision=_precision(which))
        reference = train_engine(ref, batches, BATCHES_N), weights_of(ref)
        ref.destroy()
        engine = nvme_engine(os.path.join(d, "swap"), step_in_backward=True, precision=_precision(which))
        train_engine(engine, batches[:1], 1)
        engine.save_checkpoint(os.path.join(d, "ckpt"))
        loss = engine(*batches[1])
        with faults.inject(fail_nth=1, fail_count=0, errno="EIO", path_contains=_swap_dir(engine, which), op=op):
            try:
                engine.backward(loss)
                raise Expectation("backward did not raise")
            except OSError as e:
                expect(e.errno == errno.EIO and _swap_dir(engine, which) in str(e), f"unclear error: {e}")
        _refused_until_reloaded(engine, batches, d, row, reference, 1)
    return case


def _two_ranks_step(d, row, _reference):
    """A step fails on one of two gloo ranks (optimizer write, parameter write, optimizer read);
    that rank finishes it; both ranks end bit-identical to a two-rank run without faults."""
    from tests.helpers import run_ranks, scenario_step_fails_on_one_rank

    cases = {"reference": {}, "optimizer-write-rank1": dict(fail_rank=1),
             "reference-bf16": dict(precision="bf16"),
             "params-write-rank0": dict(fail_rank=0, which="params", precision="bf16"),
             "optimizer-read-rank1": dict(fail_rank=1, op="read")}
    ranks = run_ranks(2, [(n, scenario_step_fails_on_one_rank, kw) for n, kw in cases.items()], d)
    row.cases = len(cases) - 2
    for rank, results in enumerate(ranks):
        for name, got in results.items():
            expect("error" not in got, f"{name} rank {rank}: {got.get('error')}")
            if rank == cases[name].get("fail_rank"):
                expect("Input/output error" in got["refused"] and "engine.step() again" in got["refused"],
                         f"{name}: unclear error or refusal: {got['refused']!r}")
            expected = results["reference-bf16" if cases[name].get("precision") else "reference"]
            same = got["losses"] == expected["losses"] and got["weights"] == expected["weights"]
            expect(same, f"{name} rank {rank}: losses or weights differ from the run without faults")


def _two_ranks_io(d, row, _reference):
    """I/O fails on one of two gloo ranks in forward or backward (a gradient write with clipping,
    an in-backward step's write without, a parameter read in backward, one in forward): every
    rank raises, none hangs; they run the batch again (forward) or reload (backward) and end
    bit-identical to a two-rank run without faults."""
    from tests.helpers import run_ranks, scenario_io_fails_on_one_rank

    cases = {"reference": {}, "reference-unclipped": dict(clip=0.0),
             "gradient-write-rank1": dict(fail_rank=1),
             "step-in-backward-write-rank0": dict(fail_rank=0, clip=0.0),
             "parameter-read-in-backward-rank1": dict(fail_rank=1, fault="parameter read"),
             "parameter-read-in-forward-rank0": dict(fail_rank=0, fault="parameter read", phase="forward")}
    ranks = run_ranks(2, [(n, scenario_io_fails_on_one_rank, kw) for n, kw in cases.items()], d)
    row.cases = 4
    for rank, results in enumerate(ranks):
        for name, got in results.items():
            expect("Traceback" not in got["error"], f"{name} rank {rank}: {got['error']}")
            case = cases[name]
            if "fail_rank" not in case:
                continue
            phase = case.get("phase", "backward")
            said = "reload the last checkpoint" if phase == "backward" else "Input/output error"
            expect(said in got["error"] or "failed on another rank" in got["error"],
                     f"{name} rank {rank}: unclear: {got['error']!r}")
            reference = results["reference" if case.get("clip", 0.5) else "reference-unclipped"]
            expect(got["losses"] == reference["losses"] and got["weights"] == reference["weights"],
                     f"{name} rank {rank}: losses or weights differ from the run without faults")


ENGINE_CASES = {
    "optimizer swap-out fails (EROFS) for one step; step finished": _failed_write_step("optimizer", "EROFS"),
    "optimizer swap-out fails (ENOSPC) for one step; step finished": _failed_write_step("optimizer", "ENOSPC"),
    "parameter swap-out fails (EACCES) for one step (bf16); step finished": _failed_write_step("params", "EACCES"),
    "parameter swap-in fails (EIO, bf16); batch run again": _failed_read("params"),
    "parameter read from the fp32 master fails (EIO); batch run again": _failed_read("master"),
    "optimizer swap-in fails (EIO); step finished": _failed_read("optimizer"),
    **{f"{which} swap file {how} between steps; checkpoint loaded": _damaged_swap_file(which, how)
       for which in ("params", "optimizer") for how in ("zeros", "random", "nans")},
    "optimizer swap file zeros right after a save linked it: that checkpoint refused, the one before loaded":
        _damaged_swap_file("optimizer", "zeros", linked=True),
    "gradient write fails half way through backward (EIO); checkpoint reloaded": _failed_backward(
        "first gradient write"),
    "last gradient write of backward fails (EIO, asynchronous); checkpoint reloaded": _failed_backward(
        "last gradient write"),
    "gradient write fails in a window's 2nd micro-batch (EIO); checkpoint reloaded": _failed_backward(
        "first gradient write", accumulation=2),
    "parameter swap-in fails in backward (EIO); checkpoint reloaded": _failed_backward("parameter read"),
    "optimizer write fails while backward steps sub-groups (EIO); checkpoint reloaded": _failed_in_backward_step(
        "optimizer", "write"),
    "parameter write fails while backward steps sub-groups (EIO, bf16); checkpoint reloaded": _failed_in_backward_step(
        "params", "write"),
    "optimizer read fails while backward steps sub-groups (EIO); checkpoint reloaded": _failed_in_backward_step(
        "optimizer", "read"),
    "step fails on one of two ranks (3 ways); finished there, both ranks match": _two_ranks_step,
    "I/O fails on one of two ranks in forward or backward (4 ways); both raise, none hangs, both match":
        _two_ranks_io,
}


def section_engine(ctx):
    s = Section("engine", "The ZeRO-3 engine under injected faults (zero)",
                  "Faults injected (nvmeio.faults) into the swap-ins and swap-outs of a GPT trained with "
                  "parameters and optimizer states on NVMe: in the step, in backward (gradients written to "
                  "NVMe with clipping; sub-groups stepped during backward without), on one of two gloo "
                  "ranks; and swap files damaged between steps. A case "
                  "fails if the error does not name the file (and unit), a partly updated state is "
                  "trained on, or the run does not then reach exactly the losses and weights of a run "
                  "without faults ('bytes lost': parameter bytes that differ).")
    reference = _reference(ctx.fresh_dir("engine-ref"))
    for name, case in ENGINE_CASES.items():
        d = ctx.fresh_dir("engine")
        row = Row(name, cases=1)
        before = settled_snapshot()
        error = run_guarded(lambda: case(d, row, reference))
        row.leaks = resources.grown_since(before)
        row.failed = 1 if error else 0
        row.detail = error or "clear error; no partly updated state used; same losses and weights"
        s.rows.append(row)
    return s
