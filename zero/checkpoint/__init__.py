"""Engine checkpoints (save, load, the publish protocol, the on-disk format, shard
files), consolidation to one fp32 state dict, and pretrained model files
(safetensors / torch) into partitions.

Implementation modules: the public names are in :mod:`zero` and :mod:`zero.zero_to_fp32`."""
