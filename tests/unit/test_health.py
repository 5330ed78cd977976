import torch

from wildtrain.train.health import RankHealth, judge, measure_matmul, nodes_to_exclude


def test_a_rank_far_below_the_median_fails_the_matmul_check():
    ranks = [RankHealth(0, "n0", 100e9), RankHealth(1, "n1", 95e9), RankHealth(2, "n2", 30e9)]
    events = judge(ranks, allreduce_gb_per_s=2.5, min_ratio=0.5, at=1.0)
    matmul = {e["rank"]: e for e in events if e["check"] == "matmul"}
    assert [matmul[r]["passed"] for r in range(3)] == [True, True, False]
    assert matmul[2]["node"] == "n2" and "0.32x the group median" in matmul[2]["detail"]
    (allreduce,) = [e for e in events if e["check"] == "allreduce"]
    assert allreduce["passed"] and "2.50 GB/s" in allreduce["detail"]


def test_matmul_rate_is_positive_and_a_drill_slows_it():
    device = torch.device("cpu")
    fast = measure_matmul(device)
    slow = measure_matmul(device, extra_s=0.05)
    assert fast > 0 and slow < fast


def _matmul(node: str, passed: bool, rank: int = 0) -> dict:
    return {"event": "health", "check": "matmul", "rank": rank, "node": node, "passed": passed}


def test_the_nodes_of_failed_ranks_are_excluded_while_enough_ranks_remain():
    events = [_matmul("a", True, 0), _matmul("b", False, 1), _matmul("b", False, 2), _matmul("c", True, 3),
              {"event": "health", "check": "allreduce", "rank": -1, "node": "group", "passed": True}]
    assert nodes_to_exclude(events, min_workers=2) == ["b"]
    assert nodes_to_exclude(events, min_workers=3) == [], "leaving b out would leave 2 ranks, fewer than 3"
    assert nodes_to_exclude([_matmul("a", True), _matmul("c", True, 1)], min_workers=1) == []
