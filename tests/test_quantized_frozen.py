"""zero_quantized_nontrainable_weights: frozen units stored int8 + fp32 group scales (zero/stores/quantized.py)."""
import logging
import os

import pytest
import torch

import zero
from helpers import (RecordingBackend, base_config, dequantized_base, make_engine, same_weights, train_engine,
                     weights)
from zero.checkpoint.consolidate import get_fp32_state_dict_from_zero_checkpoint
from zero.examples import GPT, GPTConfig, add_lora, make_batches, relative_error
from zero.stores.quantized import (GROUP_SIZE, QMAX, dequantize, pack, packed_nbytes, quantize,
                                   unpack)

CFG = GPTConfig(vocab=64, d_model=64, heads=4, layers=2, seq=16)
FLAG = {"zero_optimization": {"zero_quantized_nontrainable_weights": True}}


def lora_gpt() -> torch.nn.Module:
    return add_lora(GPT(CFG), rank=2)


def frozen_units(engine):
    return [u for u in engine.parts.units if u.index in engine.frozen_shards.units]


# -- the codec ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("numel", [0, 1, 255, GROUP_SIZE, 3 * GROUP_SIZE + 17, 100_003])
def test_each_dequantized_value_is_within_half_a_step_of_the_original(numel):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * torch.logspace(-6, 3, numel)  # groups of very different scales
    if numel > GROUP_SIZE:
        x[:GROUP_SIZE] = 0  # an all-zero group: scale 0, values exact
    codes, scales = quantize(x)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert codes.numel() == numel and scales.numel() == -(-numel // GROUP_SIZE)
    assert int(codes.abs().max(0)[0]) <= QMAX if numel else True
    step = scales.repeat_interleave(GROUP_SIZE)[:numel]
    error = (dequantize(codes, scales) - x).abs()
    assert bool((error <= step / 2 + torch.finfo(torch.float32).eps * x.abs()).all())
    if numel > GROUP_SIZE:
        assert float(scales[0]) == 0.0 and bool((dequantize(codes, scales)[:GROUP_SIZE] == 0).all())
    packed = pack(codes, scales)
    assert packed.numel() == packed_nbytes(numel) == numel + 4 * scales.numel()
    back_codes, back_scales = unpack(packed, numel)
    assert torch.equal(back_codes, codes) and torch.equal(back_scales, scales)


def test_quantizing_the_dequantized_values_gives_the_same_codes_and_scales():
    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(1)) * 3
    codes, scales = quantize(x)
    again_codes, again_scales = quantize(dequantize(codes, scales))
    assert torch.equal(again_codes, codes) and torch.equal(again_scales, scales)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantizing_into_a_compute_dtype_rounds_the_fp32_values_once(dtype):
    codes, scales = quantize(torch.randn(5000, generator=torch.Generator().manual_seed(2)))
    assert torch.equal(dequantize(codes, scales, dtype), dequantize(codes, scales).to(dtype))


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_host_pass_is_bit_identical_to_torchs_multiply_and_rounding(dtype, threads, monkeypatch):
    # zero/stores/quantized.py [Note: dequantizing on the host]: several threads' ranges, a short last
    # group, scales from subnormal to near fp32's largest (products overflow to inf, round to bf16's
    # ties), and strided codes.
    n = 5 * (1 << 16) * 2 + 3 * GROUP_SIZE + 77
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(-QMAX, QMAX + 1, (2 * n,), dtype=torch.int8, generator=g)[::2]
    scales = torch.exp2(torch.randint(-140, 128, (-(-n // GROUP_SIZE),), generator=g).float()) \
        * (1 + torch.rand(-(-n // GROUP_SIZE), generator=g))
    reference = (codes.to(torch.float32) * scales.repeat_interleave(GROUP_SIZE)[:n]).to(dtype)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    got = dequantize(codes, scales, dtype)
    assert got.dtype == dtype and got.shape == (n,)
    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       reference.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_dequantize_refuses_codes_that_are_not_int8_or_too_few_scales():
    with pytest.raises(ValueError, match="int8 codes on the CPU and 2 fp32 scales for 300 elements in groups of 256, "
                                         "into fp32 or bf16; got torch.int8 codes on cpu, 1 scales"):
        dequantize(torch.zeros(300, dtype=torch.int8), torch.ones(1))
    with pytest.raises(ValueError, match="got torch.uint8 codes"):
        dequantize(torch.zeros(300, dtype=torch.uint8), torch.ones(2))


def test_unpack_refuses_bytes_of_another_size():
    with pytest.raises(ValueError, match="a packed shard of 300 elements has 308 bytes, got 307"):
        unpack(torch.zeros(307, dtype=torch.uint8), 300)


def test_decode_moves_the_packed_bytes_through_the_stores_copy_only_across_devices():
    """The engine gives a CUDA store its copy-stream copy (zero/runtime/host_to_device.py
    ``copy_then_reuse``): a plain ``.to`` would wait for every kernel queued before it, once per
    frozen unit. Shards already on the compute device are not copied at all."""
    from zero.runtime.unit import plan_units
    from zero.stores.quantized import FrozenShards

    (layout,), _, _ = plan_units(torch.nn.Linear(300, 1, bias=False), 1)
    values = torch.randn(300)
    moved = []
    frozen = FrozenShards({layout.index}, to_device=lambda packed, device: (moved.append((packed, device)), packed)[1])
    packed = frozen.encode(layout, values)
    expected = dequantize(*quantize(values))
    assert torch.equal(frozen.decode(layout, packed, torch.float32, torch.device("cpu")), expected) and moved == []
    cuda = torch.device("cuda", 0)  # only compared with: the recording copy hands the CPU tensor back
    assert torch.equal(frozen.decode(layout, packed, torch.float32, cuda), expected)
    assert len(moved) == 1 and moved[0][0] is packed and moved[0][1] == cuda


def test_the_engine_gives_a_cpu_store_no_copy_of_its_own(tmp_path):
    from zero.runtime import host_to_device

    engine = make_engine(tmp_path, model=lora_gpt, config=base_config("nvme", "cpu", tmp_path), overrides=FLAG)
    assert engine.frozen_shards and engine.frozen_shards.to_device is not host_to_device.copy_then_reuse


# -- the engine --------------------------------------------------------------------------------------

@pytest.mark.parametrize("offload", ["nvme", "cpu"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_with_the_flag_equals_training_on_the_dequantized_base_without_it(tmp_path, offload, precision):
    """Trainable parameters are stored as without the flag: the run is bit for bit the run of an
    unflagged engine whose frozen weights were the dequantized values to begin with."""
    batches = make_batches(CFG, 4, 2)
    config = base_config(offload, "cpu", tmp_path / "a", precision=precision, micro=2, lr=1e-2)
    flagged = make_engine(tmp_path / "a", model=lora_gpt, config=config, overrides=FLAG)
    assert len(frozen_units(flagged)) > 0
    reference = make_engine(tmp_path / "b", model=lambda: dequantized_base(lora_gpt()),
                            config=base_config(offload, "cpu", tmp_path / "b", precision=precision, micro=2, lr=1e-2))
    assert not reference.frozen_shards
    assert same_weights(weights(flagged.module), weights(reference.module))
    assert train_engine(flagged, batches, 4) == train_engine(reference, batches, 4)
    assert same_weights(weights(flagged.module), weights(reference.module))


def test_frozen_swap_files_hold_a_quarter_of_fp32s_bytes_and_steps_do_not_rewrite_them(tmp_path):
    engines = {}  # the optimizer in host memory: fp32 parameters on NVMe have files of their own
    for flag in (False, True):
        engines[flag] = make_engine(tmp_path / str(flag), model=lora_gpt, overrides=FLAG if flag else {},
                                    config=base_config("nvme", "cpu", tmp_path / str(flag), micro=2))
    engine = engines[True]
    frozen = frozen_units(engine)
    trainable = [u for u in engine.parts.units if u not in frozen]
    assert frozen and trainable
    on_disk = {flag: sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in
                         os.walk(e.parts.param_store.swap_dir) for f in fs)
               for flag, e in engines.items()}
    frozen_numel = sum(u.layout.shard_numel for u in frozen)
    trainable_bytes = 4 * sum(u.layout.shard_numel for u in trainable)
    assert on_disk[False] == 4 * frozen_numel + trainable_bytes
    assert on_disk[True] == sum(packed_nbytes(u.layout.shard_numel) for u in frozen) + trainable_bytes
    quantized_part = on_disk[True] - trainable_bytes
    assert quantized_part / (4 * frozen_numel) < 0.26  # (1 + 4 / 256) / 4 plus the groups' tails

    batches = make_batches(CFG, 2, 2)
    written = {}
    for flag, e in engines.items():
        counts = e.parts.param_store.swapper.io_bytes
        train_engine(e, batches[:1], 1)  # the first step, a trace recorded
        e.parts.param_store.flush()
        before = counts.written
        train_engine(e, batches[1:], 1)
        e.parts.param_store.flush()
        written[flag] = counts.written - before
    assert written == {False: trainable_bytes, True: trainable_bytes}  # the frozen base is never rewritten


@pytest.mark.parametrize("precision", ["bf16", "fp32"])  # fp32: the flat store is the optimizer's master
def test_in_host_memory_frozen_shards_are_packed_and_the_flat_store_holds_only_the_trainable_ones(tmp_path, precision):
    engine = make_engine(model=lora_gpt, overrides=FLAG, config=base_config("cpu", "cpu", micro=2, precision=precision))
    store = engine.parts.param_store
    frozen = frozen_units(engine)
    trainable = [u for u in engine.parts.units if u not in frozen]
    assert store.flat.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
    assert store.flat.numel() == sum(u.layout.shard_numel for u in trainable)
    # fp32: the master (the parameters' home) has no slots for the int8 units (4 bytes each, unused)
    assert (store.flat is engine.parts.optimizer_store.master) == (precision == "fp32")
    assert {i: t.nbytes for i, t in store._packed.items()} == {
        u.index: packed_nbytes(u.layout.shard_numel) for u in frozen}


def test_a_non_finite_frozen_weight_is_refused_naming_its_module(tmp_path):
    def broken():
        model = lora_gpt()
        with torch.no_grad():
            model.blocks[1].fc.base.weight[3, 4] = float("inf")
        return model

    with pytest.raises(ValueError, match=r"unit 'blocks\.1\.fc\.base' \(zero_quantized_nontrainable_weights\): "
                                         r"a non-finite value"):
        make_engine(tmp_path, model=broken, offload="nvme", overrides=FLAG, micro=2)


def test_below_stage_3_the_flag_warns_that_it_has_no_effect(tmp_path):
    config = base_config("none", "cpu", micro=2)
    config["zero_optimization"].update(stage=2, zero_quantized_nontrainable_weights=True)
    with pytest.warns(UserWarning, match="zero_quantized_nontrainable_weights = True has no effect below ZeRO stage 3"):
        engine = make_engine(model=lora_gpt, config=config)
    assert not engine.frozen_shards


def test_a_modules_frozen_weight_beside_a_trained_bias_is_stored_quantized(tmp_path):
    """zero/runtime/unit.py [Note: a module's frozen and trainable parameters]: the module gets two
    units, and its frozen one is as any frozen unit (int8, no master); the bias trains."""
    def half_frozen():
        model = GPT(CFG)
        model.blocks[0].fc.weight.requires_grad_(False)  # its bias still trains
        model.blocks[1].fc.requires_grad_(False)
        return model

    engine = make_engine(tmp_path, model=half_frozen, offload="nvme", overrides=FLAG, micro=2)
    try:
        quantized = sorted((engine.parts.units[i].layout.module_name, [s.name for s in engine.parts.units[i].layout.slots])
                           for i in engine.frozen_shards.units)
        assert quantized == [("blocks.0.fc", ["blocks.0.fc.weight"]),
                             ("blocks.1.fc", ["blocks.1.fc.weight", "blocks.1.fc.bias"])]
        bias_unit = [u for u in engine.parts.units if [s.name for s in u.layout.slots] == ["blocks.0.fc.bias"]]
        assert len(bias_unit) == 1 and bias_unit[0].index not in engine.rank_layout.frozen
        bias = engine.module.blocks[0].fc.bias
        with zero.GatheredParameters([bias]):
            before = bias.detach().clone()
        train_engine(engine, make_batches(CFG, 2, 2), 2)
        with zero.GatheredParameters([bias]):
            assert not torch.equal(bias.detach(), before)  # it trains
    finally:
        engine.destroy()


# -- checkpoints -------------------------------------------------------------------------------------

def _packed_shards(engine) -> dict:
    """Each frozen unit's stored bytes (codes and scales), read through the store."""
    store = engine.parts.param_store
    if not hasattr(store, "swapper"):  # in host memory
        return {u.index: store._packed[u.index].clone() for u in frozen_units(engine)}
    out = {}
    for u in frozen_units(engine):
        pid = store._ids[u.index]
        out[u.index] = store.swapper.swap_in([pid])[0].clone()
        store.swapper.release([pid])
    return out


@pytest.mark.parametrize("precision, offload", [("fp32", "nvme"), ("bf16", "nvme"), ("fp32", "cpu")])
def test_a_checkpoint_loads_back_the_same_int8_bytes_and_consolidates_to_the_dequantized_values(
        tmp_path, precision, offload, caplog):
    batches = make_batches(CFG, 4, 2)
    config = base_config(offload, offload, tmp_path / "a", precision=precision, micro=2, lr=1e-2)
    engine = make_engine(tmp_path / "a", model=lora_gpt, config=config, overrides=FLAG)
    train_engine(engine, batches[:2], 2)
    engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    saved_weights, saved_packed = weights(engine.module), _packed_shards(engine)

    other = make_engine(tmp_path / "b", model=lora_gpt, seed=5, overrides=FLAG,
                        config=base_config(offload, offload, tmp_path / "b", precision=precision, micro=2, lr=1e-2))
    other.load_checkpoint(tmp_path / "ckpt", tag="t")
    loaded = _packed_shards(other)
    assert loaded.keys() == saved_packed.keys() and all(torch.equal(loaded[i], saved_packed[i]) for i in loaded)
    assert same_weights(weights(other.module), saved_weights)
    assert train_engine(other, batches[2:], 2) == train_engine(engine, batches[2:], 2)

    with caplog.at_level(logging.WARNING, logger="zero"):
        state = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt", tag="t")
    frozen_names = [s.name for u in frozen_units(engine) for s in u.layout.slots]
    assert f"{len(frozen_names)} frozen parameter(s) were stored int8" in caplog.text
    assert "dequantized values" in caplog.text
    torch.manual_seed(0)  # make_engine's seed
    reference = dequantized_base(lora_gpt())  # what the flagged engine started from
    for name in frozen_names:
        assert torch.equal(state[name], reference.state_dict()[name]), name
        if precision == "fp32":
            assert torch.equal(state[name], saved_weights[name])


def test_a_checkpoint_of_a_flagged_engine_loads_into_an_unflagged_one_as_the_dequantized_values(tmp_path):
    engine = make_engine(tmp_path / "a", model=lora_gpt, offload="nvme", overrides=FLAG, micro=2)
    engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    plain = make_engine(tmp_path / "b", model=lora_gpt, offload="nvme", seed=3, micro=2)
    plain.load_checkpoint(tmp_path / "ckpt", tag="t")
    assert same_weights(weights(plain.module), weights(engine.module))


# -- LoRA ----------------------------------------------------------------------------------------------

def test_a_lora_run_on_nvme_with_the_flag_trains_the_adapters_keeps_the_base_and_tracks_the_plain_run(tmp_path):
    batches = make_batches(CFG, 30, 4)
    engine = make_engine(tmp_path / "q", model=lora_gpt, offload="nvme", overrides=FLAG, micro=4, lr=1e-2)
    before = weights(engine.module)
    losses = train_engine(engine, batches, 30)
    after = weights(engine.module)
    plain = train_engine(make_engine(tmp_path / "p", model=lora_gpt, offload="nvme", micro=4, lr=1e-2), batches, 30)
    assert sum(losses[-5:]) < 0.97 * sum(losses[:5])
    assert relative_error(losses, plain) < 0.01
    for name, value in after.items():
        if ".lora_" in name:
            assert not torch.equal(value, before[name]), name
        else:
            assert torch.equal(value, before[name]), name  # frozen: the same dequantized values


def test_a_peft_lora_run_on_nvme_with_the_flag(tmp_path):
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft); the hand-written "
                                              "adapter of zero.examples.add_lora covers the LoRA run")
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["qkv", "fc"])
    engine = make_engine(tmp_path, model=lambda: peft.get_peft_model(GPT(CFG), config), offload="nvme",
                         overrides=FLAG, micro=4, lr=1e-2)
    assert frozen_units(engine)
    losses = train_engine(engine, make_batches(CFG, 20, 4), 20)
    assert sum(losses[-5:]) < sum(losses[:5])


# -- inference -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("offload", ["nvme", "cpu"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_inference_with_the_flag_equals_inference_with_the_dequantized_weights(tmp_path, offload, precision):
    """Without an optimizer every unit is stored quantized (ZeRO-Inference's whole model)."""
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": precision == "bf16"},
              "zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True,
                                    "offload_param": {"device": offload, "nvme_path": str(tmp_path),
                                                      "max_in_cpu": 0, "min_swap_bytes": 0}}}
    torch.manual_seed(0)
    engine, _, _, _ = zero.initialize(model=GPT(CFG), config=config)
    assert len(engine.frozen_shards.units) == len(engine.parts.units)
    torch.manual_seed(0)
    reference = dequantized_base(GPT(CFG).requires_grad_(False))
    if precision == "bf16":
        reference = reference.to(torch.bfloat16)
    x, _ = make_batches(CFG, 1, 2)[0]
    with torch.no_grad():
        for _ in range(2):  # the first forward records the trace, the second prefetches along it
            assert torch.equal(engine(x), reference(x))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_inference_checkpoint_keeps_the_fp32_dequantized_values_and_loads_back_the_same_bytes(tmp_path, precision):
    """Without an optimizer the checkpoint's master is the parameters: a quantized shard's are taken
    in fp32 (not rounded to bf16), so a load quantizes them back to the same codes and scales."""
    def config(path):
        path.mkdir()
        return {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": precision == "bf16"},
                "zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True,
                                      "offload_param": {"device": "nvme", "nvme_path": str(path), "max_in_cpu": 0, "min_swap_bytes": 0}}}

    torch.manual_seed(0)
    engine, _, _, _ = zero.initialize(model=GPT(CFG), config=config(tmp_path / "a"))
    engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    torch.manual_seed(1)
    other, _, _, _ = zero.initialize(model=GPT(CFG), config=config(tmp_path / "b"))
    other.load_checkpoint(tmp_path / "ckpt", tag="t")
    saved, loaded = _packed_shards(engine), _packed_shards(other)
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[i], loaded[i]) for i in saved)
    torch.manual_seed(0)
    reference = dequantized_base(GPT(CFG).requires_grad_(False)).state_dict()
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt", tag="t")
    assert all(torch.equal(state[n], reference[n]) for n in reference if not n.startswith("head."))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])  # fp32: the parameters' home is the master
def test_the_host_memory_check_counts_frozen_weights_at_their_packed_size(tmp_path, monkeypatch, precision):
    """An engine that fits in host memory only with its frozen base int8 is built with the flag and
    refused without it."""
    from swapper.host_memory import HostMemory
    from zero.config import ConfigError
    from zero.stores import memory_check

    totals = {}
    check = memory_check.check_host_memory

    def recording(parts, memory):
        totals[flag] = sum(p.nbytes for p in parts)
        check(parts, memory)
    monkeypatch.setattr(memory_check, "check_host_memory", recording)
    for flag in (False, True):
        engine = make_engine(model=lora_gpt, overrides=FLAG if flag else {},
                             config=base_config("cpu", "cpu", micro=2, precision=precision))
        frozen = [u.layout.shard_numel for u in engine.parts.units if not any(p.requires_grad for p in u.params)]
        engine.destroy()
    itemsize = 4 if precision == "fp32" else 2
    assert totals[False] - totals[True] == sum(itemsize * n - packed_nbytes(n) for n in frozen)
    between = (totals[False] + totals[True]) // 2
    monkeypatch.setattr(memory_check, "probe", lambda: HostMemory(between, None, 0))
    make_engine(model=lora_gpt, overrides=FLAG, config=base_config("cpu", "cpu", micro=2, precision=precision)).destroy()
    with pytest.raises(ConfigError, match="of host memory on this rank but MemAvailable is"):
        make_engine(model=lora_gpt, config=base_config("cpu", "cpu", micro=2, precision=precision))


@pytest.mark.parametrize("precision", ["bf16", "fp32"])  # fp32: the flat store is the optimizer's master
def test_with_pin_memory_the_packed_shards_are_registered_and_a_load_rewrites_them_in_place(
        tmp_path, monkeypatch, precision):
    """A GPU reads the int8 base ahead of its units (offload_param cpu): from pageable memory that
    copy would block the CPU, so the packed shards are in one block of the store's registered host
    memory, and a checkpoint load writes the same bytes again."""
    from nvmeio import RegisteredHost
    from zero.stores import param_store

    backend = RecordingBackend()
    monkeypatch.setattr(param_store, "for_gpu_copies", lambda pin_memory: RegisteredHost(backend))
    batches = make_batches(CFG, 4, 2)
    config = base_config("cpu", "cpu", precision=precision, micro=2, lr=1e-2)
    engine = make_engine(tmp_path / "a", model=lora_gpt, config=config, overrides=FLAG)
    packed = engine.parts.param_store._packed
    blocks = {(start, n) for t in packed.values() for start, n in backend.pinned
              if start <= t.data_ptr() and t.data_ptr() + t.nbytes <= start + n}
    assert packed and len(blocks) == 1  # every shard in one registered block
    addresses = {i: t.data_ptr() for i, t in packed.items()}
    losses = train_engine(engine, batches[:2], 2)
    engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    saved = {i: t.clone() for i, t in packed.items()}
    for t in packed.values():
        t.zero_()
    engine.load_checkpoint(tmp_path / "ckpt", tag="t")
    assert {i: t.data_ptr() for i, t in packed.items()} == addresses
    assert all(torch.equal(packed[i], saved[i]) for i in saved)
    monkeypatch.undo()
    reference = make_engine(tmp_path / "b", model=lambda: lora_gpt(), overrides=FLAG,
                            config=base_config("cpu", "cpu", precision=precision, micro=2, lr=1e-2))
    try:
        assert losses == train_engine(reference, batches[:2], 2)
    finally:
        reference.destroy()
        engine.destroy()
    assert sorted(backend.unpinned) == sorted(start for start, _ in backend.pinned)  # closing unregisters them
