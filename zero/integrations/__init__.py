"""Framework integrations: Hugging Face (``HfDeepSpeedConfig``, ``ZeroTrainer``) and
Lightning (``ZeroStrategy``).

Implementation modules: the public names are in :mod:`zero.hf` and :mod:`zero.lightning`."""
