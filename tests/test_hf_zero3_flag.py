"""transformers sees ZeRO-3 exactly while one of ours is active (zero/partitioning/hf_zero3.py).

``transformers.integrations.is_deepspeed_zero3_enabled()`` is true inside ``zero.Init``, while a
stage-3 ``HfDeepSpeedConfig`` lives and while a stage-3 engine exists; false before, after, and for
stage 0-2. Meanwhile ``import deepspeed`` gives the stand-in (two names, ours), which leaves
``sys.modules`` with the last of them; transformers' and accelerate's ``is_deepspeed_available()``
stay false; a real (here: a fake) deepspeed package is never replaced. Every ``deepspeed`` name
transformers uses is either the stand-in's or on a path this package takes instead.
"""
import gc
import importlib
import os
import re
import sys

import pytest
import torch

import zero

transformers = pytest.importorskip("transformers", reason='Hugging Face tests need transformers (pip install "nvmeio[hf]")')
from transformers.integrations import deepspeed as hf_deepspeed

from zero.hf import HfDeepSpeedConfig
from zero.partitioning import deepspeed_standin, hf_zero3, init_context
from zero.partitioning.active_context import current_context
from zero.examples import GPT, GPTConfig
from helpers import base_config, run_child

DATA_DIR = os.path.join(os.path.dirname(__file__), "data")
STAGE_3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def seen() -> bool:
    return transformers.integrations.is_deepspeed_zero3_enabled()


def stand_in_loaded() -> bool:
    return "deepspeed" in sys.modules


@pytest.fixture(autouse=True)
def nothing_active_around_each_test():
    gc.collect()  # engines of earlier tests
    assert not hf_zero3.is_on() and not seen() and not stand_in_loaded()
    yield
    gc.collect()
    assert not hf_zero3.is_on() and not seen() and not stand_in_loaded()


class Theirs:
    """Something else that told transformers about a config before ours."""

    config = {"theirs": True}

    def is_zero3(self):
        return False


def test_init_turns_it_on_and_puts_back_what_was_there():
    theirs = Theirs()
    hf_deepspeed.set_hf_deepspeed_config(theirs)
    try:
        with zero.Init(config_dict_or_path=STAGE_3):
            assert seen()
            import deepspeed

            assert deepspeed.zero.GatheredParameters is zero.GatheredParameters
            assert transformers.integrations.deepspeed_config()["zero_optimization"] == {"stage": 3}
            with zero.Init():
                assert seen()
            assert seen() and deepspeed_standin.installed()  # the outer one is still open
        again = zero.Init(config_dict_or_path=STAGE_3)
        with again:
            with again:  # re-entered, as a decorator nests
                assert seen()
            assert seen()  # until its last exit
        assert not stand_in_loaded()
        assert hf_deepspeed.deepspeed_config() is theirs.config
    finally:
        hf_deepspeed.unset_hf_deepspeed_config()


def test_an_init_that_fails_on_entry_leaves_it_off(monkeypatch):
    def broken(source):
        raise RuntimeError("activation failed")

    monkeypatch.setattr(hf_zero3, "activate", broken)
    with pytest.raises(RuntimeError, match="activation failed"):
        with zero.Init():
            pass
    assert current_context() is None and init_context._DEPTH[0] == 0


@pytest.mark.parametrize("config", [STAGE_3, os.path.join(DATA_DIR, "ds_config_zero2_auto.json")])
def test_hf_deepspeed_config_of_stage_3_while_it_lives(config):
    dschf = HfDeepSpeedConfig(config)
    stage_3 = config is STAGE_3
    assert dschf.is_zero3() is stage_3 and seen() is stage_3 and stand_in_loaded() is stage_3
    assert isinstance(dschf.config, dict)  # a path is read, as transformers' deepspeed_config() returns a dict
    if stage_3:
        assert transformers.integrations.deepspeed_config() is dschf.config
    del dschf  # no cycle holds it: gone at once, as HF's
    assert not seen() and not stand_in_loaded()


@pytest.mark.parametrize("stage", [3, 2])
def test_an_engine_of_stage_3_until_destroyed_or_collected(stage):
    def engine():
        torch.manual_seed(0)
        built, _, _, _ = zero.initialize(model=GPT(GPTConfig()), config=base_config(stage=stage))
        return built

    first = engine()
    assert seen() is (stage == 3)
    first.destroy()
    assert not seen()
    second = engine()
    assert seen() is (stage == 3)
    del second
    gc.collect()
    assert not seen() and not stand_in_loaded()


def test_availability_checks_still_say_no_deepspeed():
    # Both also read the package's metadata, which the stand-in has none of: neither the Trainer nor
    # accelerate takes its DeepSpeed path because of it.
    import accelerate.utils

    with zero.Init():
        assert importlib.util.find_spec("deepspeed") is not None  # the stand-in is importable...
        assert not hf_deepspeed.is_deepspeed_available()  # ...but is no DeepSpeed installation
        assert not accelerate.utils.is_deepspeed_available()


@pytest.fixture
def fake_deepspeed(tmp_path, monkeypatch):
    package = tmp_path / "site" / "deepspeed"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('WHO = "the installed one"\n')
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    monkeypatch.setattr(hf_zero3, "_WARNED", [False])
    yield
    sys.modules.pop("deepspeed", None)


@pytest.mark.parametrize("imported", [False, True])
def test_a_real_deepspeed_is_never_replaced(fake_deepspeed, imported):
    if imported:
        import deepspeed
    with pytest.warns(RuntimeWarning, match="a deepspeed package is importable, so transformers is not told"):
        with zero.Init():
            assert not seen()  # its branches would call that package's GatheredParameters on our parameters
            import deepspeed

            assert deepspeed.WHO == "the installed one"
    import deepspeed

    assert deepspeed.WHO == "the installed one"


# -- every deepspeed name transformers uses: the stand-in's, or on a path we take instead ------------------

STAND_IN = {"zero.GatheredParameters", "zero.register_external_parameter"}
TAKEN_INSTEAD = {  # name: where transformers uses it, and what runs instead
    "zero.Init": "from_pretrained / from_config build under zero.Init (hf_hook.py)",
    "runtime.zero.partition_parameters": "from_pretrained / from_config (prevent_arange_dtype_change)",
    "accelerator.get_accelerator": "from_pretrained's ZeRO-3 loading: hf_hook.py loads on the plain path",
    "comm.get_rank": "from_config's initialize_weights_zero3: hf_hook.py initialises in post_init",
    "tp_model_init": "the Trainer's DeepSpeed path (deepspeed_init): ZeroTrainer takes the plain one",
    "utils.logger": "the Trainer's DeepSpeed path (deepspeed_init)",
    "utils.groups": "the Trainer's DeepSpeed sequence parallelism",
    "save_checkpoint": "a comment of the Trainer's DeepSpeed path",
    "utils.is_initialized": "ESMFold, only when is_deepspeed_available(), false with the stand-in",
    "__version__": "transformers env, only when is_deepspeed_available()",
}


def deepspeed_names_in_transformers() -> set:
    root = os.path.dirname(transformers.__file__)
    attribute = re.compile(r"(?<![\w.])deepspeed\.(\w+(?:\.\w+)*)")
    imported = re.compile(r"from deepspeed((?:\.\w+)*) import ([\w, ]+)")
    names = set()
    for folder, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(folder, f)) as source:
                    text = source.read()
                if "deepspeed" not in text:
                    continue
                names.update(m.group(1) for m in attribute.finditer(text))
                for m in imported.finditer(text):
                    names.update(m.group(1)[1:] + "." * bool(m.group(1)) + n.split(" as ")[0].strip()
                                 for n in m.group(2).split(","))
    return {n for n in names if not any(other.startswith(n + ".") for other in names)}  # a module: its names count


def resolve(dotted: str):
    module, *rest = dotted.split(".")
    value = importlib.import_module("deepspeed")
    for part in [module] + rest:
        value = getattr(value, part) if hasattr(value, part) else importlib.import_module(
            f"{value.__name__}.{part}")
    return value


def test_every_deepspeed_name_transformers_uses_is_the_stand_ins_or_on_a_path_taken_instead():
    # A new name in a new transformers fails here: decide whether the stand-in offers it. An older 5.x
    # uses fewer of them (5.17: neither runtime.zero.partition_parameters nor accelerator.get_accelerator).
    used = deepspeed_names_in_transformers()
    assert used <= STAND_IN | set(TAKEN_INSTEAD), sorted(used - STAND_IN - set(TAKEN_INSTEAD))
    assert STAND_IN <= used  # the stand-in offers nothing transformers no longer reaches for
    with zero.Init():
        assert resolve("zero.GatheredParameters") is zero.GatheredParameters
        assert resolve("zero.register_external_parameter")(torch.nn.Linear(1, 1), None) is None
        for name in TAKEN_INSTEAD:  # reaching one fails and names it, rather than building DeepSpeed's way
            with pytest.raises(ModuleNotFoundError) as info:
                resolve(name)
            assert f"deepspeed.{name.split('.')[0]}" in str(info.value)


ENGINE_ONLY = """
import json, sys, torch, transformers, zero
config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)
torch.manual_seed(0)
transformers.GPT2LMHeadModel(config).save_pretrained(sys.argv[1])
plain = transformers.GPT2LMHeadModel.from_pretrained(sys.argv[1]).state_dict()
engine, _, _, _ = zero.initialize(model=transformers.GPT2LMHeadModel(config),
                                  config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
seen = transformers.integrations.is_deepspeed_zero3_enabled()
loaded = transformers.GPT2LMHeadModel.from_pretrained(sys.argv[1]).state_dict()
print(json.dumps({"seen": seen, "same": all(torch.equal(v, plain[k]) for k, v in loaded.items())}))
"""


def test_an_engine_alone_in_a_fresh_process_leaves_from_pretrained_working(tmp_path):
    # The first source of the process is an engine: it installs the hooks before transformers is told,
    # so from_pretrained loads whole on its own path instead of reaching for deepspeed.zero.Init.
    assert run_child(ENGINE_ONLY, str(tmp_path)) == {"seen": True, "same": True}
