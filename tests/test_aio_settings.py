"""nvmeio.AioSettings: the one model of handle settings, read by the handle, the
swappers, the ZeRO config and the tuner; use_gds selects gds_handle or is refused."""

import dataclasses
import os

import pytest

import nvmeio
import zero
from helpers import base_config
from nvmeio.settings import ZERO_CONFIG_DEFAULTS, AioSettings
from nvmeio.tune._space import HANDLE_DEFAULTS, Config
from swapper import PartitionedParamSwapper
from zero.config import AioConfig, load_config
from zero.examples import GPT, GPTConfig


def test_handle_defaults_are_the_settings_defaults():
    s, h = AioSettings(), nvmeio.aio_handle()
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(),
            h.get_overlap_events(), h.get_intra_op_parallelism()) == \
        (s.block_size, s.queue_depth, s.single_submit, s.overlap_events, s.intra_op_parallelism)
    assert (s.backend, s.use_gds) == ("auto", False)


def test_zero_config_defaults_are_deepspeeds_and_map_onto_the_settings():
    config = load_config({"train_batch_size": 1, "zero_optimization": {"stage": 3}})
    assert config.aio.settings() == ZERO_CONFIG_DEFAULTS == \
        AioSettings(queue_depth=8, overlap_events=True)
    pasted = {"block_size": 262144, "queue_depth": 32, "intra_op_parallelism": 4,
              "single_submit": "true", "overlap_events": False, "backend": "psync"}
    settings = AioConfig(**pasted).settings()
    assert settings == AioSettings(block_size=262144, queue_depth=32, intra_op_parallelism=4,
                                   single_submit=True, overlap_events=False, backend="psync")


def test_tuner_defaults_and_printed_block_come_from_the_settings():
    assert HANDLE_DEFAULTS == {k: v for k, v in dataclasses.asdict(AioSettings()).items()
                               if k not in ("backend", "use_gds")}
    c = Config("psync", 8 << 20, 32, 4, False, True)
    block = c.aio_block()
    assert block == {"block_size": 8 << 20, "queue_depth": 32, "intra_op_parallelism": 4,
                     "single_submit": False, "overlap_events": True, "backend": "psync"}
    assert load_config({"train_batch_size": 1, "zero_optimization": {"stage": 3},
                        "aio": block}).aio.settings() == c.settings()


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 0}, "block_size must be a positive int, got 0"),
    ({"queue_depth": True}, "queue_depth must be a positive int, got True"),
    ({"intra_op_parallelism": 2.0}, "intra_op_parallelism must be a positive int, got 2.0"),
    ({"overlap_events": "yes"}, "overlap_events must be True or False, got 'yes'"),
    ({"backend": ""}, "backend must be a backend name"),
    ({"use_gds": True, "backend": "psync"}, "backend='psync' does not apply with use_gds=True"),
])
def test_bad_settings_name_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AioSettings(**kwargs)


def test_coerce_takes_dicts_and_suggests_the_closest_key():
    assert AioSettings.coerce(None) == AioSettings()
    assert AioSettings.coerce({"queue_depth": 4}) == AioSettings(queue_depth=4)
    assert AioSettings.coerce({"queue_depth": 4}, ZERO_CONFIG_DEFAULTS).overlap_events is True
    with pytest.raises(ValueError, match="unknown aio key 'queue_dept'; did you mean 'queue_depth'"):
        AioSettings.coerce({"queue_dept": 4})
    with pytest.raises(TypeError, match="got list"):
        AioSettings.coerce([("queue_depth", 4)])


def test_new_handle_builds_the_handle_the_settings_describe():
    h = nvmeio.new_handle({"block_size": 8192, "queue_depth": 3, "backend": "psync"})
    assert type(h) is nvmeio.aio_handle and h.get_backend() == "psync"
    assert (h.get_block_size(), h.get_queue_depth()) == (8192, 3)
    h.close()


needs_no_gds = pytest.mark.skipif(nvmeio.gds_unavailable_reason() is None,
                                  reason="gds_handle works here: nothing to refuse")


@needs_no_gds
def test_use_gds_is_refused_naming_what_is_missing(tmp_path):
    why = nvmeio.gds_unavailable_reason()
    with pytest.raises(RuntimeError, match="use_gds=true selects nvmeio.gds_handle") as e:
        nvmeio.new_handle({"use_gds": True})
    assert why in str(e.value)
    with pytest.raises(RuntimeError, match="use_gds"):
        PartitionedParamSwapper(tmp_path, {"use_gds": True})
    assert os.listdir(tmp_path) == []


@needs_no_gds
@pytest.mark.parametrize("offload", ["nvme", "cpu"])
def test_engine_refuses_use_gds_instead_of_dropping_it(tmp_path, offload):
    config = base_config(offload, offload, tmp_path)
    config["aio"] = {"use_gds": True}
    with pytest.raises(RuntimeError, match="use_gds=true selects nvmeio.gds_handle") as e:
        zero.initialize(model=GPT(GPTConfig()), config=config)
    assert nvmeio.gds_unavailable_reason() in str(e.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.cuda
@pytest.mark.skipif(nvmeio.gds_unavailable_reason() is not None, reason="needs a CUDA GPU and kvikio")
def test_use_gds_selects_gds_handle():
    h = nvmeio.new_handle({"use_gds": True, "queue_depth": 4})
    assert type(h) is nvmeio.gds_handle and h.get_queue_depth() == 4
    h.close()
