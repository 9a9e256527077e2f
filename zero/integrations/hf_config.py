"""``HfDeepSpeedConfig``: while it lives, transformers' ``from_pretrained`` runs under
``zero.Init`` with its config (the hook is partitioning/hf_hook.py)."""
from __future__ import annotations

from typing import Optional

from ..partitioning.hf_hook import check_transformers_version, install, live_config, set_live_config
from ..partitioning.init_context import Init


class HfDeepSpeedConfig:
    """While this object is alive, ``from_pretrained`` of any transformers model runs under
    ``zero.Init(config_dict_or_path=config)`` (stage 3 configs; below stage 3 models load whole, as
    with DeepSpeed: ``is_zero3()`` is False).

    The equivalent of ``transformers.integrations.HfDeepSpeedConfig`` for this
    engine; keep a reference to it for as long as models are loaded.
    """

    def __init__(self, config_file_or_dict):
        from ..config import load_config

        self.config = config_file_or_dict
        self.loaded = load_config(config_file_or_dict)
        import transformers

        check_transformers_version(transformers.__version__)
        install()
        set_live_config(self)

    def is_zero3(self) -> bool:
        return self.loaded.zero_optimization.stage == 3

    def new_context(self) -> Init:
        return Init(config_dict_or_path=self.config)


def live_hf_config() -> Optional[HfDeepSpeedConfig]:
    """The live :class:`HfDeepSpeedConfig`, if any."""
    return live_config()
