"""A zero.initialize or zero.Init that fails gives back everything it took (swap directory claims,
swap files and the job directory, aio handles and their threads, locked buffers) before its error
reaches the caller, raises that error unchanged, and the next call in the same process, with the
same nvme_path, succeeds.

The regression of the issue: too little space under nvme_path, the model shrunk, zero.initialize
called again in the same process (a notebook) failed with SwapDirectoryInUseError, because the
stores of the failed call still claimed their directories. Each test keeps the failed call's
exception alive, as a notebook keeps its traceback, so whatever is released is released by the
failure itself, not by garbage collection.
"""
import gc
import os
import warnings

import pytest
import torch
import torch.nn as nn

import zero
from nvmeio import faults, resources
from nvmeio import AioError
from swapper import InsufficientSwapSpaceError
from swapper._swap_dir import SwapDirectory
from zero.config import ConfigError, IgnoredSettingWarning
from zero.examples import GPT, GPTConfig, make_batches
from zero.partitioning import init_context
from helpers import base_config, train_engine

CFG = GPTConfig()
SMALL = GPTConfig(layers=1)
BATCH = make_batches(CFG, 1, 4)[0]


def nvme_config(path, precision="fp32", pin_memory=True, **zero_extra) -> dict:
    """Parameters and optimizer on NVMe, through locked pool buffers (VmLck shows a leaked pool).
    zero.Init's pool is 5 x 16 MiB: the tests of zero.Init leave it unpinned, for the memlock limit."""
    config = base_config("nvme", "nvme", path, precision=precision, **zero_extra)
    for section in ("offload_param", "offload_optimizer"):
        config["zero_optimization"][section]["pin_memory"] = pin_memory
    return config


def held(root):
    """What the process holds: fds, threads, locked memory, AIO contexts, and every path under ``root``."""
    gc.collect()
    paths = sorted(os.path.relpath(os.path.join(r, n), root) for r, ds, ns in os.walk(root) for n in ds + ns)
    return resources.snapshot(), paths


def assert_all_given_back(before, root):
    assert resources.grown_since(before[0]) == {}
    after = held(root)
    assert after[1] == before[1]  # no swap file, rank, job or owner directory left


def plain_loss(model) -> float:
    with torch.no_grad():
        return model(*BATCH).item()


def builds_and_trains(config, model_config=SMALL) -> None:
    """The call after a failed one: an engine is built on the same nvme_path, trains, and goes."""
    torch.manual_seed(1)
    engine, _, _, _ = zero.initialize(model=GPT(model_config), config=config)
    train_engine(engine, make_batches(model_config, 1, 4), 1)
    engine.destroy()


@pytest.fixture(scope="module", autouse=True)
def started_once(tmp_path_factory):
    """What a process starts once (torch's worker threads, the I/O backend chosen at the first
    handle) starts here, outside every test's before/after window."""
    torch.manual_seed(0)
    engine, _, _, _ = zero.initialize(model=GPT(CFG), config=nvme_config(tmp_path_factory.mktemp("warm")))
    train_engine(engine, make_batches(CFG, 1, 4), 1)
    engine.destroy()


@pytest.fixture
def free_bytes(monkeypatch):
    """Sets what the swap directories see as free under nvme_path (the statvfs query they use)."""
    def set_free(n):
        monkeypatch.setattr("swapper._swap_dir.disk_free_bytes", lambda path: n)
    return set_free


@pytest.fixture
def raised(monkeypatch):
    """Records the errors the free-space check raises, to compare with what the caller gets."""
    seen = []
    check = SwapDirectory.check_free_space

    def recording(self, needed_bytes, what):
        try:
            check(self, needed_bytes, what)
        except BaseException as error:
            seen.append(error)
            raise
    monkeypatch.setattr(SwapDirectory, "check_free_space", recording)
    return seen


# -- zero.initialize -----------------------------------------------------------------------------

def test_too_little_swap_space_releases_all_and_a_smaller_model_builds_next(tmp_path, free_bytes, raised):
    torch.manual_seed(0)
    model = GPT(CFG)
    expected = plain_loss(model)
    config = nvme_config(tmp_path)
    before = held(tmp_path)
    free_bytes(1000)
    with pytest.raises(InsufficientSwapSpaceError) as failed:
        zero.initialize(model=model, config=config)
    assert failed.value is raised[0]  # the swapper's own error, not one raised while cleaning up
    assert "more bytes" in str(failed.value) and "but only 1000 bytes (1000 B) are free" in str(failed.value)
    assert not getattr(failed.value, "__notes__", None)  # refused before the model was handed over
    assert_all_given_back(before, tmp_path)

    free_bytes(1 << 40)
    builds_and_trains(config)  # the issue: SwapDirectoryInUseError here
    # Free space is asked before the stores are filled, so the model itself is intact too.
    engine, _, _, _ = zero.initialize(model=model, config=config)
    assert engine(*BATCH).item() == expected
    engine.destroy()


def test_a_config_error_found_after_the_optimizer_store_is_built_releases_it(tmp_path):
    # offload_param.buffer_size is checked by the parameter store, made after the optimizer's.
    torch.manual_seed(0)
    model = GPT(CFG)
    expected = plain_loss(model)
    config = nvme_config(tmp_path)
    config["zero_optimization"]["offload_param"]["buffer_size"] = 1000
    before = held(tmp_path)
    with pytest.raises(ConfigError) as failed:
        zero.initialize(model=model, config=config)
    assert [p.path for p in failed.value.problems] == ["zero_optimization.offload_param.buffer_size"]
    assert str(failed.value.problems[0].message).startswith("1000 elements is smaller than the largest")
    assert_all_given_back(before, tmp_path)

    del config["zero_optimization"]["offload_param"]["buffer_size"]
    engine, _, _, _ = zero.initialize(model=model, config=config)
    assert engine(*BATCH).item() == expected
    engine.destroy()


# fp32 shards live in the optimizer's master (one write per sub-group, waited for); bf16 shards
# have files of their own, written asynchronously, unit by unit.
@pytest.mark.parametrize("precision, first_written", [("fp32", "optimizer/subgroup0.swp"),
                                                      ("bf16", "params/param_unit0.root.swp")])
def test_an_io_error_in_the_first_swap_out_releases_all(tmp_path, precision, first_written):
    torch.manual_seed(0)
    model = GPT(CFG)
    config = nvme_config(tmp_path, precision, nvme_job_id="io_error")  # a job id of its own: known path
    before = held(tmp_path)
    where = os.path.join(tmp_path, "io_error", "rank0", os.path.dirname(first_written))
    with pytest.raises(AioError) as failed:
        with faults.inject(fail_nth=1, fail_count=0, errno="EIO", path_contains=where, op="write") as fired:
            zero.initialize(model=model, config=config)
    assert fired()["failed"] >= 1
    error = failed.value
    assert type(error) is AioError and error.errno == 5
    assert str(error).startswith(f"[Errno 5] write failed: {os.strerror(5)}: "
                                 f"'{where}/{os.path.basename(first_written)}' (offset ")
    # The model's values had gone into the stores unit by unit: the error says so, and the model
    # is refused by name rather than trained as zeros.
    assert any("build or load the model again" in note for note in error.__notes__)
    assert_all_given_back(before, tmp_path)
    with pytest.raises(ValueError, match=r"parameter\(s\) hold no values: pos, wte.weight"):
        zero.initialize(model=model, config=config)
    builds_and_trains(config)


def test_an_error_after_the_engine_is_built_releases_it(tmp_path):
    config = nvme_config(tmp_path, clip=1.0)
    config["zero_optimization"]["offload_optimizer"]["step_in_backward"] = True  # no effect with clipping: warns
    before = held(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredSettingWarning)
        with pytest.raises(IgnoredSettingWarning, match="step_in_backward = true has no effect"):
            zero.initialize(model=GPT(CFG), config=config)
    assert_all_given_back(before, tmp_path)

    boom = RuntimeError("the script's scheduler factory failed")

    def scheduler(optimizer):
        raise boom

    with pytest.raises(RuntimeError) as failed:
        zero.initialize(model=GPT(CFG), config=nvme_config(tmp_path), lr_scheduler=scheduler)
    assert failed.value is boom
    assert_all_given_back(before, tmp_path)
    builds_and_trains(nvme_config(tmp_path))


def test_training_data_without_a_micro_batch_size_is_refused_before_the_model_is_taken(tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    expected = plain_loss(model)
    config = nvme_config(tmp_path)
    del config["train_micro_batch_size_per_gpu"], config["train_batch_size"]
    with pytest.raises(ConfigError, match="is needed to batch training_data"):
        zero.initialize(model=model, config=config, training_data=torch.utils.data.TensorDataset(torch.arange(8)))
    assert os.listdir(tmp_path) == []
    engine, _, _, _ = zero.initialize(model=model, config=nvme_config(tmp_path))
    assert engine(*BATCH).item() == expected
    engine.destroy()


# -- zero.Init -----------------------------------------------------------------------------------

def test_an_error_in_the_init_block_deletes_its_slices(tmp_path):
    config = nvme_config(tmp_path, pin_memory=False)
    before = held(tmp_path)
    boom = RuntimeError("the script failed after building the model")
    with pytest.raises(RuntimeError) as failed:
        with zero.Init(config_dict_or_path=config) as init:
            model = GPT(CFG)
            assert init.nvme_store.files > 0
            raise boom
    assert failed.value is boom
    assert_all_given_back(before, tmp_path)
    # The model built in the failed block has no values left: refused by name, never zeros.
    with pytest.raises(ValueError, match=r"hold no values: pos, wte.weight"):
        zero.initialize(model=model, config=config)
    with pytest.raises(RuntimeError, match="build the model again"):
        with zero.GatheredParameters([model.pos]):
            pass

    with zero.Init(config_dict_or_path=config):
        small = GPT(SMALL)
    engine, _, _, _ = zero.initialize(model=small, config=config)
    engine.destroy()
    assert os.listdir(tmp_path) == []


def test_too_little_space_while_building_under_init_releases_all(tmp_path, free_bytes, raised):
    config = nvme_config(tmp_path, pin_memory=False)
    before = held(tmp_path)
    free_bytes(3000)  # the first slice (pos, 2 KiB) fits, the second (wte, 8 KiB) does not
    with pytest.raises(InsufficientSwapSpaceError) as failed:
        with zero.Init(config_dict_or_path=config):
            GPT(CFG)
    assert failed.value is raised[0]
    assert_all_given_back(before, tmp_path)

    free_bytes(1 << 40)
    with zero.Init(config_dict_or_path=config):
        small = GPT(SMALL)
    engine, _, _, _ = zero.initialize(model=small, config=config)
    train_engine(engine, make_batches(SMALL, 1, 4), 1)
    engine.destroy()
    assert os.listdir(tmp_path) == []


def test_init_of_an_existing_module_that_fails_releases_all(tmp_path, free_bytes, raised):
    model = GPT(CFG)
    before = held(tmp_path)
    free_bytes(3000)
    with pytest.raises(InsufficientSwapSpaceError) as failed:
        zero.Init(module=model, config_dict_or_path=nvme_config(tmp_path, pin_memory=False))
    assert failed.value is raised[0]
    assert_all_given_back(before, tmp_path)


def test_a_failed_enter_leaves_no_constructor_patched(monkeypatch):
    original_init = nn.Linear.__dict__["__init__"]
    had_init_subclass = "__init_subclass__" in nn.Module.__dict__
    boom = RuntimeError("registering the hook failed")

    def refuse(hook):
        raise boom

    monkeypatch.setattr(init_context, "register_module_parameter_registration_hook", refuse)
    with pytest.raises(RuntimeError) as failed:
        with zero.Init():
            pass
    assert failed.value is boom
    assert nn.Linear.__dict__["__init__"] is original_init
    assert ("__init_subclass__" in nn.Module.__dict__) == had_init_subclass
    assert init_context.current_context() is None and init_context._DEPTH[0] == 0
    assert nn.Linear(4, 4).weight.numel() == 16  # built whole: no context is active
    monkeypatch.undo()
    with zero.Init():
        layer = nn.Linear(4, 4)
    assert layer.weight.numel() == 0 and layer.weight.ds_numel == 16

