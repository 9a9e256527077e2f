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
``ZeroTrainer`` is the Trainer on this engine and ``ZeroSeq2SeqTrainer`` the
``Seq2SeqTrainer`` (``predict_with_generate``) on it (imported on first use:
they need accelerate); ``resolve_for_trainer`` fills a config's ``"auto"``
values from ``TrainingArguments``. While an ``HfDeepSpeedConfig`` of stage 3
lives, a ``zero.Init`` is open or a stage-3 engine exists, transformers sees
ZeRO-3 (``transformers.integrations.is_deepspeed_zero3_enabled()``) and takes
its DeepSpeed branches on this engine: ``generate`` syncs the ranks, embeddings
resize gathered, and ``from_config`` builds partitioned with the values it
gives without ZeRO. Tested with transformers 5.x (5.23, 5.24); other major
versions are refused.
"""

from typing import TYPE_CHECKING

from .integrations.hf_config import HfDeepSpeedConfig
from .partitioning.hf_hook import check_transformers_version

if TYPE_CHECKING:  # imported on first use by __getattr__ below; named here for tools
    from .integrations.hf_seq2seq import ZeroSeq2SeqTrainer
    from .integrations.hf_trainer import ZeroTrainer
    from .integrations.hf_trainer_config import resolve_for_trainer

__all__ = ["HfDeepSpeedConfig", "ZeroSeq2SeqTrainer", "ZeroTrainer", "check_transformers_version",
           "resolve_for_trainer"]


def __getattr__(name):
    if name == "ZeroTrainer":  # the Trainer imports accelerate: only when asked
        from .integrations.hf_trainer import ZeroTrainer

        return ZeroTrainer
    if name == "ZeroSeq2SeqTrainer":
        from .integrations.hf_seq2seq import ZeroSeq2SeqTrainer

        return ZeroSeq2SeqTrainer
    if name == "resolve_for_trainer":
        from .integrations.hf_trainer_config import resolve_for_trainer

        return resolve_for_trainer
    raise AttributeError(f"module 'zero.hf' has no attribute {name!r}")
