import torch

from wildtrain.events import HealthCheck
from wildtrain.train import health
from wildtrain.train.health import RankHealth, burst_for, judge, measure_allreduce, measure_matmul, nodes_to_exclude


def test_a_rank_far_below_the_median_fails_the_matmul_check():
    ranks = [RankHealth(0, "n0", 100e9), RankHealth(1, "n1", 95e9), RankHealth(2, "n2", 30e9)]
    events = judge(ranks, allreduce_gb_per_s=2.5, min_ratio=0.5, at=1.0)
    matmul = {e.rank: e for e in events if e.check == "matmul"}
    assert [matmul[r].passed for r in range(3)] == [True, True, False]
    assert matmul[2].node == "n2" and "0.32x the group median" in matmul[2].detail
    (allreduce,) = [e for e in events if e.check == "allreduce"]
    assert allreduce.passed and "2.50 GB/s" in allreduce.detail


def test_matmul_rate_is_positive_and_a_drill_slows_it():
    device = torch.device("cpu")
    assert measure_matmul(device) > 0
    # The drill sleeps 0.05 s per matmul: at most one matmul per 0.05 s however loaded the
    # machine is (a comparison with an unslowed rate failed in CI beside the drills), and far
    # below what this CPU does unslowed (hundreds of GFLOP/s at this size).
    matmul_flop = 2 * burst_for("cpu").matmul_size ** 3
    assert measure_matmul(device, extra_s=0.05) <= matmul_flop / 0.05


def _matmul(node: str, passed: bool, rank: int = 0) -> dict:
    return HealthCheck(1.0, "matmul", rank, node, passed, detail="")


def test_the_nodes_of_failed_ranks_are_excluded_while_enough_ranks_remain():
    events = [
        _matmul("a", True, 0),
        _matmul("b", False, 1),
        _matmul("b", False, 2),
        _matmul("c", True, 3),
        HealthCheck(1.0, "allreduce", -1, "group", True, detail=""),
    ]
    assert nodes_to_exclude(events, min_workers=2) == ["b"]
    assert nodes_to_exclude(events, min_workers=3) == [], "leaving b out would leave 2 ranks, fewer than 3"
    assert nodes_to_exclude([_matmul("a", True), _matmul("c", True, 1)], min_workers=1) == []


def test_the_burst_is_sized_for_the_device():
    gpu, cpu = burst_for("cuda"), burst_for("cpu")
    assert gpu.dtype == torch.bfloat16 and cpu.dtype == torch.float32
    # 100 ms of matmuls on either; on a GPU each is big enough to be more than launch jitter.
    assert gpu.budget_s == cpu.budget_s == 0.1
    assert 2 * gpu.matmul_size**3 >= 1e12
    # The GPU's all-reduce measures bus bandwidth (NCCL saturates past tens of MB); the CPU's stays short.
    assert gpu.allreduce_bytes >= 64 << 20 > cpu.allreduce_bytes


class _Clock:
    """Time that passes only in the drill's per-matmul sleep, so the count of matmuls the
    burst runs is exact and no load on the machine can change it."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_the_matmul_burst_runs_for_its_time_budget_and_stops_within_one_matmul(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(health, "time", clock)
    # Each matmul "takes" 0.25 s: one to measure the rate, then a chunk of 7 fills the 2 s.
    flops = measure_matmul(torch.device("cpu"), extra_s=0.25, budget_s=2.0)
    assert clock.now == 2.0
    assert flops == 8 * 2.0 * burst_for("cpu").matmul_size ** 3 / 2.0


def test_the_allreduce_without_a_group_is_a_group_of_one():
    assert measure_allreduce(torch.device("cpu")) == 0.0
