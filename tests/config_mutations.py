"""Fuzzing the ZeRO config loader: real DeepSpeed configs, mutated at random.

Used by tests/test_zero_config_fuzz.py and bench/reliability/fuzzing.py. A mutated
config must either load or raise ConfigError (a ValueError naming the dotted
key); anything else (TypeError, KeyError, AttributeError, a bare pydantic
error, a hang) is a finding. Mutations: delete a key, replace a value with
junk of another type or an extreme value, misspell a key, add an unknown key;
for files also: cut the JSON short, flip a byte, duplicate a key.
"""
from __future__ import annotations

import copy
import json
import math
import os
import random
from dataclasses import dataclass
from typing import Any, List, Optional

if __package__:  # tests.config_mutations, imported by bench/reliability (run from the repository root)
    from .helpers import base_config
else:  # the tests' own import (pytest puts tests/ on sys.path)
    from helpers import base_config

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")

JUNK: List[Any] = [None, True, False, 0, -1, 1, 2**63, -(2**70), 0.5, -0.0, math.inf, -math.inf,
                   math.nan, 1e308, "", "auto", "none", "nvme", "cpu", "x" * 300, "1e9", "-5", [],
                   [1, "a"], {}, {"a": 1}, {"device": "nvme"}, "\0", "../../etc"]


def seed_configs() -> List[dict]:
    """The real-world configs in tests/data and the test suite's base configs."""
    configs = []
    for name in sorted(os.listdir(DATA)):
        if name.endswith(".json"):
            with open(os.path.join(DATA, name)) as f:
                configs.append(json.load(f))
    configs.append(base_config())
    configs.append(base_config("cpu", "nvme", "/tmp/nvme"))
    configs.append(base_config("nvme", "nvme", "/tmp/nvme", precision="bf16", accumulation=2))
    return configs


def _paths(node: Any, prefix: tuple = ()) -> List[tuple]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out.extend(_paths(v, prefix + (k,)))
    return out


def _typo(key: str, rng: random.Random) -> str:
    if len(key) < 2:
        return key + "_"
    i = rng.randrange(len(key) - 1)
    return rng.choice([key[:i] + key[i + 1] + key[i] + key[i + 2:], key[:i] + key[i + 1:],
                       key.upper(), key + "s", key.replace("_", "")])


def mutate(config: dict, rng: random.Random, count: int) -> tuple[dict, List[str]]:
    """``count`` random mutations of a copy of ``config``; returns it and what was done."""
    data = copy.deepcopy(config)
    done = []
    for _ in range(count):
        paths = _paths(data)
        if not paths:
            break
        path = rng.choice(paths)
        parent = data
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        action = rng.choice(["delete", "junk", "junk", "typo", "unknown"])
        where = ".".join(map(str, path))
        if action == "delete":
            del parent[key]
        elif action == "junk":
            parent[key] = copy.deepcopy(rng.choice(JUNK))
        elif action == "typo":
            parent[_typo(key, rng)] = parent.pop(key)
        else:
            parent[f"unknown_{rng.randrange(100)}"] = rng.choice(JUNK[:12])
        done.append(f"{action} {where}")
    return data, done


def mutate_text(text: str, rng: random.Random) -> tuple[str, str]:
    """A damaged JSON file: cut short, a byte flipped, or a key duplicated."""
    action = rng.choice(["cut", "flip", "duplicate"])
    if action == "cut":
        return text[:rng.randrange(len(text))], action
    if action == "flip":
        i = rng.randrange(len(text))
        return text[:i] + chr((ord(text[i]) + rng.randrange(1, 90)) % 127 or 1) + text[i + 1:], action
    i = text.index("{") + 1
    return text[:i] + '"train_batch_size": 1, "train_batch_size": 2,' + text[i:], action


@dataclass
class FuzzResult:
    cases: int = 0
    loaded: int = 0
    clear_errors: int = 0          # ConfigError with a message
    findings: Optional[List[str]] = None


def check_one(load_config, ConfigError, source: Any, world_size: int, hidden_size: Optional[int],
              what: str, result: FuzzResult) -> None:
    import warnings

    result.cases += 1
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_config(source, world_size=world_size, hidden_size=hidden_size)
        result.loaded += 1
    except ConfigError as e:
        if str(e).strip():
            result.clear_errors += 1
        else:
            result.findings.append(f"{what}: ConfigError without a message")
    except Exception as e:  # noqa: BLE001 - every other exception is what we look for
        result.findings.append(f"{what}: {type(e).__name__}: {str(e)[:200]}")


def fuzz(cases: int, seed: int, scratch: str) -> FuzzResult:
    """``cases`` mutated dicts and cases // 4 damaged files (written under ``scratch``)."""
    from zero.config import ConfigError, load_config

    rng = random.Random(seed)
    seeds = seed_configs()
    result = FuzzResult(findings=[])
    for i in range(cases):
        data, done = mutate(rng.choice(seeds), rng, rng.randint(1, 3))
        world_size = rng.choice([1, 2, 4, 8])
        hidden_size = rng.choice([None, None, 64, 4096])
        check_one(load_config, ConfigError, data, world_size, hidden_size,
                  f"case {i} ({'; '.join(done)}; world_size={world_size})", result)
    for i in range(cases // 4):
        text, action = mutate_text(json.dumps(rng.choice(seeds), indent=1), rng)
        path = os.path.join(scratch, f"fuzz_{i}.json")
        with open(path, "w") as f:
            f.write(text)
        check_one(load_config, ConfigError, path, 1, None, f"file {i} ({action})", result)
        os.unlink(path)
    return result
