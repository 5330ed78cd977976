"""Talking to one cluster's jobs API with its own token: every request carries the token of
the cluster it goes to (read from the registry's token_file), so one process can address
several clusters, each with another token. Every failure is one `ClusterError` line."""

from __future__ import annotations

import contextlib
import json
import os
import urllib.error
import urllib.request

from wildtrain.clusters.registry import Cluster
from wildtrain.config import redact


class ClusterError(RuntimeError):
    """A cluster that cannot be used as asked; one line naming the cluster and what to do."""


def auth_headers(cluster: Cluster) -> dict[str, str]:
    path = cluster.token_file
    token = path.read_text().strip() if path.is_file() else ""
    if not token:
        what = "is empty" if path.is_file() else "does not exist"
        raise ClusterError(
            f"{cluster.name}: no token: {cluster.key}.token_file {path} {what}; copy the cluster's token "
            f"(`ray get-auth-token` on its head) there"
        )
    return {"Authorization": f"Bearer {token}"}


def ray_version(cluster: Cluster, timeout_s: float = 10.0) -> str:
    """The cluster's Ray version, asked with its token: proves the jobs API answers and takes it."""
    address = cluster.entry.jobs_api.rstrip("/")
    request = urllib.request.Request(f"{address}/api/version", headers=auth_headers(cluster))
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())["ray_version"]
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise ClusterError(f"{cluster.name}: {redact(address)} refused the request: it requires a token") from None
        if e.code == 403:
            raise ClusterError(
                f"{cluster.name}: {redact(address)} refused the token in "
                f"{cluster.token_file}: wrong token for this cluster"
            ) from None
        raise ClusterError(f"{cluster.name}: {redact(address)} answered HTTP {e.code}") from None
    except (OSError, ValueError, KeyError) as e:
        reason = getattr(e, "reason", e)
        raise ClusterError(
            f"{cluster.name}: jobs API {redact(address)} unreachable ({reason}); is the tunnel "
            f"or port-forward to its head running?"
        ) from None


def client(cluster: Cluster):
    """A JobSubmissionClient for the cluster, once its jobs API has taken the token."""
    from ray.job_submission import JobSubmissionClient

    ray_version(cluster)
    with _address_as_given():
        return JobSubmissionClient(cluster.entry.jobs_api, headers=auth_headers(cluster))


# Read by JobSubmissionClient in place of the address it is given.
_ADDRESS_OVERRIDES = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")


@contextlib.contextmanager
def _address_as_given():
    """JobSubmissionClient takes $RAY_API_SERVER_ADDRESS or $RAY_ADDRESS over the address it is
    given, and a shell on a head node has RAY_ADDRESS set: the job would go to that cluster,
    with this one's token. The registry's address must win."""
    saved = {name: os.environ.pop(name) for name in _ADDRESS_OVERRIDES if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)
