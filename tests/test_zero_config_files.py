"""The three real-world DeepSpeed configs (copies of the project's shared/configs in
tests/data) load unchanged, with only nvme_path pointed at a temporary directory."""

import json
import pathlib
import warnings

import pytest

from zero.config import ConfigDeprecationWarning, load_config, resolve_auto

DATA = pathlib.Path(__file__).resolve().parent / "data"
NAMES = ("ds_config_zero3_cpu_auto.json", "ds_config_zero3_manual_fp16.json",
         "ds_config_zero3_nvme.json")
FILES = {name: (DATA / name).read_text() for name in NAMES}


def write(tmp_path, name):
    """The config copied into tmp_path, its nvme_path pointing at a tmp dir."""
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    path = tmp_path / name
    path.write_text(FILES[name].replace('"/local_nvme"', json.dumps(str(nvme))))
    return path, nvme


def test_manual_fp16_config_loads(tmp_path):
    path, _ = write(tmp_path, "ds_config_zero3_manual_fp16.json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = load_config(path)
    # Nothing deprecated in this file, and every key it sets takes effect (reduce_bucket_size
    # bounds the gradient reductions in flight).
    assert [str(w.message) for w in caught] == []
    zero = config.zero_optimization
    assert zero.stage == 3
    assert zero.offload_param.device == "cpu" and zero.offload_param.pin_memory is True
    assert zero.offload_optimizer.device == "cpu"
    assert zero.sub_group_size == 10**9 and type(zero.sub_group_size) is int
    assert zero.stage3_prefetch_bucket_size == 940_000 and type(zero.stage3_prefetch_bucket_size) is int
    assert zero.stage3_param_persistence_threshold == 10**4
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    assert config.precision == "fp16" and config.fp16.dynamic_loss_scale
    assert config.fp16.initial_loss_scale == 2.0 ** 16
    assert config.optimizer.type == "AdamW" and config.optimizer.params.betas == (0.8, 0.999)
    assert config.scheduler.type == "WarmupLR" and config.scheduler.params.warmup_num_steps == 500
    # no batch size in the file: the data loader decides, one accumulation step
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps) == (None, None, 1)
    assert config.unresolved_autos() == []


def test_nvme_config_loads_with_nvme_path_overridden(tmp_path):
    path, nvme = write(tmp_path, "ds_config_zero3_nvme.json")
    with pytest.warns(ConfigDeprecationWarning, match=r"aio\.thread_count.*aio\.intra_op_parallelism"):
        config = load_config(path)
    zero = config.zero_optimization
    assert zero.offload_param.device == "nvme" and zero.offload_param.nvme_path == str(nvme)
    assert zero.offload_optimizer.device == "nvme" and zero.offload_optimizer.nvme_path == str(nvme)
    assert zero.offload_param.buffer_size == 10**8 and type(zero.offload_param.buffer_size) is int
    assert zero.offload_param.max_in_cpu == 10**9
    # aio given inside zero_optimization is what the engine reads at config.aio
    assert config.aio.block_size == 262144 and config.aio.queue_depth == 32
    assert config.aio.intra_op_parallelism == 1 and config.aio.overlap_events is True
    assert config.aio == zero.aio
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps) == (4, 4, 1)
    assert config.gradient_clipping == 1.0 and config.precision == "fp32"


def test_cpu_auto_config_loads_and_resolves(tmp_path):
    path, _ = write(tmp_path, "ds_config_zero3_cpu_auto.json")
    hidden, world = 1024, 2
    config = load_config(path, world_size=world, hidden_size=hidden)
    assert config.zero_optimization.reduce_bucket_size == hidden * hidden
    config = resolve_auto(config, world_size=world, lr=3e-5, betas=(0.9, 0.999), eps=1e-8,
                          weight_decay=0.0, warmup_min_lr=0.0, warmup_num_steps=100, fp16=True,
                          gradient_clipping=1.0, train_micro_batch_size_per_gpu=2,
                          gradient_accumulation_steps=4)
    assert config.unresolved_autos() == []
    assert config.train_batch_size == 2 * 4 * world
    assert config.scheduler.params.warmup_max_lr == 3e-5  # the lr, as Hugging Face does
    assert config.precision == "fp16"
