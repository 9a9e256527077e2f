"""BackwardPass: the one owner of the backward protocol.

A backward is more than ``loss.backward()``: the loss is scaled for accumulation
and fp16; the backward that ends an accumulation window may step optimizer
sub-groups as their gradients complete (engine/optimizer.py, [Note: sub-groups
stepped during backward]) or read the first sub-group ahead of the step; with
several ranks an I/O error is kept until every rank has finished its collectives
and then raised on all of them; a backward that fails half way drops the
window's gradients and leaves the engine refusing use until a checkpoint is
loaded. Which micro-batch ends a window is counted here too (``micro_steps``).

``ZeroEngine.forward`` / ``backward`` / ``step`` and ``train_batch`` are its
clients: they call these methods and never change its state themselves, as
FSDP2's parameter groups change their state only inside their own methods.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch

from ..runtime.comm import Comm
from ..runtime.timers import Timers


class EngineStateError(RuntimeError):
    """The engine's state is not usable: a step or a load failed half way (the message says what to do)."""


class BackwardPass:
    """Forward's deferred errors, backward's set-up and wrap-up, and the accumulation count of
    one engine. ``parts``: the engine's parts (build.py); ``mark_unusable(why)``: the engine
    refuses use until a checkpoint is loaded."""

    def __init__(self, parts, optimizer, comm: Comm, timers: Timers,
                 gradient_accumulation_steps: int, step_in_backward: bool, mark_unusable: Callable[[str], None]):
        self._parts = parts
        self._optimizer = optimizer
        self._comm = comm
        self._timers = timers
        self._gas = gradient_accumulation_steps
        self._step_in_backward = step_in_backward
        self._mark_unusable = mark_unusable
        self.micro_steps = 0  # forward/backward/step rounds since the start (checkpointed)
        self._window_ends = False  # set_boundary(True): a window cut short
        # Several ranks reading parameters from NVMe: a failed read is kept (the unit gathers
        # zeros) so the collectives still complete; raised on every rank at the end.
        self.defer_reads = comm.world_size > 1 and not parts.param_store.resident

    # -- the accumulation window --------------------------------------------------------------
    def is_boundary(self) -> bool:
        """The next backward and step end an accumulation window."""
        return self._window_ends or (self.micro_steps + 1) % self._gas == 0

    def set_boundary(self, is_boundary: bool) -> None:
        """True: the next backward and step end this window however few micro-batches it had."""
        self._window_ends = bool(is_boundary)

    def stepped(self) -> None:
        """``engine.step()`` ran (a step, or a micro-batch within the window)."""
        self.micro_steps += 1
        if self._window_ends:  # a window cut short: the next one starts on a whole window's count
            self.micro_steps = -(-self.micro_steps // self._gas) * self._gas
            self._window_ends = False

    def check_window_start(self) -> None:
        """train_batch runs whole windows: refuse one that would start inside a window."""
        into = self.micro_steps % self._gas
        if into:
            raise ValueError(f"train_batch runs a whole accumulation window, but this one is {into} "
                             f"micro-batch(es) in (forward/backward/step calls since the last step); "
                             f"finish it with step() first")

    # -- forward ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """A forward (or a window's forwards): with ``defer_reads``, a failed parameter read on any
        rank is raised on every rank at its end. The caller cleans up after an error."""
        self._comm.deferring = self.defer_reads
        try:
            with self._timers.phase("forward"):
                yield
            if self.defer_reads:
                self.raise_if_failed_anywhere("forward", self._comm.take_deferred())
        finally:
            self._comm.deferring = False

    # -- backward ---------------------------------------------------------------------------------
    def check_can_train(self) -> None:
        if self._optimizer is None:
            raise RuntimeError("this engine has no optimizer: pass one to zero.initialize or add an "
                               "optimizer section to the config")

    def scaled(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> torch.Tensor:
        """``loss`` divided by the accumulation steps (unless the caller did) and times the loss scale."""
        if self._gas > 1 and scale_wrt_gas:
            loss = loss / self._gas
        if self._optimizer.loss_scale != 1.0:
            loss = loss * self._optimizer.loss_scale
        return loss

    def run(self, run_autograd: Callable[[], None], boundary: bool) -> None:
        """``run_autograd()`` between the step-in-backward / gradient-stash set-up and wrap-up;
        ``boundary``: this backward ends the accumulation window."""
        store = self._parts.optimizer_store
        optimizer = self._optimizer
        stash = self._parts.reducer.stash
        stash.begin(boundary)
        in_backward = boundary and self._step_in_backward and optimizer.can_step_in_backward()
        if in_backward:
            optimizer.begin_step_in_backward()  # see [Note: sub-groups stepped during backward]
        elif boundary and not store.stash_gradients:
            store.prefetch()
        self._comm.deferring = self.defer_reads
        try:
            with self._timers.phase("backward"):
                run_autograd()
                self._parts.reducer.flush()  # reductions still in flight land (overlap_comm)
                if boundary and store.stash_gradients and not in_backward:
                    stash.run(store.wait_gradients)  # a failed gradient write surfaces here, not in the step
                if self._comm.distributed and (self.defer_reads or stash.on_nvme):
                    self.raise_if_failed_anywhere("backward", stash.take_error() or self._comm.take_deferred())
        except BaseException as error:
            stepped = optimizer.abandon_backward_step() if in_backward else 0
            self._abandon(error, stepped)
            raise
        finally:
            self._comm.deferring = False
        if in_backward:
            optimizer.end_backward()
        elif boundary and store.stash_gradients:
            store.prefetch()  # the gradients are on NVMe now: read the first sub-group with its state

    def run_window(self, micro_batches: int, run_autograd: Callable[[], None]) -> None:
        """A window's backwards in one call: counted as its micro-batches, the last ending it."""
        self.micro_steps += micro_batches - 1
        try:
            self.run(run_autograd, boundary=True)
        except BaseException:
            self.micro_steps -= micro_batches - 1
            raise

    def raise_if_failed_anywhere(self, what: str, error: Optional[BaseException]) -> None:
        """Several ranks: a rank whose I/O failed in forward or backward kept the error and went
        on with the collectives (GradStash.run, Comm.deferring); every rank learns of it here and
        raises, so that all of them handle it alike and none is left waiting in a collective."""
        self._comm.take_deferred()
        if self._comm.any(error is not None):
            raise error if error is not None else EngineStateError(
                f"{what} failed on another rank (reading parameters, writing gradients to NVMe or stepping the "
                f"optimizer there); see that rank's error")

    def _abandon(self, error: BaseException, stepped: int) -> None:
        """Backward raised half way (writing a gradient to NVMe, stepping a sub-group, reading a
        parameter, a hook): the accumulation window's gradients are partly summed, so they are
        dropped with the hooks' bookkeeping (autograd never runs the end-of-backward callback
        after an error). The master weights and optimizer states are untouched, unless
        ``stepped`` sub-groups were updated during this backward (then the state is partly
        updated). Either way the engine refuses all use until a checkpoint is loaded, and from
        there trains as a run that never failed."""
        parts = self._parts
        parts.coordinator.abandon_backward()
        parts.reducer.abandon()
        if stepped:
            self._optimizer.abandon_step()
            parts.param_store.discard_unsaved()  # new values a failed write kept: a load replaces all
            total = len(parts.rank_layout.trainable_sub_groups)
            state = (f"it had stepped {stepped} of {total} optimizer sub-groups, so the model and optimizer "
                     f"are partly updated")
        else:
            state = "the gradients of this accumulation window are lost (the weights and optimizer states are untouched)"
        why = (f"backward failed ({type(error).__name__}: {error}); {state}; reload the last checkpoint with "
               f"engine.load_checkpoint(...) before going on")
        self._mark_unusable(why)
        error.add_note(why)
