"""nvmeio.host_sum.sum_series: the native in-order sum is bit-identical to torch's adds one
by one (fp32 and bf16 sources, mixed, with and without a first copy, sizes that split over
threads), other dtypes and layouts take torch's adds, and a size mismatch is refused."""
import pytest
import torch

from nvmeio.host_sum import sum_series


def torch_sum(init, sources, first):
    out = init.clone()
    if first is not None:
        out.copy_(first)
    for s in sources:
        out.add_(s)
    return out


def sources(n, dtypes, seed):
    g = torch.Generator().manual_seed(seed)
    # magnitudes 1e-3 .. 1e3, so that the order of the additions shows in the rounding
    return [(torch.randn(n, generator=g) * 10.0 ** (i % 7 - 3)).to(dt) for i, dt in enumerate(dtypes)]


@pytest.mark.parametrize("n", [1, 1000, 65536 * 2 + 17, 1 << 21])  # the last two split over threads
@pytest.mark.parametrize("dtypes", [[torch.bfloat16] * 6, [torch.float32] * 4,
                                    [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32]])
@pytest.mark.parametrize("with_first", [True, False])
def test_native_sum_equals_torch_adds_in_order(n, dtypes, with_first):
    parts = sources(n, dtypes, seed=n)
    init = torch.randn(n, generator=torch.Generator().manual_seed(1))
    first, rest = (parts[0], parts[1:]) if with_first else (None, parts)
    expected = torch_sum(init, rest, first)
    got = init.clone()
    sum_series(got, rest, first)
    assert torch.equal(got, expected)
    # reordered sources give a different sum: the test would see an order the native sum changed
    if not with_first and n >= 1000:
        assert not torch.equal(torch_sum(init, rest[::-1], None), expected)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_sum_does_not_depend_on_the_thread_count(threads):
    parts = sources(1 << 20, [torch.bfloat16] * 5, seed=3)
    expected = torch_sum(torch.zeros(1 << 20), parts[1:], parts[0])
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = torch.empty(1 << 20)
        sum_series(got, parts[1:], parts[0])
    finally:
        torch.set_num_threads(old)
    assert torch.equal(got, expected)


def test_other_dtypes_and_layouts_take_torchs_adds():
    fp16 = sources(5000, [torch.float16] * 3, seed=5)
    got = torch.zeros(5000)
    sum_series(got, fp16[1:], fp16[0])
    assert torch.equal(got, torch_sum(torch.zeros(5000), fp16[1:], fp16[0]))
    strided = torch.randn(2000)[::2]  # not contiguous
    got = torch.ones(1000)
    sum_series(got, [strided, strided])
    assert torch.equal(got, torch_sum(torch.ones(1000), [strided, strided], None))


def test_a_source_of_another_size_is_refused():
    with pytest.raises(ValueError, match="a source of 10 elements for a sum of 12"):
        sum_series(torch.zeros(12), [torch.zeros(12), torch.zeros(10)])
