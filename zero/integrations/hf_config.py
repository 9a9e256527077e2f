"""``HfDeepSpeedConfig``: while it lives, transformers' ``from_pretrained`` and ``from_config`` run
under ``zero.Init`` with its config (the hooks are partitioning/hf_hook.py) and transformers sees
ZeRO-3 (partitioning/hf_zero3.py), as with DeepSpeed's."""
from __future__ import annotations

import functools

from ..partitioning import hf_zero3
from ..partitioning.hf_hook import check_transformers_version, install
from ..partitioning.init_context import Init
from .hf_trainer_config import read_config


class HfDeepSpeedConfig:
    """While this object is alive, ``from_pretrained`` and ``from_config`` of any transformers model run
    under ``zero.Init(config_dict_or_path=config)`` and ``transformers.integrations.
    is_deepspeed_zero3_enabled()`` is True (stage 3 configs; below stage 3 models build whole and it
    stays False, as with DeepSpeed: ``is_zero3()`` is False).

    The equivalent of ``transformers.integrations.HfDeepSpeedConfig`` for this
    engine; keep a reference to it for as long as models are loaded. ``config`` is
    the config as a dict (read from the file when given a path), as transformers'
    ``deepspeed_config()`` returns it.
    """

    def __init__(self, config_file_or_dict):
        from ..config import load_config

        self.config = read_config(config_file_or_dict)
        self.loaded = load_config(self.config)
        import transformers

        check_transformers_version(transformers.__version__)
        install()
        # Held here only: when this object goes, its source goes with it (no cycle keeps it).
        self._source = hf_zero3.Zero3Source(
            "HfDeepSpeedConfig", self.config, open_init=functools.partial(Init, config_dict_or_path=self.config)
        ) if self.is_zero3() else None
        if self._source is not None:
            hf_zero3.activate(self._source)

    def is_zero3(self) -> bool:
        return self.loaded.zero_optimization.stage == 3

    def new_context(self) -> Init:
        return Init(config_dict_or_path=self.config)
