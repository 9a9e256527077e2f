"""The engine core: ``zero.initialize``, building the engine's parts, the engine's API,
the offloaded optimizer, loss scaling and learning-rate schedules.

Implementation modules: the public names are in :mod:`zero`."""
