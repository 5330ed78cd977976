"""`wildtrain clusters check NAME`: can a run go there? The jobs API answers with the
cluster's token, its Ray is ours, its stores answer, and what its report card says."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import ray

from wildtrain import storage
from wildtrain.clusters import jobs_api
from wildtrain.clusters.registry import Cluster


@dataclass(frozen=True)
class Finding:
    what: str
    ok: bool
    detail: str


def check(cluster: Cluster, tracking_uri: str) -> list[Finding]:
    findings = []
    try:
        version = jobs_api.ray_version(cluster)
        findings.append(Finding("jobs API", True, f"{cluster.entry.jobs_api} took the token"))
        findings.append(
            Finding(
                "Ray version",
                version == ray.__version__,
                f"cluster {version}, here {ray.__version__}"
                + (
                    ""
                    if version == ray.__version__
                    else ": version mismatch; jobs would fail to unpickle across versions"
                ),
            )
        )
    except jobs_api.ClusterError as e:
        findings.append(Finding("jobs API", False, str(e)))
    for kind in ("runs", "data"):
        uri = getattr(cluster.entry.storage, kind)
        findings.append(
            _attempt(f"storage {kind}", lambda uri=uri: storage.probe(uri, cluster.entry.storage), f"{uri} answers")
        )
    findings.append(_report_card(cluster, tracking_uri))
    return findings


def _attempt(what: str, action: Callable[[], None], success: str) -> Finding:
    try:
        action()
    except OSError as e:
        return Finding(what, False, str(e))
    return Finding(what, True, success)


def _report_card(cluster: Cluster, tracking_uri: str) -> Finding:
    from wildtrain.tracking.mlflow_client import TrackingError, check_reachable
    from wildtrain.tracking.reports import runs as report

    try:
        check_reachable(tracking_uri)
        return Finding("report card", True, report.report_cluster(tracking_uri, cluster.name).rstrip())
    except TrackingError as e:
        return Finding("report card", False, str(e))
