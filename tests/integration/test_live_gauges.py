"""A worker's live numbers reach Ray's Prometheus endpoint, the Ray dashboard's source: a
head of its own with Ray's metrics on (the shared drills' cluster runs without them, see
tests/helpers/ray_clusters.py), and two actors that set them as two ranks' monitors do."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest
import ray

from tests.helpers.ray_clusters import start_cluster
from wildtrain.train.monitor import LiveGauges

pytestmark = [pytest.mark.integration, pytest.mark.standalone]


@pytest.fixture
def metrics_cluster(monkeypatch):
    # A process that joined the shared cluster before (`make test` runs the untimed tests on
    # the shared services in this test's process) joins it again after.
    joined = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    ray.shutdown()
    cluster = start_cluster(monkeypatch.setenv, num_cpus=2, metrics=True)
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    if joined:
        ray.init(address=joined)


def gauges(port: int, name: str, run: str) -> dict[str, float]:
    """rank → value of the gauge `name` of the run, as Ray's Prometheus endpoint shows it now."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    values = {}
    for labels, value in re.findall(rf"^ray_{name}\{{(.*?)\}} (\S+)$", text, re.MULTILINE):
        tags = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if tags.get("run") == run:
            values[tags["rank"]] = float(value)
    return values


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, run: str, rank: int) -> None:
        self.live = LiveGauges(run, rank)

    def report(self, metrics: dict) -> None:
        self.live.set(metrics)


def test_each_ranks_live_numbers_reach_rays_metrics_endpoint_as_their_own_series(metrics_cluster):
    ranks = [Rank.remote("live-run", rank) for rank in range(2)]
    ray.get(
        [
            r.report.remote({"loss": 2.5 + rank, "tokens_per_s": 1000.0, "not_exported": 1.0})
            for rank, r in enumerate(ranks)
        ]
    )
    port = metrics_cluster.head_node.metrics_export_port
    deadline = time.monotonic() + 60
    while (losses := gauges(port, "wildtrain_loss", "live-run")) != {"0": 2.5, "1": 3.5}:
        assert time.monotonic() < deadline, f"Ray's metrics endpoint shows the ranks' losses as {losses}"
        time.sleep(0.5)
    assert gauges(port, "wildtrain_tokens_per_s", "live-run") == {"0": 1000.0, "1": 1000.0}
    # A newer report replaces the number: a gauge, not a sum.
    ray.get(ranks[1].report.remote({"loss": 1.25}))
    while (losses := gauges(port, "wildtrain_loss", "live-run")) != {"0": 2.5, "1": 1.25}:
        assert time.monotonic() < deadline, f"rank 1's newer loss is not shown: {losses}"
        time.sleep(0.5)
    assert not gauges(port, "wildtrain_not_exported", "live-run")
