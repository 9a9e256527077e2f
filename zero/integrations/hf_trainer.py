"""``ZeroTrainer``: the Hugging Face Trainer on nvmeio's ZeRO-3 engine.

    from zero.hf import ZeroTrainer                          # or zero.integrations.hf_trainer
    trainer = ZeroTrainer(model=model, args=TrainingArguments(...), train_dataset=data,
                          zero_config="ds_config.json")     # was: Trainer(...), args with deepspeed=
    trainer.train()

The DeepSpeed config (a path or dict, ``"auto"`` values allowed) moves from
``TrainingArguments(deepspeed=...)`` to ``zero_config=``; everything else of a
Trainer script stays. Tested with transformers 5.23 (accelerate 1.15).

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
then stand-ins whose ``step()`` does nothing. Checkpoints: the Trainer's
checkpoint folder holds the engine's checkpoint (``latest`` + tag folder,
parameters and optimizer states included) beside the consolidated model
weights that ``save_model`` writes for ``from_pretrained``.
"""
from __future__ import annotations

import copy
import os
from typing import Optional

import torch
import transformers
from transformers import Trainer


from ..partitioning.full_state_dict import full_state_dict
from ..engine.entry import initialize
from ..partitioning.hf_hook import check_transformers_version
from .hf_trainer_config import read_config, resolve_for_trainer
from ..engine.lr_schedules import build_scheduler


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


class ZeroTrainer(Trainer):
    """``transformers.Trainer`` training through :func:`zero.initialize` (see the module docstring).

    ``zero_config``: the DeepSpeed config (path or dict) that would have gone
    to ``TrainingArguments(deepspeed=...)``; its ``"auto"`` values are filled
    from the TrainingArguments and the model as HF documents (hf_trainer_config.py).
    """

    def __init__(self, *args, zero_config=None, **kwargs):
        if zero_config is None:
            raise TypeError("ZeroTrainer needs zero_config=: the DeepSpeed config (a JSON path or a dict) "
                            "that TrainingArguments(deepspeed=...) would take")
        check_transformers_version(transformers.__version__)
        self.zero_config = read_config(zero_config)
        self.zero_engine = None
        super().__init__(*args, **kwargs)
        if self.args.deepspeed:
            raise ValueError("ZeroTrainer runs nvmeio's engine, not DeepSpeed: remove deepspeed= from the "
                             "TrainingArguments and pass that config as ZeroTrainer(zero_config=...)")

    # -- the engine in place of the model and optimizer ---------------------------------------------
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
        engine, _, _, _ = initialize(model=self.model, config=config, optimizer=trainer_optimizer)
        self.zero_engine = engine
        self.optimizer = EngineStepsOptimizer(engine)

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

    def _engine_backward(self, loss: torch.Tensor, **kwargs) -> None:
        loss = loss / self.accelerator.gradient_accumulation_steps  # as accelerate's backward does
        engine = self.zero_engine
        engine.backward(loss, retain_graph=kwargs.get("retain_graph", False), scale_wrt_gas=False)
        if engine.is_gradient_accumulation_boundary() and isinstance(self.lr_scheduler, EngineSteppedScheduler):
            self.lr_scheduler.lr_of_last_step = engine.get_lr()
        engine.step()

    def _engine_grad_norm(self, parameters, max_norm, norm_type=2, **kwargs):
        norm = self.zero_engine.get_global_grad_norm() if self.zero_engine is not None else None
        return None if norm is None else torch.as_tensor(float(norm))

    # -- checkpoints ---------------------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.zero_engine.save_checkpoint(output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # The weights come back with the engine's checkpoint, in _load_optimizer_and_scheduler.
        if not os.path.isfile(os.path.join(resume_from_checkpoint, "latest")):
            raise ValueError(f"{resume_from_checkpoint} holds no engine checkpoint (no 'latest' file): "
                             "resume from a checkpoint folder that ZeroTrainer saved")

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is not None:
            self.zero_engine.load_checkpoint(checkpoint)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """The consolidated fp32 weights, as ``save_pretrained`` writes them (every rank gathers)."""
        if self.zero_engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = full_state_dict(self.model)
        if self.args.should_save:
            self._save(output_dir, state_dict=state)
