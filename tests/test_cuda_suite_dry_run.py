"""The CUDA suite's dry check in CI: without a GPU its tests skip, so their references (plain torch,
the frameworks' own runs, the mixed-precision recipe) could rot unseen until a GPU is lent. Here
they run with the CPU as their device (``--cuda-suite-on-cpu``), where every comparison is exact;
on a machine with a GPU the suite runs for real instead (bench/gpu_check.py's tests stage)."""
import os
import re
import sys

import pytest
import torch

from helpers import run_process

HERE = os.path.dirname(os.path.abspath(__file__))
FILES = ("test_cuda_engine.py", "test_cuda_frameworks.py", "test_cuda_inference.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the CUDA suite runs on it, not on the CPU")
def test_the_cuda_suite_passes_on_the_cpu_with_nothing_skipped(tmp_path):
    r = run_process([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--cuda-suite-on-cpu",
                     "-o", "addopts=", *(os.path.join(HERE, f) for f in FILES)], timeout=900, cwd=str(tmp_path))
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    counts = dict((what, int(n)) for n, what in re.findall(r"(\d+) (passed|failed|skipped|error)", r.stdout))
    assert counts.get("passed", 0) >= 30 and set(counts) == {"passed"}, tail
