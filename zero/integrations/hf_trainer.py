"""``ZeroTrainer``: the Hugging Face Trainer on nvmeio's ZeRO engine (stages 0-3).

    from zero.hf import ZeroTrainer                          # or zero.integrations.hf_trainer
    trainer = ZeroTrainer(model=model, args=TrainingArguments(...), train_dataset=data,
                          zero_config="ds_config.json")     # was: Trainer(...), args with deepspeed=
    trainer.train()

The DeepSpeed config (a path or dict, ``"auto"`` values allowed) moves from
``TrainingArguments(deepspeed=...)`` to ``zero_config=``; everything else of a
Trainer script stays. Its ``zero_optimization.stage`` rules: HF's stage-2 and
stage-3 templates run unchanged. At stage 3 transformers sees ZeRO-3 while the
engine exists (``is_deepspeed_zero3_enabled()``, partitioning/hf_zero3.py), so
``generate`` syncs the ranks as under DeepSpeed; below it, it takes none of its
ZeRO-3 branches. ``save_model`` writes what the Trainer writes under DeepSpeed
(16-bit with ``stage3_gather_16bit_weights_on_model_save``, see its docstring);
``load_best_model_at_end`` loads the best checkpoint's engine checkpoint.
``ZeroSeq2SeqTrainer`` (hf_seq2seq.py) is the ``Seq2SeqTrainer`` on it. Tested
with transformers 5.17, 5.23 and 5.24 (accelerate 1.15).

[Note: where the engine enters the Trainer]
The Trainer's DeepSpeed path runs through accelerate's DeepSpeed plugin, which
needs the deepspeed package and reaches into its engine, so this subclass
takes the Trainer's plain path and changes it at its documented seams:
``create_optimizer`` builds the engine (the config's optimizer section, else
the Trainer's own AdamW and its weight-decay groups), ``create_scheduler``
gives the engine the config's scheduler or the Trainer's (the engine steps it,
after each real optimizer step, as DeepSpeed does), ``_wrap_model`` hands the
engine to the loop, and the accelerator's ``backward`` / ``clip_grad_norm_``
become the engine's backward + step / its gradient norm (the loss arrives
already divided as the Trainer divides it, so ``scale_wrt_gas=False``, like
HF does for DeepSpeed). The Trainer's ``optimizer`` and ``lr_scheduler`` are
then stand-ins whose ``step()`` does nothing. A window the loop cuts short (the
last of an epoch whose batches do not fill it) ends with a step, as the Trainer's
does (``engine.set_gradient_accumulation_boundary``). Checkpoints: the Trainer's
checkpoint folder holds the engine's checkpoint (``latest`` + tag folder,
parameters and optimizer states included) beside the consolidated model
weights that ``save_model`` writes for ``from_pretrained``. For a peft model, as
the Trainer does under DeepSpeed, the engine's checkpoint leaves the frozen base
out (``exclude_frozen_parameters=True``: the adapters and their optimizer states
alone) and is loaded with ``load_module_strict=False`` (the base keeps the
pretrained weights the model was built from).

[Note: the model stays where it was built]
The Trainer moves the whole model to ``args.device`` in ``__init__`` (and again
for ``model_init`` and fp16/bf16 full eval) unless it is "postponed":
``place_model_on_device`` is False for DeepSpeed, FSDP and model parallelism
(transformers' ``Trainer.__init__``). A model that needs offload would not fit
there, so ZeroTrainer postpones it as the Trainer does for DeepSpeed:
``_move_model_to_device`` does nothing and ``place_model_on_device`` reads
False. The engine built in ``create_optimizer`` takes the parameters from where
they are into its stores, computing on ``args.device`` (``use_cpu=True``: the
CPU); inputs go there as the Trainer sends them.

[Note: accumulation windows through train_batch]
With ``gradient_accumulation_steps`` k > 1 each window runs through
``engine.train_batch`` (unit-major: each unit's parameters read once for the k
forwards and once for the k backwards, not k times). The Trainer's loop fetches a
window's micro-batches up front (``get_batch_samples``), then calls
``training_step`` for each and steps at the last. ``get_batch_samples`` keeps the
window; the first ``training_step`` trains all of it, each micro-batch through
the Trainer's own ``training_step`` on the window's thread (``compute_loss``,
its loss normalisation by k or by ``num_items_in_batch``), its backward caught
(``_engine_backward``) and handed to the window with ``scale_wrt_gas=False``,
exactly as the loop hands it to ``engine.backward``; each ``training_step``
then returns its micro-batch's loss. The loop adds them, logs, reads the
gradient norm and calls the callbacks as before, so losses and weights are the
loop's bit for bit. The micro-batch loop runs instead for a window shorter than
k, when ``training_step`` is overridden (it must run per micro-batch), with
``use_train_batch=False``, and (train_batch's choice, one log line) for models
whose micro-batches take different paths or whose forward draws random numbers.
"""
from __future__ import annotations

import copy
import logging
import os
import threading
import warnings
from typing import List, Optional

import torch
import transformers
from transformers import Trainer


from ..checkpoint.model_file import fp32_state_dict
from ..config import IgnoredSettingWarning
from ..partitioning.full_state_dict import full_state_dict
from ..engine.entry import initialize
from ..partitioning.hf_hook import check_transformers_version
from .hf_trainer_config import read_config, resolve_for_trainer
from ..engine.lr_schedules import build_scheduler
from ..runtime.timers import log_rank0


def _is_peft_model(model) -> bool:
    """A peft model (LoRA and the like): the Trainer saves its DeepSpeed checkpoints without the frozen base."""
    try:
        import peft
    except ImportError:
        return False
    kinds = tuple(k for k in (getattr(peft, "PeftModel", None), getattr(peft, "PeftMixedModel", None)) if k)
    return isinstance(model, kinds)


class EngineStepsOptimizer:
    """The Trainer's ``optimizer``: the engine's param groups; ``step`` and ``zero_grad`` do nothing
    (the engine steps in backward, at the end of each accumulation window)."""

    def __init__(self, engine):
        self.engine = engine
        self.defaults = dict(engine.optimizer.defaults)
        self.state: dict = {}

    @property
    def param_groups(self):
        return self.engine.optimizer.param_groups

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict:
        return {}  # the engine's checkpoint holds the optimizer states

    def load_state_dict(self, state_dict: dict) -> None:
        return None


class EngineSteppedScheduler:
    """The Trainer's ``lr_scheduler``: reads the engine's scheduler, which the engine steps itself."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.lr_of_last_step = None  # the Trainer logs the lr of the step just taken

    def step(self, *args, **kwargs) -> None:
        return None

    def get_last_lr(self):
        return self.lr_of_last_step if self.lr_of_last_step is not None else self.scheduler.get_last_lr()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.scheduler.load_state_dict(state_dict)


class FetchedWindow:
    """The micro-batches ``get_batch_samples`` gave the loop for one window, and their losses once
    trained (see [Note: accumulation windows through train_batch])."""

    def __init__(self, batches: list, num_items_in_batch):
        self.batches = batches
        self.num_items_in_batch = num_items_in_batch
        self.losses: Optional[List[torch.Tensor]] = None
        self.handed = 0  # losses returned to the loop so far


class ZeroTrainer(Trainer):
    """``transformers.Trainer`` training through :func:`zero.initialize` (see the module docstring).

    ``zero_config``: the DeepSpeed config (path or dict) that would have gone
    to ``TrainingArguments(deepspeed=...)``; its ``"auto"`` values are filled
    from the TrainingArguments and the model as HF documents (hf_trainer_config.py).
    ``use_train_batch``: with gradient accumulation, run each window through
    ``engine.train_batch`` (the default) or, False, the micro-batch loop.
    """

    def __init__(self, *args, zero_config=None, use_train_batch: bool = True, **kwargs):
        if zero_config is None:
            raise TypeError("ZeroTrainer needs zero_config=: the DeepSpeed config (a JSON path or a dict) "
                            "that TrainingArguments(deepspeed=...) would take")
        check_transformers_version(transformers.__version__)
        self.zero_config = read_config(zero_config)
        self.zero_engine = None
        self.use_train_batch = use_train_batch
        self._window: Optional[FetchedWindow] = None
        self._caught = threading.local()  # a window thread's loss, caught at its backward
        super().__init__(*args, **kwargs)
        self.place_model_on_device = False  # what the Trainer decides for DeepSpeed (see the note)
        if self.args.deepspeed:
            raise ValueError("ZeroTrainer runs nvmeio's engine, not DeepSpeed: remove deepspeed= from the "
                             "TrainingArguments and pass that config as ZeroTrainer(zero_config=...)")
        if self.args.save_on_each_node:
            warnings.warn("TrainingArguments(save_on_each_node=True) has no effect on the engine's checkpoint: the "
                          "model files and the Trainer's state are written on each node, but the optimizer states "
                          "and parameter shards form one checkpoint across the nodes (each rank writes its own, "
                          "rank 0 publishes it), in an output_dir every node must see", IgnoredSettingWarning,
                          stacklevel=2)

    # -- the engine in place of the model and optimizer ---------------------------------------------
    def _move_model_to_device(self, model, device) -> None:
        """Nothing: the engine places the parameters (see [Note: the model stays where it was built])."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        self.accelerator.backward = self._engine_backward
        self.accelerator.clip_grad_norm_ = self._engine_grad_norm

    def create_optimizer(self, model=None):
        if self.zero_engine is None:
            self._build_engine()
        return self.optimizer

    def _build_engine(self) -> None:
        data = copy.deepcopy(self.zero_config)
        data.pop("scheduler", None)  # resolved in create_scheduler, once the step count is known
        config = resolve_for_trainer(data, self.args, self.model)
        trainer_optimizer = None
        if "optimizer" not in data:  # HF's rule: the Trainer's own optimizer (AdamW, weight-decay groups)
            self.optimizer = None
            trainer_optimizer = super().create_optimizer()
        engine, _, _, _ = initialize(model=self.model, config=config, optimizer=trainer_optimizer,
                                     compute_device=self.args.device)  # use_cpu=True: the CPU
        self.zero_engine = engine
        self.optimizer = EngineStepsOptimizer(engine)
        k = self.args.gradient_accumulation_steps
        if k > 1:
            how = ("through engine.train_batch, unit-major (each unit's parameters read once per window)"
                   if self._windows_wanted() else f"as a micro-batch loop ({self._why_loop()})")
            log_rank0(engine.comm.rank, f"[zero] ZeroTrainer runs each accumulation window of {k} micro-batches "
                      f"{how}", logging.INFO)

    def _windows_wanted(self) -> bool:
        return self._why_loop() is None

    def _why_loop(self) -> Optional[str]:
        if not self.use_train_batch:
            return "use_train_batch=False"
        if type(self).training_step is not ZeroTrainer.training_step:
            return "training_step is overridden, so it runs per micro-batch"
        return None

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        engine = self.zero_engine
        if engine is None:
            self.create_optimizer()
            engine = self.zero_engine
        if "scheduler" in self.zero_config:
            config = resolve_for_trainer(self.zero_config, self.args, self.model, num_training_steps)
            engine.lr_scheduler = build_scheduler(config.scheduler, engine.optimizer)
        else:
            self.lr_scheduler = None
            super().create_scheduler(num_training_steps, optimizer=engine.optimizer)
            engine.lr_scheduler = self.lr_scheduler
        self.lr_scheduler = EngineSteppedScheduler(engine.lr_scheduler)
        return self.lr_scheduler

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if self.zero_engine is None:
            self.create_optimizer()
        return self.zero_engine

    # -- a window through train_batch (see [Note: accumulation windows through train_batch]) -----------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        k = self.args.gradient_accumulation_steps
        whole = k > 1 and len(batches) == k and self._windows_wanted()
        self._window = FetchedWindow(batches, num_items_in_batch) if whole else None
        return batches, num_items_in_batch

    def training_step(self, model, inputs, num_items_in_batch=None):
        window = self._window
        if window is None or model is not self.zero_engine:
            return super().training_step(model, inputs, num_items_in_batch)
        if window.losses is None:
            if inputs is not window.batches[0]:  # not the loop that fetched it: train this one alone
                self._window = None
                return super().training_step(model, inputs, num_items_in_batch)
            window.losses = self._train_window(model, window)
        i = window.handed
        if inputs is not window.batches[i]:
            raise RuntimeError(f"ZeroTrainer trained this accumulation window through engine.train_batch, but the "
                               f"loop's micro-batch {i + 1} is not the one get_batch_samples gave it; pass "
                               f"use_train_batch=False to train micro-batch by micro-batch")
        window.handed += 1
        if window.handed == len(window.batches):
            self._window = None
        return window.losses[i]

    def _train_window(self, model, window: FetchedWindow) -> List[torch.Tensor]:
        """Each micro-batch's loss as the Trainer's ``training_step`` returns it; the window trained."""
        if isinstance(self.lr_scheduler, EngineSteppedScheduler):
            self.lr_scheduler.lr_of_last_step = self.zero_engine.get_lr()  # the lr this window steps with
        returned = {}

        def loss_of(i: int) -> torch.Tensor:
            self._caught.loss, self._caught.catching = None, True
            try:
                returned[i] = super(ZeroTrainer, self).training_step(model, window.batches[i],
                                                                     window.num_items_in_batch)
            finally:
                self._caught.catching = False
            return self._caught.loss

        self.zero_engine.train_batch_losses(list(range(len(window.batches))), loss_of, scale_wrt_gas=False)
        return [returned[i] for i in range(len(window.batches))]

    # -- the loop's backward and gradient norm -----------------------------------------------------
    def _engine_backward(self, loss: torch.Tensor, **kwargs) -> None:
        loss = loss / self.accelerator.gradient_accumulation_steps  # as accelerate's backward does
        if getattr(self._caught, "catching", False):  # a window's micro-batch: the window runs backward
            self._caught.loss = loss
            return
        engine = self.zero_engine
        if self.accelerator.sync_gradients and not engine.is_gradient_accumulation_boundary():
            engine.set_gradient_accumulation_boundary(True)  # the loop steps after a window cut short
        engine.backward(loss, retain_graph=kwargs.get("retain_graph", False), scale_wrt_gas=False)
        if engine.is_gradient_accumulation_boundary() and isinstance(self.lr_scheduler, EngineSteppedScheduler):
            self.lr_scheduler.lr_of_last_step = engine.get_lr()
        engine.step()

    def _engine_grad_norm(self, parameters, max_norm, norm_type=2, **kwargs):
        norm = self.zero_engine.get_global_grad_norm() if self.zero_engine is not None else None
        return None if norm is None else torch.as_tensor(float(norm))

    # -- checkpoints ---------------------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.zero_engine.save_checkpoint(output_dir, exclude_frozen_parameters=_is_peft_model(self.model))

    def _load_engine_checkpoint(self, checkpoint: str) -> None:
        self.zero_engine.load_checkpoint(checkpoint, load_module_strict=not _is_peft_model(self.model))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # The weights come back with the engine's checkpoint, in _load_optimizer_and_scheduler.
        if not os.path.isfile(os.path.join(resume_from_checkpoint, "latest")):
            raise ValueError(f"{resume_from_checkpoint} holds no engine checkpoint (no 'latest' file): "
                             "resume from a checkpoint folder that ZeroTrainer saved")

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is not None:
            self._load_engine_checkpoint(checkpoint)

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint folder's engine checkpoint (weights, optimizer and
        scheduler states), as the Trainer loads DeepSpeed's."""
        if self.zero_engine is None:
            return super()._load_best_model()
        log_rank0(self.zero_engine.comm.rank, f"[zero] loading the best model from {self.state.best_model_checkpoint} "
                  f"(score: {self.state.best_metric})", logging.INFO)
        self._load_engine_checkpoint(self.state.best_model_checkpoint)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """The whole model for ``from_pretrained``, as the Trainer writes it under DeepSpeed (every rank
        gathers; the main process writes). At stage 3 with ``stage3_gather_16bit_weights_on_model_save``:
        the parameters in the compute dtype, 16-bit with fp16 / bf16 (DeepSpeed's ``save_16bit_model``);
        at stage 3 without it: fp32 from the master weights (where DeepSpeed writes an engine checkpoint
        for ``zero_to_fp32`` instead of weights); below stage 3: the parameters every rank holds, in the
        compute dtype, as DeepSpeed does. At stage 3 a peft model's frozen base is left out (never
        gathered), as the Trainer does, peft saving the adapters; below it the parameters are whole
        anyway, and peft may want a frozen one (an embedding it saves with a resized vocabulary)."""
        if self.zero_engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        zc = self.zero_engine.config.zero_optimization
        adapters = zc.stage == 3 and _is_peft_model(self.model)
        if zc.stage == 3 and not zc.stage3_gather_16bit_weights_on_model_save:
            state = fp32_state_dict(self.zero_engine, exclude_frozen=adapters)
        else:
            state = full_state_dict(self.model, exclude_frozen=adapters)
        if self.args.should_save:
            self._save(output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
