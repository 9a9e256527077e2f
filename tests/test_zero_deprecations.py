"""A two-rank run (gloo) of the engine with its collectives and NVMe offload raises no
FutureWarning or DeprecationWarning from our own calls: torch 2.13 deprecates
all_gather_into_tensor / reduce_scatter_tensor, and every user's log would carry them."""
import os
import traceback
import warnings

from helpers import run_ranks, scenario_train

OURS = tuple(os.path.dirname(__import__(p).__file__) + os.sep for p in ("nvmeio", "swapper", "zero"))
LIBRARIES = tuple(os.path.dirname(m.__file__) for m in (os, __import__("torch"))) + ("typing_extensions",)


def _caller(stack) -> str:
    """The innermost frame outside torch and the standard library: whose call it was."""
    for frame in reversed(stack[:-1]):
        if not frame.filename.startswith(LIBRARIES) and "typing_extensions" not in frame.filename:
            return frame.filename
    return ""


def scenario_warnings(rank, world_size, scratch):
    ours, real_warn = [], warnings.warn

    def warn(message, category=UserWarning, stacklevel=1, *args, **kwargs):
        if isinstance(category, type) and issubclass(category, (FutureWarning, DeprecationWarning)):
            if _caller(traceback.extract_stack()).startswith(OURS):
                ours.append(f"{category.__name__}: {message}")
        return real_warn(message, category, stacklevel + 1, *args, **kwargs)

    warnings.warn = warn
    try:
        losses = scenario_train(rank, world_size, scratch, offload_param="nvme", offload_optimizer="nvme",
                                accumulation=2, steps=2)
    finally:
        warnings.warn = real_warn
    return {"losses": losses, "ours": ours}


def test_a_two_rank_run_warns_nothing_deprecated_from_our_calls(tmp_path):
    results = run_ranks(2, [("warn", scenario_warnings, {})], tmp_path)
    for rank, r in enumerate(results):
        assert "error" not in r["warn"], r["warn"].get("error")
        assert len(r["warn"]["losses"]) > 0, rank
        assert r["warn"]["ours"] == [], rank
