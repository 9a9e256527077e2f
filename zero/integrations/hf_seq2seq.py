"""``ZeroSeq2SeqTrainer``: transformers' ``Seq2SeqTrainer`` on this engine.

    from zero.hf import ZeroSeq2SeqTrainer
    trainer = ZeroSeq2SeqTrainer(model=model, args=Seq2SeqTrainingArguments(..., predict_with_generate=True),
                                 train_dataset=train, eval_dataset=dev, zero_config="ds_config.json")
    trainer.train(); trainer.predict(test)          # evaluate / predict generate with the engine's model

It is :class:`~zero.integrations.hf_trainer.ZeroTrainer` (training, checkpoints, ``save_model``)
with ``Seq2SeqTrainer``'s evaluation and prediction: ``predict_with_generate``, the generation
arguments (``generation_max_length``, ``generation_num_beams``, ``generation_config``) and
``gen_kwargs`` passed to ``evaluate`` / ``predict``. At stage 3 each rank holds a slice of every
weight, so every forward is collective; transformers sees ZeRO-3 while the engine exists
(partitioning/hf_zero3.py), so ``generate`` defaults to ``synced_gpus=True`` as it does under
DeepSpeed: a rank whose sequences end first keeps running forward passes with the others until all
have ended, instead of leaving them waiting in a gather.
"""
from __future__ import annotations

from transformers import Seq2SeqTrainer

from .hf_trainer import ZeroTrainer


class ZeroSeq2SeqTrainer(ZeroTrainer, Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` training and generating through :func:`zero.initialize` (see
    the module docstring); takes ``ZeroTrainer``'s ``zero_config`` and ``use_train_batch``."""
