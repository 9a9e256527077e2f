"""An accumulation window run unit-major: each unit's parameters are gathered once for the
forward of all k micro-batches and once for their backward (``engine.train_batch``).

[Note: unit-major micro-batches]
The k forwards run on k threads that take turns (a baton passed round-robin): a thread
runs until its forward reaches the next unit (a module owning parameters), then hands
over, so every micro-batch passes a unit before any goes on to the next one. Only one
thread runs at a time, in a fixed order, so the computation is the same as the
micro-batch loop's, only reordered. The first thread fetches and records the trace (the
prefetcher sees one forward); the last one releases. A thread that reaches another unit
than the first thread did at the same step (data-dependent paths) stops the window
(:class:`PathsDiffer`), and the engine runs the micro-batch loop instead.

Backward runs the same way: k threads, one backward each, taking turns at each unit
(the hook that gathers a unit before its backward), so every micro-batch's backward
passes a unit before any goes on to the one below it; a unit is gathered once and its
gradients wait for at most k - 1 micro-batches. (autograd alone, given the k losses in
one call, ran them micro-batch after micro-batch: every unit stayed gathered and k - 1
gradients of the whole model waited.) On CUDA, where autograd runs each device's work
on one thread of its own that a waiting hook would block, backward is one call over the
k losses instead. To keep each micro-batch's gradient apart, as
the loop's ``p.grad`` is, thread i reads every parameter through its own alias, a leaf
that shares the parameter's data (the unit re-points aliases when it gathers or
releases: :meth:`ParamUnit.gather`), so autograd accumulates a gradient per alias. A
unit's gradients go to the reducer once all k micro-batches' have arrived, micro-batch 1
first, so every sum is the loop's sum in the loop's order: results are bit-identical.
A forward recomputed during backward (activation checkpointing) runs, on the CPU, on
its micro-batch's own thread, aliases included. On CUDA (one backward call, on no window
thread) a checkpoint function bound by :meth:`MicroBatchWindow.bind_checkpointing` (what
``train_batch`` does to Hugging Face's) replays it as its micro-batch; a parameter read
outside any micro-batch (another checkpoint function) is refused rather than given a
gradient that would mix micro-batches.

[Note: random numbers in a window]
The loop's forwards draw from the generator micro-batch after micro-batch; interleaved,
micro-batch 2's first dropout would take numbers the loop gives to micro-batch 1's
second. No reordering can give each micro-batch the loop's numbers (micro-batch 2's
start is where micro-batch 1's whole forward ends), so a window whose forwards draw any
(the generators' states change during a turn) stops at once with
:class:`DrawsRandomNumbers`; train_batch puts the generators back and runs the loop.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn


class NotUnitMajor(RuntimeError):
    """This window cannot run unit-major with the loop's results: the engine runs the loop instead."""


class PathsDiffer(NotUnitMajor):
    """Micro-batches of one window reached different units: they cannot run unit-major."""


class DrawsRandomNumbers(NotUnitMajor):
    """A forward drew random numbers (dropout): unit-major would draw them in another order than
    the loop (see [Note: random numbers in a window])."""


class _Stopped(BaseException):
    """Raised in a waiting thread when another thread ended the window early."""


class MicroBatchWindow:
    """The k threads of one window's forwards (then backwards), their aliases and gradients."""

    def __init__(self, k: int, rng_state: Optional[Callable[[], List[torch.Tensor]]] = None,
                 device: Optional[torch.device] = None):
        self.k = k
        # The compute device: a new thread's current CUDA device is cuda:0 whatever its creator's,
        # so each window thread makes it current before it computes (kernels, allocations, streams).
        self.device = device
        self.rng_state = rng_state  # the generators' states, watched during forwards (see the note)
        self._turn_rng: Optional[List[torch.Tensor]] = None
        self._local = threading.local()
        self._turn = 0
        self._alive = [True] * k
        self._lock = threading.Lock()
        self._gates = [threading.Event() for _ in range(k)]  # gate i open: thread i's turn (or stopped)
        self._events: List[nn.Module] = []  # the first thread's units, in forward order
        self._count = [0] * k
        self._outputs = [0] * k
        self.stopped: Optional[BaseException] = None
        self._backward_passes: Dict[nn.Module, set] = {}  # micro-batches whose backward is done with a module
        self.aliases: Dict[Tuple[nn.Parameter, int], torch.Tensor] = {}
        self.grads: Dict[Tuple[nn.Parameter, int], torch.Tensor] = {}

    # -- which thread is this --------------------------------------------------------------------
    @property
    def index(self) -> Optional[int]:
        """This thread's micro-batch (0-based); None outside the window's forward threads."""
        return getattr(self._local, "index", None)

    @property
    def replaying(self) -> bool:
        """A forward recomputed during backward, as micro-batch :attr:`index`."""
        return getattr(self._local, "replaying", False)

    @contextlib.contextmanager
    def acting_as(self, i: int):
        """Run the block as micro-batch ``i`` (a checkpointed forward, now or replayed later)."""
        saved = (self.index, self.replaying)
        self._local.replaying = saved[0] is None
        self._local.index = i
        try:
            yield
        finally:
            self._local.index, self._local.replaying = saved

    def bind_checkpointing(self, checkpoint: Callable) -> Callable:
        """``checkpoint(fn, *args)`` whose ``fn`` runs as the calling thread's micro-batch,
        also when backward replays it."""
        @functools.wraps(checkpoint)
        def checkpointed(fn, *args, **kwargs):
            i = self.index

            def as_micro_batch(*a, **k):
                with self.acting_as(i):
                    return fn(*a, **k)
            return checkpoint(as_micro_batch, *args, **kwargs) if i is not None else checkpoint(fn, *args, **kwargs)
        return checkpointed

    @property
    def turns_passed(self) -> int:
        """How many places where its backward will take a turn this thread's forward has passed:
        the outputs of modules, hooked for their backward (0 outside the window's threads). A tensor
        saved for backward after n of them is used between the backward's turns n + 1 and n."""
        i = self.index
        return self._outputs[i] if i is not None else 0

    def finished(self, module: nn.Module) -> None:
        """This thread's forward finished ``module``, whose backward starts with a turn."""
        i = self.index
        if i is not None and not self.replaying:
            self._outputs[i] += 1

    def backward_passed(self, module: nn.Module, index: Optional[int]) -> bool:
        """Micro-batch ``index``'s backward is done with ``module``; True once all k are (then again
        for a module a forward calls more than once). A micro-batch counts once however often it
        says so (a checkpointed segment's recompute hooks its first module's input a second time)."""
        with self._lock:
            seen = self._backward_passes.setdefault(module, set())
            seen.add(index)
            if len(seen) < self.k:
                return False
            seen.clear()
            return True

    @property
    def first(self) -> bool:
        return self.index in (None, 0)

    @property
    def last(self) -> bool:
        return self.index in (None, self.k - 1)

    # -- taking turns ----------------------------------------------------------------------------
    def _wait_turn(self, i: int) -> None:
        # One gate per thread, so a pass wakes the next thread only: with one condition for all,
        # each pass woke the k - 1 waiting threads to fight for the GIL and sleep again (hundreds
        # of thousands of context switches an iteration at k = 16).
        gate = self._gates[i]
        gate.wait()
        gate.clear()
        if self.stopped is not None:
            raise _Stopped()
        if self.rng_state is not None:
            self._turn_rng = self.rng_state()

    def _check_no_draws(self, i: int) -> None:
        """Before thread ``i`` passes the baton: its turn drew no random numbers (see the note)."""
        if self.rng_state is not None and not all(
                torch.equal(a, b) for a, b in zip(self._turn_rng, self.rng_state())):
            raise DrawsRandomNumbers(f"the forward of micro-batch {i + 1} of the window drew random numbers "
                                     f"(dropout?), which unit-major would draw in another order than the loop")

    def _pass_turn(self, i: int) -> None:
        """Hand the baton to the next live thread after ``i``."""
        with self._lock:
            for step in range(1, self.k + 1):
                j = (i + step) % self.k
                if self._alive[j]:
                    self._turn = j
                    self._gates[j].set()
                    break

    def reached(self, module: nn.Module) -> None:
        """This thread's forward reached ``module``'s units: let the others catch up first."""
        i = self.index
        if i is None or self.replaying:
            return
        n = self._count[i]
        self._count[i] += 1
        if i == 0:
            self._events.append(module)
        elif n >= len(self._events) or self._events[n] is not module:
            raise PathsDiffer(f"micro-batch {i + 1} of the window reached {type(module).__name__} where "
                              f"micro-batch 1 reached "
                              f"{type(self._events[n]).__name__ if n < len(self._events) else 'the end'}")
        if self.k > 1:
            self._check_no_draws(i)
            self._pass_turn(i)
            self._wait_turn(i)

    def _stop(self, error: BaseException) -> None:
        with self._lock:
            if self.stopped is None:
                self.stopped = error
            for gate in self._gates:
                gate.set()

    def run(self, fn: Callable[[int], object]) -> List[object]:
        """``fn(i)`` on k threads taking turns; their results, or the first error raised."""
        results: List[object] = [None] * self.k
        self._turn, self._alive, self._count, self._events = 0, [True] * self.k, [0] * self.k, []
        self._outputs = [0] * self.k
        for gate in self._gates:
            gate.clear()
        self._gates[0].set()

        def body(i: int) -> None:
            self._local.index = i
            try:
                if self.device is not None and self.device.type == "cuda":
                    torch.cuda.set_device(self.device)
                self._wait_turn(i)
                results[i] = fn(i)
                self._check_no_draws(i)
                if i > 0 and self._count[i] != len(self._events):
                    raise PathsDiffer(f"micro-batch {i + 1} of the window reached {self._count[i]} units where "
                                      f"micro-batch 1 reached {len(self._events)}")
            except _Stopped:
                pass
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                self._stop(error)
            finally:
                with self._lock:
                    self._alive[i] = False
                self._pass_turn(i)

        threads = [threading.Thread(target=body, args=(i,), name=f"zero-microbatch-{i}", daemon=True)
                   for i in range(self.k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.stopped is not None:
            raise self.stopped
        return results

    # -- aliases and gradients -------------------------------------------------------------------
    def alias(self, p: nn.Parameter, unit, on_grad: Callable[[nn.Parameter, int, torch.Tensor], None]):
        """Micro-batch ``index``'s alias of ``p``: a leaf sharing ``p``'s data (see the note)."""
        i = self.index
        key = (p, i)
        a = self.aliases.get(key)
        if a is None:
            a = p.detach().requires_grad_(p.requires_grad)
            if p.requires_grad:
                def hook(t, p=p, i=i):
                    grad, t.grad = t.grad, None
                    on_grad(p, i, grad)
                a.register_post_accumulate_grad_hook(hook)
            self.aliases[key] = a
            unit.add_alias(p, a)
        return a

    def forget(self) -> None:
        """Drop the aliases (pointed at nothing, so a graph or a cycle that outlives the window
        holds no gathered weights) and any gradients still kept."""
        for a in self.aliases.values():
            a.data = torch.empty(0, dtype=a.dtype, device=a.device)
        self.aliases.clear()
        self.grads.clear()

    def take(self, p: nn.Parameter, i: int, grad: torch.Tensor) -> None:
        self.grads[(p, i)] = grad

    def pop_grad(self, p: nn.Parameter, i: int) -> Optional[torch.Tensor]:
        return self.grads.pop((p, i), None)
