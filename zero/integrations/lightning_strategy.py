"""``ZeroStrategy``: Lightning's ``strategy=`` on nvmeio's ZeRO engine, stages 0-3 (``pip install "nvmeio[lightning]"``).

    import zero.lightning                       # registers the strategy names below
    trainer = Trainer(strategy="zero_stage_2_offload", precision="bf16-mixed")   # or:
    trainer = Trainer(strategy=zero.lightning.ZeroStrategy(stage=3, offload_optimizer=True,
        offload_parameters=True, remote_device="nvme", offload_params_device="nvme",
        offload_optimizer_device="nvme", nvme_path="/local_nvme"), precision=16)  # DeepSpeedStrategy's arguments
    zero.lightning.convert_zero_checkpoint_to_fp32_state_dict("epoch=0-step=100.ckpt", "model.ckpt")

Registered names, mirroring DeepSpeedStrategy's ``deepspeed*``: ``zero`` (the
defaults: stage 2), ``zero_stage_1``, ``zero_stage_2``, ``zero_stage_2_offload``
(optimizer states on the CPU: ZeRO-Offload), ``zero_stage_2_offload_nvme``
(optimizer states on NVMe under ``/local_nvme``), ``zero_stage_3``,
``zero_stage_3_offload`` (params and optimizer on the CPU),
``zero_stage_3_offload_nvme`` (both on NVMe under ``/local_nvme``).

The arguments mean what they mean to DeepSpeedStrategy: ``stage`` 0-3 (default
2; below 3 every rank keeps the parameters whole and the optimizer states are
partitioned, engine/build.py's [Note: the ZeRO ladder]); ``offload_optimizer=True``
from stage 1 on; ``offload_parameters=True`` and ``remote_device`` at stage 3
only; ``zero_optimization=False`` is a config without a ``zero_optimization``
section, which is stage 0. What DeepSpeed would silently ignore (an offload
or ``remote_device`` below the stage that has it, ``stage=`` beside
``zero_optimization=False``) is refused, the message naming the fix. At
stage 3 ``configure_model`` runs under ``zero.Init`` (parameters partitioned,
to NVMe with ``remote_device="nvme"``, as they are built); below it the module
is built as it is without ZeRO, as DeepSpeedStrategy does.

``precision=`` becomes the config's ``fp16`` / ``bf16`` section, with the
loss-scale arguments (``loss_scale``, ``initial_scale_power``,
``loss_scale_window``, ``hysteresis``, ``min_loss_scale``) in ``fp16``
(lightning_precision.py). DeepSpeed's activation-checkpointing arguments become
the config's ``activation_checkpointing`` section: ``cpu_checkpointing`` keeps
the tensors a ``train_batch`` window saves in host memory (with
``use_train_batch=True``; warned without), ``partition_activations``,
``contiguous_memory_optimization`` and ``synchronize_checkpoint_boundary`` are
DeepSpeed's model-parallel features, warned by the config as without effect.
``save_full_weights`` (Lightning 1.4's) makes ``Trainer.save_checkpoint`` write
one file with the gathered weights, ``load_full_weights`` loads such a file, or any
Lightning checkpoint of the module, into the partitions
(lightning_checkpoints.py). ``exclude_frozen_parameters`` leaves the frozen
parameters out of either kind of checkpoint (a checkpoint directory without
them loads as the LightningModule's ``strict_loading`` allows, as Lightning's
DeepSpeedStrategy passes it on). The options themselves live in lightning_options.py.
Tested with lightning 2.6.6.

[Note: where the engine enters Lightning]
Like Lightning's DeepSpeedStrategy, this strategy wraps the LightningModule in
the engine at ``setup`` (the engine becomes ``strategy.model``; Lightning's
forward redirection runs ``training_step`` through it, so the hooks gather the
partitions), takes the optimizer and scheduler from ``configure_optimizers``
unless the config has its own, and reads accumulation and clipping from the
Trainer. ``backward`` is the engine's (the loss arrives divided by
``accumulate_grad_batches`` already, so ``scale_wrt_gas=False``) followed by
``engine.step()``, which steps the optimizer only at the end of each
accumulation window; ``optimizer_step`` therefore only runs Lightning's
closure. Gradient clipping is the engine's (``gradient_clip_val`` becomes
``gradient_clipping``). A checkpoint is a directory: the engine's checkpoint
(tag ``checkpoint``) with Lightning's own state as its ``client_state``,
converted to plain containers so that it loads with ``weights_only``. Each
``optimizer_step`` ends the engine's window (``set_gradient_accumulation_boundary``),
so a window Lightning cuts short at an epoch's end steps as Lightning's does.

[Note: accumulation windows in Lightning]
``use_train_batch=True`` with ``accumulate_grad_batches`` k > 1 runs each window
through ``engine.train_batch`` (each unit's parameters read once for the k
forwards and once for the k backwards, not k times). Lightning's loop finishes a
batch (its ``training_step``, outputs, logs, hooks) before it fetches the next,
and unit-major needs the window's k micro-batches at once, so the strategy gives
Lightning the training loader in windows (lightning_windows.py) and tells it to
accumulate nothing (``trainer.accumulate_grad_batches`` reads 1 during ``fit``);
the strategy's ``training_step`` runs the module's ``training_step`` for each
micro-batch (``batch_idx`` as the loop gives it) on the window's threads, each
loss divided by k as Lightning divides it, and returns the window's mean loss
(the backward and step are done). Losses and weights are the loop's bit for bit;
what changes is what the loop counts: a "batch" of its hooks, callbacks and
progress is a window, so ``on_train_batch_start/end`` get a list of k batches,
``log_every_n_steps`` is unchanged (it counts optimizer steps) but integer
``val_check_interval`` and ``limit_train_batches`` count windows, and values
logged in ``training_step`` with ``on_step`` are the window's last. That is why
it is not the default. A window shorter than k (an epoch's end) runs the
micro-batch loop.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import warnings
from datetime import timedelta
from typing import Any, Dict, Mapping, Optional

import torch
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.types import LRSchedulerConfig

from ..config import IgnoredSettingWarning
from ..engine.entry import initialize
from ..partitioning.init_context import Init
from ..runtime.timers import log_rank0
from .lightning_options import config_stage, strategy_config
from .lightning_checkpoints import EXCLUDED, load_full_state_dict, plain, save_full_weights
from .lightning_precision import ZeroPrecision, apply_precision, zero_precision_of
from .lightning_windows import Window, WindowLoader

CHECKPOINT_TAG = "checkpoint"


def _loss_in(output) -> torch.Tensor:
    """The loss in a ``training_step``'s output: the tensor, or its ``"loss"``."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"ZeroStrategy(use_train_batch=True) needs training_step to return its loss (a tensor or a "
                        f"dict with 'loss'); it returned {type(output).__name__}")
    return loss


def _mark_steps_for_scheduler(optimizer) -> None:
    """Let torch's schedulers see this optimizer's steps, as for one they were built with (else each
    ``scheduler.step()`` warns that ``optimizer.step()`` was overridden)."""
    step = optimizer.step
    if getattr(step, "_wrapped_by_lr_sched", False):
        return

    @functools.wraps(step)
    def counted_step(*args, **kwargs):
        optimizer._opt_called = True
        return step(*args, **kwargs)

    counted_step._wrapped_by_lr_sched = True
    optimizer.step = counted_step


class ZeroStrategy(DDPStrategy):
    """Lightning strategy training through :func:`zero.initialize` (see the module docstring).

    Takes DeepSpeedStrategy's arguments (``stage`` 0-3, default 2; see the module
    docstring for what each needs) or ``config`` (a DeepSpeed JSON path or dict,
    which then replaces those that build a config, as in Lightning, with a warning
    naming them; its ``zero_optimization.stage`` rules), plus ``save_full_weights``.
    An unknown argument is a TypeError naming the closest known one. Its precision
    plugin is always a :class:`ZeroPrecision` (lightning_precision.py).
    ``use_train_batch=True``: with ``accumulate_grad_batches`` above 1, each window
    runs through ``engine.train_batch`` (see [Note: accumulation windows in Lightning]).
    """

    strategy_name = "zero"

    def __init__(self, accelerator=None, config=None, parallel_devices=None, cluster_environment=None,
                 process_group_backend: Optional[str] = None, timeout: Optional[timedelta] = None,
                 precision_plugin: Optional[Precision] = None, use_train_batch: bool = False, **options: Any):
        built, o = strategy_config(config, options)
        kwargs = {"timeout": timeout} if timeout is not None else {}
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, **kwargs)
        self.config = built
        self.options = o
        self.remote_device = o["remote_device"]
        self.load_full_weights = o["load_full_weights"]
        self.save_full_weights = o["save_full_weights"]
        self.exclude_frozen_parameters = o["exclude_frozen_parameters"]
        self._full_weights_loaded = False  # load_checkpoint read a single file: load_model_state_dict loads it
        logging.getLogger("zero").setLevel(o["logging_level"])
        self.engine = None
        self.use_train_batch = use_train_batch
        self.window_size = 1  # k while fit runs windows through train_batch (Lightning then accumulates 1)
        self._stepping = False  # inside optimizer_step: its backward ends the engine's window
        self._window_trained = False  # the window's backward and step are done: Lightning's backward skips

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("zero", cls, description="nvmeio ZeRO, DeepSpeedStrategy's defaults (stage 2)")
        strategy_registry.register("zero_stage_1", cls, description="nvmeio ZeRO stage 1", stage=1)
        strategy_registry.register("zero_stage_2", cls, description="nvmeio ZeRO stage 2", stage=2)
        strategy_registry.register("zero_stage_2_offload", cls, description="nvmeio ZeRO-2, optimizer offloaded "
                                   "to the CPU (ZeRO-Offload)", stage=2, offload_optimizer=True)
        strategy_registry.register("zero_stage_2_offload_nvme", cls, description="nvmeio ZeRO-2, optimizer "
                                   "offloaded to NVMe", stage=2, offload_optimizer=True,
                                   offload_optimizer_device="nvme")
        strategy_registry.register("zero_stage_3", cls, description="nvmeio ZeRO stage 3", stage=3)
        strategy_registry.register("zero_stage_3_offload", cls, description="nvmeio ZeRO-3, params and "
                                   "optimizer offloaded to the CPU", stage=3, offload_optimizer=True,
                                   offload_parameters=True)
        strategy_registry.register("zero_stage_3_offload_nvme", cls, description="nvmeio ZeRO-3, params and "
                                   "optimizer offloaded to NVMe", stage=3, offload_optimizer=True,
                                   offload_parameters=True, remote_device="nvme", offload_params_device="nvme",
                                   offload_optimizer_device="nvme")

    @property
    def precision_plugin(self) -> ZeroPrecision:
        """Always a :class:`ZeroPrecision`: the setter takes the plugin Lightning made from ``precision=``
        (lightning_precision.py, [Note: how the Trainer's precision reaches the strategy])."""
        return self._precision_plugin if self._precision_plugin is not None else ZeroPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = None if plugin is None else zero_precision_of(plugin)

    def setup_distributed(self) -> None:
        if self.num_processes * self.num_nodes > 1:
            return super().setup_distributed()
        self.set_world_ranks()  # one process: no process group, no MASTER_* variables left behind

    # -- building the engine ----------------------------------------------------------------------
    @property
    def zero_stage_3(self) -> bool:
        """The config asks for ZeRO stage 3 (DeepSpeedStrategy's property of the same name)."""
        return config_stage(self.config) == 3

    @contextlib.contextmanager
    def model_sharded_context(self):
        """``configure_model`` under ``zero.Init`` at stage 3; below it parameters stay whole (as in
        DeepSpeedStrategy, whose ``zero.Init`` is enabled at stage 3 only)."""
        if not self.zero_stage_3:
            yield
            return
        with Init(remote_device=self.remote_device, config_dict_or_path=self.config, compute_device=self.root_device):
            yield

    def _trainer_config(self, trainer) -> dict:
        """The config with what the Trainer decides: accumulation, clipping (as DeepSpeedStrategy does)."""
        config = copy.deepcopy(self.config)
        if "gradient_accumulation_steps" in config:
            raise ValueError("do not set gradient_accumulation_steps in the DeepSpeed config: it comes from "
                             "Trainer(accumulate_grad_batches=...)")
        config["gradient_accumulation_steps"] = trainer.accumulate_grad_batches
        config.pop("train_batch_size", None)  # derived from the micro batch and the accumulation
        if "gradient_clipping" not in config:
            config["gradient_clipping"] = trainer.gradient_clip_val or 0.0
        if trainer.gradient_clip_algorithm not in (None, "norm"):
            raise ValueError("ZeroStrategy clips gradients by norm only (gradient_clip_algorithm='norm')")
        apply_precision(config, self.precision_plugin.precision, self.options)  # fp16 / bf16, as DeepSpeedStrategy
        return config

    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        config = self._trainer_config(trainer)
        self._choose_windows(trainer, config["gradient_accumulation_steps"])
        if self.engine is None:
            self._build_engine(trainer, config)
        self.model = self.engine
        self.barrier()

    def _build_engine(self, trainer, config: dict) -> None:
        module = self.lightning_module
        optimizer, scheduler_configs = None, []
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and "optimizer" not in config:
            optimizers, scheduler_configs = _init_optimizers_and_lr_schedulers(module)
            if len(optimizers) != 1 or len(scheduler_configs) > 1:
                raise ValueError(f"ZeroStrategy takes one optimizer and at most one scheduler from "
                                 f"configure_optimizers, got {len(optimizers)} and {len(scheduler_configs)}")
            optimizer = optimizers[0]
        if not fitting:
            config.pop("optimizer", None)
            config.pop("scheduler", None)
        module = self.precision_plugin.convert_module(module)  # 16-true / bf16-true: 16-bit before the engine
        engine, zero_optimizer, _, _ = initialize(model=module, config=config, optimizer=optimizer,
                                                  compute_device=self.root_device)  # accelerator="cpu": the CPU
        for sc in scheduler_configs:  # the script's scheduler now drives the engine's param groups
            for old, new in zip(optimizer.param_groups, zero_optimizer.param_groups):
                if "initial_lr" in old:
                    new["initial_lr"] = old["initial_lr"]
            sc.scheduler.optimizer = zero_optimizer
            _mark_steps_for_scheduler(zero_optimizer)
        if engine.lr_scheduler is not None:  # the config's scheduler, stepped by Lightning (each step)
            scheduler_configs = [LRSchedulerConfig(engine.lr_scheduler, interval="step")]
            engine.lr_scheduler = None
        self.engine = engine
        self.optimizers = [zero_optimizer] if zero_optimizer is not None else []
        self.lr_scheduler_configs = scheduler_configs

    def _choose_windows(self, trainer, k: int) -> None:
        """Fit with k > 1: windows through train_batch, or the loop; one log line says which. (Lightning
        itself refuses k > 1 under manual optimization: there a script calls engine.train_batch.)"""
        if trainer.state.fn != TrainerFn.FITTING or self.window_size > 1:
            return
        self._warn_cpu_checkpointing_without_windows(k)
        if self.use_train_batch and any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):
            raise ValueError("ZeroStrategy(use_train_batch=True) takes one accumulate_grad_batches for the whole "
                             "fit; remove the GradientAccumulationScheduler callback")
        if k == 1:
            return
        if self.use_train_batch:
            self.window_size = k
            trainer.accumulate_grad_batches = 1  # each batch Lightning sees is a window (put back in teardown)
            how = "through engine.train_batch, unit-major (each unit's parameters read once per window)"
        else:
            how = "as Lightning's batch loop (ZeroStrategy(use_train_batch=True) runs them unit-major)"
        log_rank0(self.global_rank, f"[zero] ZeroStrategy runs each accumulation window of {k} batches {how}",
                  logging.INFO)

    def _warn_cpu_checkpointing_without_windows(self, k: int) -> None:
        section = self.config.get("activation_checkpointing")
        if not (isinstance(section, Mapping) and section.get("cpu_checkpointing") is True):
            return
        if self.use_train_batch and k > 1:
            return
        warnings.warn(f"activation_checkpointing.cpu_checkpointing has no effect here: it keeps the tensors an "
                      f"accumulation window saves for backward in host memory (past its budget on NVMe) when windows "
                      f"run through engine.train_batch, which takes ZeroStrategy(use_train_batch=True) and "
                      f"accumulate_grad_batches > 1 (this fit: use_train_batch={self.use_train_batch}, "
                      f"accumulate_grad_batches={k})", IgnoredSettingWarning, stacklevel=2)

    def process_dataloader(self, dataloader):
        trainer = self.lightning_module.trainer
        if self.window_size > 1 and trainer.state.stage == RunningStage.TRAINING:
            return WindowLoader(dataloader, self.window_size)
        return dataloader

    def teardown(self) -> None:
        if self.window_size > 1 and self.lightning_module is not None:
            self.lightning_module.trainer.accumulate_grad_batches = self.window_size
            self.window_size = 1
        super().teardown()

    def setup_optimizers(self, trainer) -> None:
        self.optimizers, self.lr_scheduler_configs = [], []  # made with the engine in setup

    def _setup_model(self, model):
        return model

    @property
    def handles_gradient_accumulation(self) -> bool:
        return False

    # -- the step -----------------------------------------------------------------------------------
    def training_step(self, *args, **kwargs):
        batch = args[0] if args else kwargs.get("batch")
        if not isinstance(batch, Window):
            return super().training_step(*args, **kwargs)
        return self._train_window(batch, *args[1:], **{k: v for k, v in kwargs.items() if k != "batch"})

    def _train_window(self, window: Window, *rest, **kwargs) -> torch.Tensor:
        """One window's micro-batches through the module's training_step, trained; their mean loss."""
        k, module = self.window_size, self.lightning_module
        idx = rest[0] if rest else kwargs.pop("batch_idx", None)
        more = tuple(rest[1:])

        def step_args(i: int) -> tuple:
            return (window[i],) + ((idx * k + i,) if idx is not None else ()) + more

        if len(window) < k:  # an epoch's end: the loop, each loss divided by k as Lightning divides it
            losses = []
            for i in range(len(window)):
                loss = _loss_in(super().training_step(*step_args(i), **kwargs))
                if i == len(window) - 1:
                    self.engine.set_gradient_accumulation_boundary(True)
                self.engine.backward(loss / k, scale_wrt_gas=False)
                self.engine.step()
                losses.append(loss.detach())
        else:
            losses = self.engine.train_batch_losses(list(range(k)),
                                   lambda i: _loss_in(module.training_step(*step_args(i), **kwargs)))
        self._window_trained = True
        return torch.stack([loss.reshape(()).float() for loss in losses]).mean()

    def backward(self, closure_loss: torch.Tensor, optimizer, *args, **kwargs) -> torch.Tensor:
        if self._window_trained:  # the window's backward and step are done (_train_window)
            self._window_trained = False
            return closure_loss
        if self._stepping and not self.engine.is_gradient_accumulation_boundary():
            self.engine.set_gradient_accumulation_boundary(True)  # Lightning steps after a window cut short
        self.engine.backward(closure_loss, scale_wrt_gas=False)
        self.engine.step()  # the optimizer steps at the end of each accumulation window
        return closure_loss

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        self._stepping = True  # Lightning steps the optimizer after this batch: so does the engine
        try:
            return closure()  # training_step and backward; the engine has stepped
        finally:
            self._stepping = False

    # -- checkpoints --------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> Dict[str, Any]:
        return {}  # the parameters are in the engine's checkpoint

    def optimizer_state(self, optimizer) -> Dict[str, Any]:
        return {}  # the optimizer states are in the engine's checkpoint

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("ZeroStrategy saves through the engine, without CheckpointIO: storage_options is "
                            "not supported")
        filepath = self.broadcast(os.fspath(filepath))
        if self.save_full_weights:  # one file (lightning_checkpoints.py)
            save_full_weights(self.lightning_module, checkpoint, filepath, self.global_rank,
                              self.exclude_frozen_parameters)
            return
        state = {k: v for k, v in checkpoint.items() if k not in EXCLUDED}
        self.engine.save_checkpoint(filepath, tag=CHECKPOINT_TAG, client_state=plain(state),
                                    exclude_frozen_parameters=self.exclude_frozen_parameters)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        path = self.broadcast(os.fspath(checkpoint_path))
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if self.load_full_weights and os.path.isfile(path):
            checkpoint = super().load_checkpoint(path, weights_only)
            if "state_dict" not in checkpoint:
                raise KeyError(f"{path} holds no 'state_dict': load_full_weights=True reads a Lightning checkpoint "
                               f"file (or one convert_zero_checkpoint_to_fp32_state_dict wrote)")
            self._full_weights_loaded = True
            if fitting:
                warnings.warn("ZeroStrategy(load_full_weights=True) loads the weights of a single file, which holds "
                              "no optimizer states: Adam's moments start again (resume from the checkpoint "
                              "directory to restore them)", UserWarning, stacklevel=2)
            return checkpoint
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path} is not a ZeroStrategy checkpoint directory (it holds 'latest' and "
                                    f"'{CHECKPOINT_TAG}/'); a single-file checkpoint loads with "
                                    "ZeroStrategy(load_full_weights=True) or LightningModule.load_from_checkpoint")
        _, client_state = self.engine.load_checkpoint(path, load_optimizer_states=fitting,
                                                      load_lr_scheduler_states=False,
                                                      load_module_strict=getattr(self.lightning_module, "strict_loading", True))
        return client_state

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine, which loads the checkpoint, exists after setup

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine restored the optimizer states

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._full_weights_loaded:  # a single file: into the engine's partitions
            self._full_weights_loaded = False
            load_full_state_dict(self.lightning_module, checkpoint["state_dict"], strict)
        return None  # else the engine restored the parameters with its checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        return None


ZeroStrategy.register_strategies(StrategyRegistry)

__all__ = ["ZeroStrategy"]
