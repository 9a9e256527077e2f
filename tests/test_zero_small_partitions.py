"""``offload_param.min_swap_bytes`` (zero/config/offload.py): a parameter partition under it stays
in host memory, never on NVMe, as DeepSpeed's swapper does with those under max(1 MiB,
``aio.block_size``). A LoRA model's adapters and layer norms are such partitions: a step then
neither writes them to NVMe nor reads them back."""
import copy
import dataclasses
import os

import pytest
import torch

import zero
from helpers import base_config, make_engine, train_engine
from swapper import PartitionedParamSwapper
from swapper._param_swapper import PartitionState
from zero.config import ConfigError, load_config
from zero.config.offload import MIN_SWAP_BYTES, min_swap_bytes
from zero.examples import GPT, GPTConfig, add_lora, make_batches, train_reference
from zero.stores.rank_memory import RankSizes, rank_memory_parts

# The embedding (vocab x d_model: 1.5 MiB fp32) and the fc/out weights (2 MiB) go to NVMe, the
# rest (attention weights 0.5-1.5 MiB, biases, layer norms, adapters) stays in host memory.
CFG = GPTConfig(vocab=1536, d_model=256, heads=4, layers=2, seq=16)


def test_the_swapper_keeps_a_partition_under_min_swap_bytes_in_host_memory(tmp_path, swappers):
    s = swappers(PartitionedParamSwapper(tmp_path, {"queue_depth": 8}, buffer_count=2, buffer_size=2048,
                                         max_in_cpu=2000, min_swap_bytes=4096))
    assert s.register("budget", 2000) is PartitionState.IN_CPU  # max_in_cpu's 2000 elements
    assert s.register("small", 1023) is PartitionState.IN_CPU  # 4092 bytes, beside max_in_cpu's
    assert s.register("large", 1024) is PartitionState.UNWRITTEN  # 4096 bytes: NVMe
    assert (s.small_numel, s.cpu_numel, s.nvme_bytes) == (1023, 2000, 4096)
    values = torch.arange(1023, dtype=torch.float32)
    s.swap_out_tensors(["small"], [values])
    s.synchronize()
    assert not os.path.exists(s.swap_dir.file("param_small.swp"))
    assert torch.equal(s.swap_in(["small"])[0], values)
    s.remove(["small"])
    assert (s.small_numel, s.cpu_numel) == (0, 2000)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="min_swap_bytes must be a non-negative int"):
            PartitionedParamSwapper(tmp_path / "x", buffer_count=1, buffer_size=16, min_swap_bytes=bad)


def test_the_default_is_deepspeeds_rule_and_the_key_is_checked(tmp_path):
    def section(**param):
        config = {"zero_optimization": {"stage": 3, "offload_param": {
            "device": "nvme", "nvme_path": str(tmp_path), **param}}}
        return load_config(config).zero_optimization.offload_param

    assert min_swap_bytes(section(), 1 << 20) == MIN_SWAP_BYTES == 1 << 20
    assert min_swap_bytes(section(), 8 << 20) == 8 << 20  # never an op smaller than a block
    assert min_swap_bytes(section(min_swap_bytes=0), 8 << 20) == 0
    assert min_swap_bytes(section(min_swap_bytes=1e4), 1 << 20) == 10_000
    with pytest.raises(ConfigError, match="offload_param.min_swap_bytes"):
        section(min_swap_bytes=-1)


def _config(tmp_path, **param):
    config = base_config("nvme", "cpu", tmp_path, lr=1e-2, micro=2)
    param_section = config["zero_optimization"]["offload_param"]
    del param_section["min_swap_bytes"]  # the tests' helpers put every partition on NVMe; not here
    param_section.update(param)
    return config


def test_small_partitions_never_touch_nvme_and_training_is_exact(tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    reference = copy.deepcopy(model)
    batches = make_batches(dataclasses.replace(CFG), 3, 2)
    engine, _, _, _ = zero.initialize(model=model, config=_config(tmp_path))
    try:
        swapper = engine.parts.param_store.swapper
        small = [u for u in engine.parts.rank_layout.units if u.shard_numel * 4 < MIN_SWAP_BYTES]
        large = [u for u in engine.parts.rank_layout.units if u.shard_numel * 4 >= MIN_SWAP_BYTES]
        assert small and large
        ids = engine.parts.param_store._ids
        assert all(swapper.state(ids[u.index]) is PartitionState.IN_CPU for u in small)
        assert swapper.small_numel == sum(u.shard_numel for u in small)
        assert swapper.nvme_bytes == sum(u.shard_numel for u in large) * 4
        read0 = swapper.io_bytes.read
        losses = train_engine(engine, batches, 3)
        names = set(os.listdir(swapper.swap_dir.path))
        assert {f"param_{ids[u.index]}.swp" for u in large} <= names
        assert not {f"param_{ids[u.index]}.swp" for u in small} & names
        assert swapper.io_bytes.read - read0 >= 3 * swapper.nvme_bytes  # the large ones are read each step
        assert losses == train_reference(reference, batches, 3, lr=1e-2)
    finally:
        engine.destroy()


def test_a_lora_step_moves_no_adapter_bytes_through_nvme(tmp_path):
    torch.manual_seed(0)
    model = add_lora(GPT(CFG), rank=4)
    engine, _, _, _ = zero.initialize(model=model, config=_config(tmp_path))
    try:
        batches = make_batches(dataclasses.replace(CFG), 3, 2)
        train_engine(engine, batches[:1], 1)
        swapper = engine.parts.param_store.swapper
        written = swapper.io_bytes.written
        train_engine(engine, batches[1:], 2)
        assert swapper.io_bytes.written == written  # frozen base not rewritten, adapters in host memory
    finally:
        engine.destroy()


def test_every_partition_on_nvme_with_zero(tmp_path):
    torch.manual_seed(0)
    engine, _, _, _ = zero.initialize(model=GPT(CFG), config=_config(tmp_path, min_swap_bytes=0))
    try:
        swapper = engine.parts.param_store.swapper
        assert swapper.small_numel == 0
        assert swapper.nvme_bytes == engine.parts.rank_layout.numel * 4
    finally:
        engine.destroy()


def test_the_memory_model_counts_small_partitions_in_host_memory(tmp_path):
    torch.manual_seed(0)
    engine, _, _, _ = zero.initialize(model=GPT(CFG), config=_config(tmp_path))
    try:
        layout = engine.parts.rank_layout
        small = sum(u.shard_numel for u in layout.units if u.shard_numel * 4 < MIN_SWAP_BYTES)
        sizes = RankSizes.of_layout(layout, MIN_SWAP_BYTES // 4)
        assert sizes.small_shards == small == engine.parts.param_store.swapper.small_numel
        section = engine.config.zero_optimization
        parts = {p.what: p for p in rank_memory_parts(
            sizes, stage=3, offload_param=section.offload_param, offload_optimizer=section.offload_optimizer,
            itemsize=4, compute_device="cpu")}
        kept = parts["parameter partitions too small for NVMe kept in host memory (min_swap_bytes)"]
        assert kept.nbytes == small * 4 and kept.setting == "zero_optimization.offload_param.min_swap_bytes"
        assert parts["parameter swap files"].nbytes == (layout.numel - small) * 4
    finally:
        engine.destroy()


@pytest.mark.parametrize("precision,smallest", [("fp32", None), ("bf16", 1 << 19)])
def test_a_checkpoint_of_small_and_large_partitions_resumes_exactly(tmp_path, precision, smallest):
    """fp32 with the optimizer on NVMe stores the large partitions in the master's file (homed),
    bf16 in their own (half the bytes: a lower min_swap_bytes keeps some of them on NVMe): either
    way the small ones, in host memory, save and load with them."""
    settings = dict(precision=precision, lr=1e-2, micro=2, model=lambda: GPT(CFG),
                    overrides={"zero_optimization": {"offload_param": {"min_swap_bytes": smallest}}})
    batches = make_batches(dataclasses.replace(CFG), 4, 2)
    engine = make_engine(tmp_path / "swap", "nvme", **settings)
    try:
        assert 0 < engine.parts.param_store.swapper.small_numel < engine.parts.rank_layout.numel
        train_engine(engine, batches[:2], 2)
        engine.save_checkpoint(tmp_path / "ckpt")
        expected = train_engine(engine, batches[2:], 2)
    finally:
        engine.destroy()
    resumed = make_engine(tmp_path / "swap", "nvme", seed=1, **settings)
    try:
        resumed.load_checkpoint(tmp_path / "ckpt")
        assert train_engine(resumed, batches[2:], 2) == expected
    finally:
        resumed.destroy()


def test_a_model_built_under_zero_init_on_nvme_takes_the_same_split(tmp_path):
    """zero.Init writes every slice to NVMe as the model is built; the engine then keeps the small
    partitions in host memory and trains as plain PyTorch does."""
    torch.manual_seed(0)
    reference = GPT(CFG)
    config = _config(tmp_path)
    torch.manual_seed(0)
    with zero.Init(config_dict_or_path=config):
        model = GPT(CFG)
    engine, _, _, _ = zero.initialize(model=model, config=config)
    try:
        swapper = engine.parts.param_store.swapper
        assert 0 < swapper.small_numel < engine.parts.rank_layout.numel
        batches = make_batches(dataclasses.replace(CFG), 2, 2)
        assert train_engine(engine, batches, 2) == train_reference(reference, batches, 2, lr=1e-2)
    finally:
        engine.destroy()
