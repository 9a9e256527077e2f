"""nvme_tune's sweep space: ds_nvme_tune's default grid, --sweep_config
validation (did-you-mean hints, types, ds_nvme_tune's key names), and the
"aio" block each configuration prints."""

import json

import pytest

import nvmeio
from nvmeio.tune._space import (GDS_BACKEND, Config, SweepConfigError, build_space,
                               load_sweep_config, normalize_sweep, parse_size)

AVAILABLE = ["io_uring", "aio", "psync"]


def test_default_sweep_is_ds_nvme_tunes_grid_times_the_backends():
    space = build_space(None, None, AVAILABLE)
    assert space.values["block_size"] == (1 << 20, 8 << 20)
    assert space.values["queue_depth"] == (32, 128)
    assert space.values["intra_op_parallelism"] == (1, 2, 4, 8)
    assert set(space.values["single_submit"]) == {False, True}
    assert set(space.values["overlap_events"]) == {False, True}  # ds_nvme_tune's "sequential"
    assert space.values["backend"] == tuple(AVAILABLE)
    assert len(space) == 64 * 3 == len(set(space))


def test_backend_option_replaces_the_swept_backends():
    assert build_space(None, ["psync"], AVAILABLE).values["backend"] == ("psync",)
    assert len(build_space(None, ["aio", "psync"], AVAILABLE)) == 128


def test_sweep_keys_left_out_keep_the_handle_defaults():
    space = build_space(normalize_sweep({"queue_depth": [8, 32]}, AVAILABLE), ["aio"], AVAILABLE)
    h = nvmeio.aio_handle(backend="psync")
    assert space.values["block_size"] == (h.get_block_size(),)
    assert space.values["intra_op_parallelism"] == (h.get_intra_op_parallelism(),)
    assert space.values["single_submit"] == (h.get_single_submit(),)
    assert space.values["overlap_events"] == (h.get_overlap_events(),)
    assert len(space) == 2


def test_ds_nvme_tune_names_are_accepted():
    sweep = normalize_sweep({"block_size": ["128K", "1M", 4096], "io_parallel": [8, 1],
                             "sequential_requests": [True, False]}, AVAILABLE)
    assert sweep["block_size"] == [4096, 128 << 10, 1 << 20]
    assert sweep["intra_op_parallelism"] == [1, 8]
    assert sweep["overlap_events"] == [False, True]  # sequential = not overlapped


@pytest.mark.parametrize("key, hint", [("block_sise", "block_size"),
                                       ("queue_dept", "queue_depth"),
                                       ("overlap_event", "overlap_events"),
                                       ("intra_op_paralelism", "intra_op_parallelism"),
                                       ("backends", "backend")])
def test_unknown_key_names_it_and_the_closest_known_one(key, hint):
    with pytest.raises(SweepConfigError, match=f"unknown key '{key}'; did you mean '{hint}'"):
        normalize_sweep({key: [1]}, AVAILABLE)


def test_unknown_key_without_a_close_match_lists_the_known_keys():
    with pytest.raises(SweepConfigError, match="known keys: backend, block_size"):
        normalize_sweep({"zzz": [1]}, AVAILABLE)


def test_a_key_and_its_ds_alias_together_are_refused():
    with pytest.raises(SweepConfigError, match="'io_parallel' and 'intra_op_parallelism' both"):
        normalize_sweep({"intra_op_parallelism": [1], "io_parallel": [2]}, AVAILABLE)


@pytest.mark.parametrize("sweep, message", [
    ({"queue_depth": []}, "empty list"),
    ({"queue_depth": [True]}, "positive integers"),
    ({"intra_op_parallelism": [1.5]}, "positive integers"),
    ({"block_size": ["1X"]}, "block_size '1X'"),
    ({"single_submit": [0]}, "JSON booleans"),
    ({"backend": ["auto"]}, "instead of 'auto'"),
    ({"backend": ["io_urin"]}, "did you mean 'io_uring'"),
])
def test_bad_values_are_refused(sweep, message):
    with pytest.raises(SweepConfigError, match=message):
        normalize_sweep(sweep, AVAILABLE)


def test_load_sweep_config_reads_json_and_names_the_file(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"queue_depth": [32, 8, 32]}))
    assert load_sweep_config(str(path), AVAILABLE) == {"queue_depth": [8, 32]}
    with pytest.raises(SweepConfigError, match="no such file"):
        load_sweep_config(str(tmp_path / "missing.json"), AVAILABLE)


def test_aio_block_is_what_aio_handle_and_the_zero_config_take():
    c = Config("psync", 8 << 20, 32, 4, False, True)
    block = c.aio_block()
    assert block == {"block_size": 8 << 20, "queue_depth": 32, "intra_op_parallelism": 4,
                     "single_submit": False, "overlap_events": True, "backend": "psync"}
    h = nvmeio.aio_handle(**block)
    assert h.get_backend() == "psync" and h.get_intra_op_parallelism() == 4
    assert json.dumps(block).count("false") == 1  # a real JSON boolean, not a string


def test_gds_block_says_use_gds_and_has_no_backend():
    c = Config(GDS_BACKEND, 1 << 20, 128, 8, False, True)
    assert c.aio_block()["use_gds"] is True and "backend" not in c.aio_block()
    assert "backend" not in c.handle_kwargs()
    space = build_space(None, None, AVAILABLE, gds=True)
    assert space.values["backend"] == (GDS_BACKEND,) and len(space) == 64


@pytest.mark.parametrize("text, n", [("400M", 400 << 20), ("1G", 1 << 30), ("128K", 128 << 10),
                                     ("4096", 4096), ("2MiB", 2 << 20)])
def test_sizes_are_binary_like_ds_nvme_tunes(text, n):
    assert parse_size(text) == n
