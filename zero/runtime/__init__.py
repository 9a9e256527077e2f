"""The runtime of units: ranks' collectives, units and their states, the module hooks
that gather before use and release after, the prefetch policy, gradient reduction and
its stash, the memory-efficient linear, step timers.

Implementation modules: the public names are in :mod:`zero`."""
