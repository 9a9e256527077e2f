"""The framework integrations are optional: importing the core (nvmeio, swapper, zero and
its engine) never imports transformers, accelerate or lightning."""
import json
import sys

from helpers import run_process

CODE = """
import json, sys
import nvmeio, swapper, zero
from zero import initialize, Init, GatheredParameters, get_fp32_state_dict_from_zero_checkpoint
import zero.engine.zero_engine, zero.demo, zero.partitioning.full_state_dict, zero.hf
print(json.dumps(sorted(m for m in ("transformers", "accelerate", "lightning", "pytorch_lightning")
                        if m in sys.modules)))
"""


def test_importing_the_core_imports_no_framework():
    out = run_process([sys.executable, "-c", CODE], timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == []
