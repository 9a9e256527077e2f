"""Hostile checkpoints: pickles that would run code, tags and ``latest`` contents that leave the
directory, symlinks planted where a save writes, modes, saves cut at their worst moment, loads of
incomplete checkpoints. A case passes when nothing runs, nothing outside the directory is read or
written, and the engine's state is the one expected."""
from __future__ import annotations

import contextlib
import os
import stat

import torch

from nvmeio import resources

from .cases import Expectation, Row, Section, expect, run_guarded, settled_snapshot
from .engine import nvme_engine, train_batches, weights_of


# -- checkpoint cases: (d) -> None ------------------------------------------------------------------

class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _saved(d):
    from tests.helpers import train_engine

    engine = nvme_engine(os.path.join(d, "swap"))
    train_engine(engine, train_batches()[:1], 1)
    engine.save_checkpoint(os.path.join(d, "ckpt"), tag="good")
    return engine, os.path.join(d, "ckpt")


@contextlib.contextmanager
def _engine_saved(d):
    engine, ckpt = _saved(d)
    try:
        yield engine, ckpt
    finally:
        engine.destroy()


def ck_malicious_pickle(d):
    import zero

    with _engine_saved(d) as (engine, ckpt):
        path = os.path.join(ckpt, "good", "rank00000", "engine.pt")
        state = torch.load(path, weights_only=True)
        state["client_state"] = {"x": _RunsCode(os.path.join(d, "pwned"))}
        os.unlink(path)
        torch.save(state, path)
        steps = engine.global_steps
        try:
            engine.load_checkpoint(ckpt)
            raise Expectation("loaded")
        except zero.UnsafeCheckpointError as e:
            expect(path in str(e), f"unclear: {e}")
        expect(not os.path.exists(os.path.join(d, "pwned")), "the pickle ran code")
        expect(engine.global_steps == steps, "counters changed")


def ck_tag_escapes(d):
    import zero

    with _engine_saved(d) as (engine, ckpt):
        engine.save_checkpoint(d, tag="outside")
        n = 0
        for tag in ("../outside", os.path.join(d, "outside"), "a/b", "..", ".hidden", "latest"):
            for fn in (lambda: engine.load_checkpoint(ckpt, tag=tag), lambda: engine.save_checkpoint(ckpt, tag=tag)):
                n += 1
                try:
                    fn()
                    raise Expectation(f"tag {tag!r} accepted")
                except zero.CheckpointTagError as e:
                    expect(repr(tag) in str(e), f"the error does not name {tag!r}: {e}")
        for text in ("../outside", os.path.join(d, "outside")):
            n += 1
            with open(os.path.join(ckpt, "latest"), "w") as f:
                f.write(text)
            try:
                engine.load_checkpoint(ckpt)
                raise Expectation(f"latest {text!r} followed")
            except zero.CheckpointTagError:
                pass
        for tag in (" t", "t\n", "t "):
            n += 1
            try:
                engine.save_checkpoint(ckpt, tag=tag)
                raise Expectation(f"tag {tag!r} saved")
            except zero.CheckpointTagError:
                pass
    return n


def ck_planted_symlinks(d):
    with _engine_saved(d) as (engine, ckpt):
        victim = os.path.join(d, "victim")
        with open(victim, "w") as f:
            f.write("precious")
        for name in (f"latest.tmp-{os.getpid()}", ".next.partial", "latest.tmp"):
            os.symlink(victim, os.path.join(ckpt, name))
        engine.save_checkpoint(ckpt, tag="next")
        with open(victim) as f:
            expect(f.read() == "precious", "a planted symlink was written through")


def ck_modes(d):
    old = os.umask(0o022)
    try:
        with _engine_saved(d) as (_, ckpt):
            for root, dirs, files in os.walk(ckpt):
                for n in dirs:
                    mode = stat.S_IMODE(os.lstat(os.path.join(root, n)).st_mode)
                    expect(mode == 0o700, f"directory {n} is {mode:o}")
                for n in files:
                    mode = stat.S_IMODE(os.lstat(os.path.join(root, n)).st_mode)
                    expect(mode == 0o600, f"file {n} is {mode:o}")
    finally:
        os.umask(old)


def ck_resave_cut(d):
    import zero.checkpoint.publish as checkpoint_module

    with _engine_saved(d) as (engine, ckpt):
        before = weights_of(engine)
        real = os.rename
        calls = []

        def dying(src, dst, *a, **kw):
            calls.append(src)
            if len(calls) == 2:
                raise KeyboardInterrupt("cut between the renames")
            return real(src, dst, *a, **kw)

        checkpoint_module.exchange, saved_exchange = (lambda a, b: False), checkpoint_module.exchange
        checkpoint_module.os.rename = dying
        try:
            engine.save_checkpoint(ckpt, tag="good")
        except KeyboardInterrupt:
            pass
        finally:
            checkpoint_module.os.rename = real
            checkpoint_module.exchange = saved_exchange
        engine.load_checkpoint(ckpt)  # latest still leads to a complete copy
        engine.save_checkpoint(ckpt, tag="other")
        expect(os.path.isdir(os.path.join(ckpt, "good")), "the only complete copy was deleted")
        mine = weights_of(engine)
        expect(all(torch.equal(mine[n], v) for n, v in before.items()), "wrong weights loaded")


def ck_incomplete_load(d):
    with _engine_saved(d) as (engine, ckpt):
        from tests.helpers import train_engine

        train_engine(engine, train_batches()[1:2], 1)
        before, steps = weights_of(engine), engine.global_steps
        os.unlink(os.path.join(ckpt, "good", "rank00000", "engine.pt"))
        try:
            engine.load_checkpoint(ckpt)
            raise Expectation("an incomplete checkpoint loaded")
        except FileNotFoundError:
            pass
        mine = weights_of(engine)
        expect(engine.global_steps == steps and all(torch.equal(mine[n], v) for n, v in before.items()),
                 "a failed load changed the engine")


CHECKPOINT_CASES = {
    "engine.pt holding a pickle that runs a command": ck_malicious_pickle,
    "tags and latest leaving the directory, whitespace tags": ck_tag_escapes,
    "symlinks planted at temporary names": ck_planted_symlinks,
    "files 0600, directories 0700 under umask 022": ck_modes,
    "re-save cut between its renames (no exchange)": ck_resave_cut,
    "load of a checkpoint missing a file": ck_incomplete_load,
}


def section_checkpoints(ctx):
    s = Section("checkpoints", "Security cases (engine checkpoints)",
                  "Hostile checkpoints and saves cut at their worst moment. A case fails if code runs, "
                  "anything outside the checkpoint directory is read or written, a refusal does not name "
                  "what it refuses, or the engine's state is not the expected one.")
    for name, fn in CHECKPOINT_CASES.items():
        d = ctx.fresh_dir("checkpoints")
        box = {}
        before = settled_snapshot()
        error = run_guarded(lambda: box.setdefault("n", fn(d)))
        s.rows.append(Row(name, cases=box.get("n") or 1, failed=1 if error else 0,
                            leaks=resources.grown_since(before),
                            detail=error or "refused or recovered, as expected"))
    return s
