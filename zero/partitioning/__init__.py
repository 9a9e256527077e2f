"""``zero.Init`` (a model built partitioned), its hook into transformers'
``from_pretrained``, ``GatheredParameters`` and full state dicts.

Implementation modules: the public names are in :mod:`zero`."""
