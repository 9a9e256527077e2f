"""Hugging Face on this engine (``pip install "nvmeio[hf]"``). ``from_pretrained`` under
:class:`zero.Init`: weights go straight into partitions. Two shapes, as DeepSpeed users
know them::

    with zero.Init(config_dict_or_path=ds_config):            # any model class, any config
        model = AutoModelForCausalLM.from_pretrained(path)

    from zero.hf import HfDeepSpeedConfig
    dschf = HfDeepSpeedConfig(ds_config)                      # keep this object alive
    model = AutoModelForCausalLM.from_pretrained(path)        # built and loaded under zero.Init

Either way each parameter is partitioned (to NVMe with ``offload_param.device:
nvme``) as its checkpoint tensor arrives, so the model is never whole in
memory; then ``zero.initialize(model=model, config=ds_config)``.
``ZeroTrainer`` is the Trainer on this engine (imported on first use: it needs
accelerate); ``resolve_for_trainer`` fills a config's ``"auto"`` values from
``TrainingArguments``. Tested with transformers 5.x (5.23); other major
versions are refused.
"""

from typing import TYPE_CHECKING

from .integrations.hf_config import HfDeepSpeedConfig
from .partitioning.hf_hook import check_transformers_version

if TYPE_CHECKING:  # imported on first use by __getattr__ below; named here for tools
    from .integrations.hf_trainer import ZeroTrainer
    from .integrations.hf_trainer_config import resolve_for_trainer

__all__ = ["HfDeepSpeedConfig", "ZeroTrainer", "check_transformers_version", "resolve_for_trainer"]


def __getattr__(name):
    if name == "ZeroTrainer":  # the Trainer imports accelerate: only when asked
        from .integrations.hf_trainer import ZeroTrainer

        return ZeroTrainer
    if name == "resolve_for_trainer":
        from .integrations.hf_trainer_config import resolve_for_trainer

        return resolve_for_trainer
    raise AttributeError(f"module 'zero.hf' has no attribute {name!r}")
