"""Where states live: a rank's partition layout, the parameter and optimizer stores
(device, host memory, NVMe), the host-memory check, the memory estimator.

Implementation modules: the public names are in :mod:`zero`."""
