"""The memory estimator: its table, its sizes read from a (partitioned) model, and its terms."""
import pytest

import zero
from zero.stores.estimator import GB, estimate_zero3, model_sizes
from zero.examples import GPT, GPTConfig

CFG = GPTConfig()


def expected_sizes():
    d, v, s = CFG.d_model, CFG.vocab, CFG.seq
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    total = v * d + s * d + CFG.layers * block + 2 * d  # head tied to wte
    largest = max(v * d, 4 * d * d + 4 * d)
    return total, largest


def test_sizes_are_read_from_plain_and_partitioned_models():
    assert model_sizes(GPT(CFG)) == expected_sizes()
    with zero.Init():
        partitioned = GPT(CFG)
    assert model_sizes(partitioned) == expected_sizes()


def test_the_table_has_every_offload_combination(capsys):
    rows = zero.estimate_zero3_model_states_mem_needs_all_live(GPT(CFG), num_gpus_per_node=2)
    out = capsys.readouterr().out.splitlines()
    total, largest = expected_sizes()
    assert out[:4] == [
        "Estimated memory needed for params, optim states and gradients for a:",
        "HW: Setup with 1 node, 2 GPUs per node.",
        f"SW: Model with {int(total / 1e6)}M total params, {int(largest / 1e6)}M largest layer params.",
        "  per CPU  |  per GPU |  per NVMe |   Options",
    ]
    assert len(rows) == 18 and len(out) == 4 + 18 + 1
    assert {(r.offload_param, r.offload_optimizer, r.zero_init) for r in rows} == {
        (p, o, z) for p in ("none", "cpu", "nvme") for o in ("none", "cpu", "nvme") for z in (True, False)}
    first = rows[0]
    assert out[4] == (f"  {first.cpu_bytes / GB:7.2f}GB | {first.gpu_bytes / GB:6.2f}GB | "
                      f"{first.nvme_bytes / GB:7.2f}GB | offload_param=none, offload_optimizer=none, zero_init=1")


@pytest.mark.parametrize("param,opt", [("none", "none"), ("cpu", "cpu"), ("nvme", "nvme"), ("nvme", "cpu")])
def test_terms(param, opt):
    P, L, R, N = 8_000_000_000, 100_000_000, 4, 2
    W = R * N
    shard = P / W
    e = estimate_zero3(P, L, param, opt, True, R, N, additional_buffer_factor=1.0, sub_group_size=10 ** 8)
    gpu = 4 * L + (2 * shard if param == "none" else 0) + (16 * shard if opt == "none" else 0)
    cpu_rank = (2 * shard if param == "cpu" else 0) + (16 * shard if opt == "cpu" else 0)
    cpu_rank += 5 * 2 * (L // W) if param == "nvme" else 0  # pinned parameter buffers
    cpu_rank += 16 * 10 ** 8 if opt == "nvme" else 0  # one pinned optimizer sub-group with its gradient
    cpu_rank += 2 * 4 * 10 ** 8 if opt == "nvme" else 0  # two sub-group gradients being filled
    # gradients go to NVMe with the optimizer states, sub-group by sub-group
    nvme_rank = (2 * shard if param == "nvme" else 0) + (16 * shard if opt == "nvme" else 0)
    assert e.gpu_bytes == pytest.approx(gpu)
    assert e.cpu_bytes == pytest.approx(cpu_rank * R)
    assert e.nvme_bytes == pytest.approx(nvme_rank * R)
    cold = estimate_zero3(P, L, param, opt, False, R, N, additional_buffer_factor=1.0, sub_group_size=10 ** 8)
    assert cold.cpu_bytes == pytest.approx(max(cpu_rank * R, 4 * P * R))


@pytest.mark.parametrize("opt", ["nvme", "cpu"])
def test_fp32_parameters_on_nvme_take_no_bytes_beside_an_nvme_master(opt):
    P, L = 1_000_000_000, 10_000_000
    e = estimate_zero3(P, L, "nvme", opt, bytes_per_param=4, additional_buffer_factor=1.0)
    assert e.nvme_bytes == pytest.approx(16 * P if opt == "nvme" else 4 * P)


# -- stage 2: DeepSpeed's documented formula and table -------------------------------------------

def test_zero2_cold_prints_deepspeeds_documented_table(capsys):
    # DeepSpeed's "Memory Requirements" page: estimate_zero2_model_states_mem_needs_all_cold(
    # total_params=2851e6, num_gpus_per_node=8, num_nodes=1) prints these lines.
    rows = zero.estimate_zero2_model_states_mem_needs_all_cold(total_params=2851e6, num_gpus_per_node=8,
                                                               num_nodes=1)
    assert capsys.readouterr().out.splitlines() == [
        "Estimated memory needed for params, optim states and gradients for a:",
        "HW: Setup with 1 node, 8 GPUs per node.",
        "SW: Model with 2851M total params.",
        "  per CPU  |  per GPU |   Options",
        "  127.45GB |   5.31GB | offload_optimizer=cpu",
        "  127.45GB |  15.93GB | offload_optimizer=none",
    ]
    assert [(r.offload_optimizer, r.cpu_bytes, r.gpu_bytes) for r in rows] == [
        ("cpu", 136_848_000_000, 5_702_000_000),  # 2851e6·max(4·8, 16)·1.5 | 2·2851e6
        ("none", 136_848_000_000, 17_106_000_000),  # 2851e6·4·8·1.5 | 4·2851e6 + 16·2851e6/8
    ]


@pytest.mark.parametrize("gpus,nodes", [(1, 1), (4, 1), (2, 3)])
def test_zero2_formula_terms(gpus, nodes):
    P, f = 1_000_000_007, 1.5
    total_gpus = gpus * nodes
    assert zero.estimate_zero2_model_states_mem_needs(P, gpus, nodes, cpu_offload=True) == (
        int(P * max(4 * gpus, 16) * f), 2 * P)  # per CPU: the GPUs of one node
    assert zero.estimate_zero2_model_states_mem_needs(P, gpus, nodes, cpu_offload=False) == (
        int(P * 4 * gpus * f), 4 * P + int(16 * P / total_gpus))
    assert zero.estimate_zero2_model_states_mem_needs(P, gpus, nodes, False, additional_buffer_factor=1.0)[0] == \
        P * 4 * gpus


def test_zero2_live_reads_the_model_counting_a_tied_parameter_once(capsys):
    total, _ = expected_sizes()
    live = zero.estimate_zero2_model_states_mem_needs_all_live(GPT(CFG), num_gpus_per_node=2)
    out = capsys.readouterr().out
    assert live == zero.estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node=2)
    assert capsys.readouterr().out == out
    assert "HW: Setup with 1 node, 2 GPUs per node." in out


def test_the_estimators_are_exported_next_to_each_other():
    for name in ("estimate_zero2_model_states_mem_needs", "estimate_zero2_model_states_mem_needs_all_live",
                 "estimate_zero2_model_states_mem_needs_all_cold", "estimate_zero3_model_states_mem_needs_all_live",
                 "estimate_zero3_model_states_mem_needs_all_cold", "estimate_rank_bytes"):
        assert name in zero.__all__ and callable(getattr(zero, name))
