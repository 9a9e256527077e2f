"""Mutated real-world DeepSpeed configs (tests/config_mutations.py): every one
either loads or raises ConfigError with a message, never another exception."""

from config_mutations import fuzz, mutate, seed_configs


def test_mutated_configs_load_or_raise_config_error(tmp_path):
    result = fuzz(cases=240, seed=14, scratch=str(tmp_path))
    assert result.findings == []
    assert result.cases == 300 and result.loaded + result.clear_errors == 300
    assert result.clear_errors > 0          # the mutations do reach the checks


def test_mutations_change_the_config_and_say_how():
    import random

    base = seed_configs()[0]
    data, done = mutate(base, random.Random(3), 2)
    assert data != base and len(done) == 2
    assert all(d.split()[0] in ("delete", "junk", "typo", "unknown") for d in done)
