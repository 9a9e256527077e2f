"""ZeroEngine: forward, backward and step of a ZeRO model (stages 0-3, build.py's [Note: the ZeRO ladder]).

``engine(*inputs)`` runs the module (tensors in the inputs are moved to the
compute device; with ``fp16.auto_cast`` floating inputs are cast to fp16);
the hooks gather and release parameters (runtime/hooks.py).
``engine.backward(loss)`` scales the loss by ``1 / gradient_accumulation_steps``
and, for fp16, by the loss scale; the hooks reduce the gradients into this
rank's fp32 partition (runtime/grad_reducer.py). ``engine.step()`` counts micro-batches and
runs the optimizer (optimizer.py) only at the end of each accumulation
window, as DeepSpeed does, then the LR scheduler, unless fp16 overflowed.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
import weakref
from typing import Optional

import torch
import torch.nn as nn

from .backward_pass import BackwardPass, EngineStateError
from .build import EngineParts, OptimizerSpec, build_parts, release_after_failure
from ..runtime.comm import Comm
from ..config import DeepSpeedConfig, IgnoredSettingWarning
from ..partitioning import hf_zero3
from ..runtime.timers import Timers, log_rank0
from ..stores import malloc_settings
from ..stores.checkpointed_state import CheckpointedState
from ..stores.param_store import MasterFromParameters


def _to_device(value, device: torch.device, cast: Optional[torch.dtype]):
    if isinstance(value, torch.Tensor):
        value = value.to(device, non_blocking=True)
        if cast is not None and value.is_floating_point():
            value = value.to(cast)
        return value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to_device(v, device, cast) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _to_device(v, device, cast)) for k, v in value.items())
    return value


class ZeroEngine(nn.Module):
    """What :func:`zero.initialize` returns first. Use it like the model it wraps."""

    def __init__(self, module: nn.Module, config: DeepSpeedConfig, comm: Comm, device: torch.device,
                 spec: Optional[OptimizerSpec]):
        super().__init__()
        self.config = config
        self.comm = comm
        self.device = device
        self.timers = Timers(config.wall_clock_breakdown, device)
        self.parts: EngineParts = build_parts(module, config, comm, device, spec, self.timers)
        # Threads, kernel AIO contexts and swap files go when the engine does, destroyed or not;
        # the callback holds the parts' releases, never the engine.
        self._finalizer = weakref.finalize(self, self.parts.release.close)
        self._closed = False
        try:  # what follows can raise too (a warning made an error): release then
            self.module = module  # registered after the hooks, so the engine never shows as a parent
            self.optimizer = self.parts.optimizer
            self.lr_scheduler = None
            self.global_steps = 0
            self.global_samples = 0
            self._train_batch = None  # TrainBatch, at the first train_batch call
            self._last_report = 0
            self._waits_seen = (0.0, 0.0)
            self._unusable: Optional[str] = None
            self._step_failure = ""
            offload = config.zero_optimization.offload_optimizer
            why_not = self.optimizer.why_not_step_in_backward() if self.optimizer is not None else "no optimizer"
            if offload.step_in_backward and "step_in_backward" in offload.model_fields_set and why_not:
                warnings.warn(f"zero_optimization.offload_optimizer.step_in_backward = true has no effect: {why_not}",
                              IgnoredSettingWarning, stacklevel=3)
            self.backward_pass = BackwardPass(self.parts, self.optimizer, comm, self.timers,
                                              config.gradient_accumulation_steps, offload.step_in_backward,
                                              self.mark_unusable)
            # transformers sees ZeRO-3 while a stage-3 engine exists (partitioning/hf_zero3.py); held here
            # only, so the source goes when the engine is destroyed or collected
            self._hf_source = hf_zero3.Zero3Source("ZeroEngine", config.model_dump(exclude_unset=True)) \
                if config.zero_optimization.stage == 3 else None
            if self._hf_source is not None:
                if "transformers" in sys.modules:  # its model building meets the flag on our paths
                    from ..partitioning.hf_hook import install

                    install()
                hf_zero3.activate(self._hf_source)
        except BaseException as error:
            self._release_failed(error)
            raise

    # -- DeepSpeed-style accessors ----------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def local_rank(self) -> int:
        return self.comm.local_rank

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> Optional[int]:
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> Optional[int]:
        return self.config.train_batch_size

    def get_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer else []

    def get_mom(self):
        return [g.get("betas") for g in self.optimizer.param_groups] if self.optimizer else []

    def get_global_grad_norm(self) -> Optional[float]:
        return self.optimizer.global_grad_norm if self.optimizer else None

    def get_loss_scale(self) -> float:
        return self.optimizer.loss_scale if self.optimizer else 1.0

    @property
    def skipped_steps(self) -> int:
        return self.optimizer.skipped_steps if self.optimizer else 0

    @property
    def micro_steps(self) -> int:
        """Forward/backward/step rounds so far (DeepSpeed's counter; checkpointed)."""
        return self.backward_pass.micro_steps

    @micro_steps.setter
    def micro_steps(self, value: int) -> None:
        self.backward_pass.micro_steps = value

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.backward_pass.is_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """True: the next backward and ``step()`` end this accumulation window however few micro-batches
        it has had (DeepSpeed's name), as a training loop does at the end of an epoch whose batches do
        not fill the last window; the next window then starts at micro-batch 0. False: undo."""
        self.backward_pass.set_boundary(is_boundary)

    def __getattr__(self, name: str):
        """What the engine lacks is the model's (``engine.generate(...)``, ``engine.gradient_checkpointing_enable()``),
        as DeepSpeed's engine passes such attributes through: its ZeRO-Inference scripts call either."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None and name != "module":
                try:
                    return getattr(module, name)
                except AttributeError:
                    pass
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'") from None

    def train(self, mode: bool = True) -> "ZeroEngine":
        self.module.train(mode)
        self.training = mode
        return self

    # -- a failed step or load ---------------------------------------------------------------------
    def mark_unusable(self, why: str) -> None:
        """Refuse forward, backward, step and saves, with ``why``, until a checkpoint is loaded."""
        self._unusable = why

    def mark_usable(self) -> None:
        self._unusable = None
        if self.optimizer is not None:
            self.optimizer.abandon_step()

    def check_usable(self) -> None:
        if self._closed:
            raise EngineStateError("this engine was destroyed")
        if self._unusable is not None:
            raise EngineStateError(self._unusable)
        if self.optimizer is not None and self.optimizer.step_in_progress:
            raise EngineStateError(self._step_failure)

    # -- forward, backward, step ------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        coordinator = self.parts.coordinator
        if coordinator.window is not None and coordinator.window.index is not None:
            # called by train_batch's loss_fn on a window thread: the window set up the rest
            args, kwargs = self.inputs_on_device(args, kwargs)
            return self.module(*args, **kwargs)
        self.check_usable()
        args, kwargs = self.inputs_on_device(args, kwargs)
        try:
            with self.backward_pass.forward():
                return self.module(*args, **kwargs)
        except BaseException:
            # with deferred reads a unit may have gathered zeros for a failed read: release all
            coordinator.abandon_forward(release=self.backward_pass.defer_reads)
            raise

    def inputs_on_device(self, args: tuple, kwargs: dict):
        """Tensors in a forward's inputs on the compute device (cast to fp16 with ``fp16.auto_cast``)."""
        cast = torch.float16 if self.config.fp16.enabled and self.config.fp16.auto_cast else None
        return _to_device(args, self.device, cast), _to_device(kwargs, self.device, cast)

    def train_batch(self, micro_batches, loss_fn=None, scale_wrt_gas: bool = True) -> torch.Tensor:
        """One accumulation window: forward, backward and step of ``gradient_accumulation_steps``
        micro-batches (an iterable; from an iterator, the next that many), each unit's parameters
        read once for the window's forwards and once for its backwards; returns the mean loss.
        ``loss_fn(micro_batch)`` gives a micro-batch's loss (default: the model called on it; it may
        call this engine); ``scale_wrt_gas`` as in :meth:`backward`. Results are bit-identical to
        the micro-batch loop (engine/train_batch.py)."""
        from .train_batch import mean_loss

        return mean_loss(self.train_batch_losses(micro_batches, loss_fn, scale_wrt_gas))

    def train_batch_losses(self, micro_batches, loss_fn=None, scale_wrt_gas: bool = True):
        """:meth:`train_batch`, returning each micro-batch's loss (detached, as ``loss_fn`` gave it)
        in order instead of their mean (the Trainer integrations log them)."""
        if self._train_batch is None:
            from .train_batch import TrainBatch

            self._train_batch = TrainBatch(self)
        return self._train_batch.window_losses(micro_batches, loss_fn, scale_wrt_gas)

    def check_can_train(self) -> None:
        """Refuse training without an optimizer or while the engine is unusable."""
        self.backward_pass.check_can_train()
        self.check_usable()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` divided by the accumulation steps (DeepSpeed's ``scale_wrt_gas``;
        False when the caller divided it already, as the Hugging Face Trainer does)."""
        self.check_can_train()
        scaled = self.backward_pass.scaled(loss, scale_wrt_gas)
        self.backward_pass.run(lambda: scaled.backward(retain_graph=retain_graph),
                               self.is_gradient_accumulation_boundary())
        return loss

    def step(self) -> None:
        if self.optimizer is None:
            raise RuntimeError("this engine has no optimizer")
        retry = self.optimizer.step_in_progress  # a step that failed half way: finish it
        if not retry:
            self.check_usable()
        if retry or self.is_gradient_accumulation_boundary():
            self._take_step()
        self.backward_pass.stepped()

    def _take_step(self) -> None:
        try:
            with self.timers.phase("optimizer"):
                stepped = self.optimizer.step()
        except BaseException as error:
            if self.optimizer.step_in_progress:
                done, total = self.optimizer.step_progress()
                self._step_failure = (
                    f"optimizer step {self.global_steps + 1} failed ({type(error).__name__}: {error}) after "
                    f"updating {done} of {total} sub-groups, so the model and optimizer are partly updated; "
                    f"forward, backward and saves are refused until the step is finished. Call "
                    f"engine.step() again to finish it with the same gradients once the cause is fixed, or "
                    f"engine.load_checkpoint(...) to return to the last checkpoint")
                error.add_note(self._step_failure)
            raise
        if stepped:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        else:
            log_rank0(self.comm.rank, f"[zero] {self.optimizer.last_overflow_message}", logging.WARNING)
        self.global_steps += 1
        if self.config.train_batch_size:
            self.global_samples += self.config.train_batch_size
        if stepped:  # (counted first: below stage 3 the refresh gathers, and may fail)
            self.parts.coordinator.refresh(after_step=True)
        malloc_settings.step_ended()  # computing on the CPU: the heap kept near one iteration's size
        if self.timers.enabled:
            self._report_times()
        every = self.config.steps_per_print
        if every and self.global_steps % every == 0:
            self._report()

    def _report(self) -> None:
        log_rank0(self.comm.rank, (
            f"step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}, "
            f"mom={self.get_mom()}, loss_scale={self.get_loss_scale():g}"))
        self._last_report = self.global_steps

    def _report_times(self) -> None:
        """``wall_clock_breakdown``: one line per step saying where its time went."""
        stores = [self.parts.param_store] + ([self.parts.optimizer_store] if self.parts.optimizer_store else [])
        reads = sum(s.read_wait_seconds for s in stores)
        writes = sum(s.write_wait_seconds for s in stores)
        self.timers.add("read wait", reads - self._waits_seen[0])
        self.timers.add("write wait", writes - self._waits_seen[1])
        self._waits_seen = (reads, writes)
        log_rank0(self.comm.rank, self.timers.report(self.global_steps))

    # -- what checkpoints read and write (checkpoint/): nothing else of the engine's parts --------
    @property
    def rank_layout(self):
        """This rank's units and sub-groups."""
        return self.parts.rank_layout

    @property
    def units(self):
        """The units: each one's layout and parameters."""
        return self.parts.units

    @property
    def frozen_shards(self):
        """The units whose shards are stored quantized (stores/quantized.py)."""
        return self.parts.param_store.frozen

    @property
    def checkpointed_state(self):
        """The sub-groups' master and states, saved and loaded by the store that holds them
        (stores/optimizer_store.py, [Note: each store saves and loads its own state])."""
        params = MasterFromParameters(self.parts.rank_layout, self.parts.param_store)
        if self.parts.optimizer_store is None:
            return params
        return CheckpointedState(self.parts.optimizer_store, params)

    def current_master(self, sub_group) -> torch.Tensor:
        """``sub_group``'s fp32 values as they are (what a load keeps of the units a checkpoint left
        out): the optimizer's master for a trainable one, the parameters for a frozen one."""
        with self.checkpointed_state.viewed(sub_group) as (master, _):
            return master.clone()

    def begin_load(self) -> None:
        """Before a load writes any sub-group (:meth:`load_parameters`, then :meth:`finish_load`)."""
        if torch.cuda.is_initialized():
            # work queued before the load (a forward whose output was never read) may still be
            # copying host shards the load overwrites; a load is rare, so wait for all of it
            torch.cuda.synchronize()

    def load_parameters(self, sub_group, master: torch.Tensor) -> None:
        """The parameters of ``sub_group``'s units from its loaded fp32 master."""
        layout = self.parts.rank_layout
        for index in sub_group.units:
            start, stop = layout.unit_range(index)
            self.parts.param_store.write(layout.units[index], master[start - sub_group.start:stop - sub_group.start])

    def finish_load(self) -> None:
        """After a load wrote every sub-group: parameters flushed, none gathered, no gradients."""
        self.parts.param_store.flush()
        self.parts.coordinator.refresh()
        if self.parts.reducer is not None:
            self.parts.reducer.clear()

    def each_unit_gathered(self, trainable_only: bool = False):
        """Each unit in turn (``trainable_only``: those owning a parameter with ``requires_grad``),
        gathered (held) while the caller reads its parameters."""
        for unit in self.parts.units:
            if trainable_only and not any(p.requires_grad for p in unit.params):
                continue
            unit.hold()
            unit.gather()
            try:
                yield unit
            finally:
                unit.unhold()
                self.parts.coordinator.maybe_release(unit)

    # -- checkpoints and model export ---------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """``exclude_frozen_parameters``: leave out the modules whose parameters all have
        ``requires_grad=False`` (a LoRA base); loading it then takes ``load_module_strict=False``
        (checkpoint/save.py [Note: checkpoints without the frozen units])."""
        from ..checkpoint.save import save_checkpoint

        self.check_usable()
        return save_checkpoint(self, os.fspath(save_dir), tag, client_state or {}, save_latest,
                               exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False):
        """``load_module_strict=False`` takes a checkpoint saved with ``exclude_frozen_parameters``:
        the parameters it lacks keep their values."""
        from ..checkpoint.load import load_checkpoint

        return load_checkpoint(self, os.fspath(load_dir), tag, load_optimizer_states and not load_module_only,
                               load_lr_scheduler_states and not load_module_only, load_module_strict)

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        from ..checkpoint.model_file import save_16bit_model

        self.check_usable()
        return save_16bit_model(self, os.fspath(save_dir), save_filename, exclude_frozen_parameters)

    def destroy(self) -> None:
        """Remove the hooks and the swap files; the engine cannot be used afterwards.

        An engine dropped without it is released the same way when it is collected."""
        if self._closed:
            return
        self._closed = True
        hf_zero3.deactivate(getattr(self, "_hf_source", None))
        self._finalizer()

    def _release_failed(self, error: BaseException) -> None:
        """Release as :meth:`destroy` does because ``error`` is being raised before the engine
        reached the caller (zero.initialize): a release that fails is noted on ``error``, never
        raised in its place (see [Note: a failed build gives back what it took] in build.py)."""
        if self._closed:
            return
        self._closed = True
        hf_zero3.deactivate(getattr(self, "_hf_source", None))
        self._finalizer.detach()
        release_after_failure(self.parts.release, error)
