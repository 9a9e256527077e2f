"""Under gloo, Comm's reduce-scatter and all-gather of host tensors exchange slices point to point
(zero/runtime/_slice_exchange.py): the results are gloo's own collectives' (three ranks, so the
sum of more than two contributions is taken too, in rank order; and in a group of two of them,
whose ranks are not the global ones), synchronous or waited for, for float32 and bfloat16."""
import pytest
import torch
import torch.distributed as dist

from helpers import run_ranks
from zero.runtime.comm import Comm

WORLD = 3


def _values(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(n, generator=g) * 10 ** rank).to(dtype)  # magnitudes apart: the order shows


def _check(comm: Comm, ranks: list, group, dtype: torch.dtype, async_op: bool) -> dict:
    world = len(ranks)
    me = ranks.index(dist.get_rank())
    n = 1001
    contributions = [_values(r, world * n, dtype) for r in ranks]
    shard = torch.empty(n, dtype=dtype)
    full = contributions[me].clone()
    work = comm.reduce_scatter(shard, full, async_op=async_op)
    if async_op:
        work.wait()
    expected = contributions[0][me * n:(me + 1) * n].clone()
    for c in contributions[1:]:
        expected += c[me * n:(me + 1) * n]
    gathered = torch.empty(world * n, dtype=dtype)
    work = comm.all_gather_into(gathered, shard, async_op=async_op)
    if async_op:
        work.wait()
    reference = torch.empty(world * n, dtype=dtype)
    dist.all_gather_into_tensor(reference, shard, group=group)
    untouched = torch.equal(full, contributions[me])  # what it sent was read, never written
    return {"sum": torch.equal(shard, expected), "gather": torch.equal(gathered, reference),
            "sent_untouched": untouched, "exchanged": comm._exchange is not None}


def scenario_exchange(rank, world_size, scratch):
    out = {}
    groups = {"world": (list(range(world_size)), None), "pair": ([0, 2], dist.new_group([0, 2]))}
    for name, (ranks, group) in groups.items():
        if rank not in ranks:
            continue
        comm = Comm(rank=ranks.index(rank), world_size=len(ranks), group=group, backend="gloo")
        for dtype in (torch.float32, torch.bfloat16):
            for async_op in (False, True):
                out[f"{name}-{dtype}-{async_op}"] = _check(comm, ranks, group, dtype, async_op)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(WORLD, [("exchange", scenario_exchange, {})], tmp_path_factory.mktemp("exchange"))


def test_the_exchange_gives_the_rank_order_sum_and_gloos_gather(ranks):
    for rank in range(WORLD):
        got = ranks[rank]["exchange"]
        assert "error" not in got, got.get("error")
        assert len(got) == (8 if rank in (0, 2) else 4)
        for case, result in got.items():
            assert result == {"sum": True, "gather": True, "sent_untouched": True, "exchanged": True}, (rank, case)
