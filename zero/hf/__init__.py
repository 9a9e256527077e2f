"""Hugging Face integration (``pip install "nvmeio[hf]"``): :class:`ZeroTrainer`.

Imported only when asked for (``from zero.hf import ZeroTrainer``): ``import
zero`` never imports transformers.
"""
from .trainer import ZeroTrainer
from .trainer_config import resolve_for_trainer

__all__ = ["ZeroTrainer", "resolve_for_trainer"]
