"""``zero.Init`` (a model built partitioned), its hooks into transformers' ``from_pretrained``,
``from_config`` and weight initialisation, what tells transformers that ZeRO-3 is on (and the
``deepspeed`` stand-in it then imports), ``GatheredParameters`` and full state dicts.

Implementation modules: the public names are in :mod:`zero`."""
