"""``engine.train_batch(micro_batches)``: one accumulation window, run unit-major.

Each unit's parameters are read once for the forward of the window's k micro-batches
and once for their backward, instead of k times each (runtime/window.py, [Note:
unit-major micro-batches]); the gradients are summed in memory in the micro-batch
loop's order, so losses and weights are bit-identical to k calls of forward, backward
and step. A model whose micro-batches take different paths gets the micro-batch loop, with one
log line saying why; so does one whose forward draws random numbers (dropout: runtime/window.py,
[Note: random numbers in a window]), the generators put back first. ``loss_fn`` gives a
micro-batch's loss in place of the model called on it (the Trainer integrations run their
own training step there). Activation checkpointing works: on the CPU each micro-batch's
backward runs on its own thread; on CUDA (one autograd call) Hugging Face models'
checkpoint function is bound to each micro-batch for the window, and a forward
recomputed by another checkpoint function is refused with an error that says to use
the loop. With ``activation_checkpointing.cpu_checkpointing`` the tensors a window (or each
micro-batch of the loop) saves for backward go through the engine's saved-tensor store:
host memory up to ``max_in_cpu_bytes``, past it NVMe (runtime/activation_spill.py); its
swap file goes when the window ends, failed or not.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
from typing import Callable, Iterable, List, Optional

import torch

from ..runtime.timers import log_rank0
from ..runtime.window import DrawsRandomNumbers, MicroBatchWindow, NotUnitMajor
from ..stores.malloc_trim import return_freed_heap

_TOLD = set()  # reasons already logged (once per process each)


def _inputs(micro_batch):
    """(args, kwargs) of one micro-batch: a dict as keyword arguments, a tuple or list as
    positional ones, anything else as the one argument."""
    if isinstance(micro_batch, dict):
        return (), micro_batch
    if isinstance(micro_batch, (tuple, list)):
        return tuple(micro_batch), {}
    return (micro_batch,), {}


def mean_loss(losses: List[torch.Tensor]) -> torch.Tensor:
    return torch.stack([l.detach().reshape(()).float() for l in losses]).mean()


def _loss_of(output) -> torch.Tensor:
    """The loss in a module's output: the tensor itself, ``.loss`` (Hugging Face) or ``["loss"]``."""
    loss = output
    if not isinstance(loss, torch.Tensor):
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"train_batch needs the model to return its loss (a one-element tensor, or an output "
                        f"with .loss or ['loss']); it returned {type(output).__name__}")
    return loss


def _take(engine, micro_batches: Iterable) -> List:
    gas = engine.gradient_accumulation_steps()
    if micro_batches is None:
        raise TypeError("train_batch needs the window's micro-batches: an iterable of "
                        "gradient_accumulation_steps micro-batches")
    if isinstance(micro_batches, (list, tuple)):
        items = list(micro_batches)
        if len(items) != gas:
            raise ValueError(f"train_batch got {len(items)} micro-batches; the config's "
                             f"gradient_accumulation_steps is {gas}")
        return items
    items = list(itertools.islice(iter(micro_batches), gas))  # an iterator: the next window, as DeepSpeed's
    if len(items) != gas:
        raise ValueError(f"train_batch took {len(items)} micro-batches from the iterator before it ended; "
                         f"the config's gradient_accumulation_steps is {gas}")
    return items


def _tell(engine, why: str) -> None:
    if why not in _TOLD:
        _TOLD.add(why)
        log_rank0(engine.comm.rank, f"[zero] train_batch runs the micro-batch loop: {why}", logging.INFO)


def _model_loss(engine) -> Callable:
    """The default ``loss_fn``: the engine (the model, inputs moved) called on the micro-batch."""
    def loss_fn(micro_batch):
        args, kwargs = _inputs(micro_batch)
        return engine(*args, **kwargs)
    return loss_fn


# -- the saved-tensor store (activation_checkpointing.cpu_checkpointing) ---------------------------

class _Activations:
    """The engine's saved-tensor store around a window or a loop micro-batch (none: no-ops)."""

    def __init__(self, store):
        self.store = store

    def begin(self, backward_turns: bool) -> None:
        if self.store is not None:
            self.store.begin(backward_turns)

    def saving(self, micro_batch: int, turns_passed: Callable[[], int] = lambda: 0):
        """The block's saved tensors go to the store (nothing changes without one)."""
        return self.store.saving(micro_batch, turns_passed) if self.store is not None else contextlib.nullcontext()

    def forward_done(self) -> None:
        if self.store is not None:
            self.store.forward_done()

    def end_after(self, error: BaseException) -> None:
        """End the store because ``error`` is being raised: an error of its own is noted on it."""
        if self.store is None:
            return
        try:
            self.store.end()
        except BaseException as other:  # noqa: BLE001 - noted; the window's own error is the one to raise
            error.add_note(f"ending the window's saved activations also failed: {type(other).__name__}: {other}")

    @contextlib.contextmanager
    def ended(self):
        """End the store after the block, failed or not (its own error raised only after a block
        that raised none)."""
        try:
            yield
        except BaseException as error:
            self.end_after(error)
            raise
        if self.store is not None:
            self.store.end()


def _rng_state(device: torch.device) -> Callable[[], List[torch.Tensor]]:
    """The generators a forward on ``device`` may draw from: the CPU's, and the device's."""
    if device.type == "cuda":
        return lambda: [torch.get_rng_state(), torch.cuda.get_rng_state(device)]
    return lambda: [torch.get_rng_state()]


def _set_rng_state(device: torch.device, states: List[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)


_CHECKPOINT_FUNC = "_gradient_checkpointing_func"  # where Hugging Face models keep theirs


def _bind_checkpointing(module, window: MicroBatchWindow) -> None:
    """Hugging Face layers recompute their forward in backward through ``_gradient_checkpointing_func``:
    for the window, each runs as the micro-batch that called it (runtime/window.py)."""
    for m in module.modules():
        func = m.__dict__.get(_CHECKPOINT_FUNC)
        if func is not None:
            m.__dict__["_zero_unbound_checkpointing"] = func
            m.__dict__[_CHECKPOINT_FUNC] = window.bind_checkpointing(func)


def _unbind_checkpointing(module) -> None:
    for m in module.modules():
        func = m.__dict__.pop("_zero_unbound_checkpointing", None)
        if func is not None:
            m.__dict__[_CHECKPOINT_FUNC] = func


class TrainBatch:
    """``engine.train_batch`` of one engine: a client of its public methods and of its
    BackwardPass, with the one state of its own that outlives a call (whether the model's
    forward draws random numbers, which sends every later window to the loop)."""

    def __init__(self, engine):
        self.engine = engine
        self.draws_random_numbers = False

    @property
    def _activations(self) -> _Activations:
        return _Activations(self.engine.parts.activations)

    @property
    def _threaded_backward(self) -> bool:
        """The k backwards run on the window's threads (CPU); on CUDA autograd runs a device's work
        on a thread of its own, so they are one call (runtime/window.py)."""
        return self.engine.device.type == "cpu"

    def window_losses(self, micro_batches, loss_fn: Optional[Callable] = None,
                      scale_wrt_gas: bool = True) -> List[torch.Tensor]:
        """The window; each micro-batch's loss (detached, as ``loss_fn`` gave it) in order."""
        engine = self.engine
        engine.check_can_train()
        items = _take(engine, micro_batches)
        loss_fn = loss_fn if loss_fn is not None else _model_loss(engine)
        engine.backward_pass.check_window_start()
        if len(items) == 1 or self.draws_random_numbers:
            return self._loop(items, loss_fn, scale_wrt_gas)
        rng = _rng_state(engine.device)()
        try:
            losses = self._forward_window(items, loss_fn)
        except NotUnitMajor as error:
            if isinstance(error, DrawsRandomNumbers):
                _set_rng_state(engine.device, rng)  # the loop draws the window's numbers from the start
                self.draws_random_numbers = True  # from now on: a window would only stop again
                _tell(engine, "its forward draws random numbers (dropout?), which unit-major would draw in another "
                              "order than the loop; it runs the loop from now on")
            else:
                _tell(engine, f"its micro-batches take different paths through the model ({error})")
            return self._loop(items, loss_fn, scale_wrt_gas)
        try:
            scaled = [engine.backward_pass.scaled(loss, scale_wrt_gas) for loss in losses]
            engine.backward_pass.run_window(len(items), lambda: self._backward_window(scaled))
        except BaseException as error:
            self._end_window(failed=True, error=error)
            raise
        self._end_window(failed=False)
        with self._activations.ended():
            engine.step()
        return [loss.detach() for loss in losses]

    def _loop(self, items: List, loss_fn: Callable, scale_wrt_gas: bool) -> List[torch.Tensor]:
        engine, activations = self.engine, self._activations
        losses = []
        for mb in items:
            activations.begin(backward_turns=False)
            with activations.ended():
                with activations.saving(0):
                    loss = _loss_of(loss_fn(mb))
                activations.forward_done()
                engine.backward(loss, scale_wrt_gas=scale_wrt_gas)
                engine.step()
            losses.append(loss.detach())
        return losses

    def _forward_window(self, items: List, loss_fn: Callable) -> List[torch.Tensor]:
        engine, activations = self.engine, self._activations
        window = MicroBatchWindow(len(items), rng_state=_rng_state(engine.device), device=engine.device)
        engine.parts.coordinator.begin_window(window)
        if not self._threaded_backward:
            _bind_checkpointing(engine.module, window)
        activations.begin(backward_turns=self._threaded_backward)

        def micro_batch_loss(i: int) -> torch.Tensor:
            with activations.saving(i, lambda: window.turns_passed):
                return _loss_of(loss_fn(items[i]))

        try:
            with engine.backward_pass.forward():
                losses = window.run(micro_batch_loss)
                activations.forward_done()
                window.rng_state = None  # backward draws none of its own (a recomputed forward restores them)
            return losses
        except BaseException as error:
            self._end_window(failed=True, error=error)
            raise

    def _backward_window(self, scaled: List[torch.Tensor]) -> None:
        """The k backwards taking turns at each unit on CPU; one autograd call on CUDA (runtime/window.py)."""
        coordinator = self.engine.parts.coordinator
        if self._threaded_backward:
            coordinator.window.run(lambda i: torch.autograd.backward(scaled[i]))
            coordinator.end_backward()
        else:
            torch.autograd.backward(scaled)

    def _end_window(self, failed: bool, error: Optional[BaseException] = None) -> None:
        """Forget the window's aliases; after a failure (``error``) also its kept gradients, holds and
        saved activations (after a success those end with the step)."""
        if failed:
            self._activations.end_after(error)
        window = self.engine.parts.coordinator.end_window(failed)
        if not self._threaded_backward:
            _unbind_checkpointing(self.engine.module)
        window.forget()
        return_freed_heap()  # each of the k threads freed into a malloc arena of its own
