"""Two local "clusters", each a Ray head with its own ports, token and bucket, in a registry
of this test: checking them, and submitting to them with the right and the wrong token."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from ray.job_submission import JobStatus, JobSubmissionClient

from tests.conftest import REPO
from wildtrain import services
from wildtrain.clusters import jobs_api, registry
from wildtrain.clusters.submit import submit

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def two_clusters(tmp_path_factory, object_store, mlflow_url):
    """Heads a and b (1 CPU each, every port free, each its own token), a registry naming them, and token files:
    each cluster's own, and b's token filed for a (the wrong one)."""
    root = tmp_path_factory.mktemp("clusters")
    # This process and the `wildtrain` it runs reach the store with its keys, as a user's shell would.
    os.environ.update(object_store.env())
    heads, entries = [], {}
    tokens = {name: secrets.token_hex(16) for name in ("a", "b")}
    try:
        # Each cluster its own part of the store: a the bucket's root, b its cluster-b/ prefix.
        for name, bucket in (("a", object_store.bucket), ("b", f"{object_store.bucket}/cluster-b")):
            ports = services.RayPorts(gcs=None, dashboard=None).chosen()
            temp_dir = Path(tempfile.mkdtemp(prefix=f"wt-{name}-"))
            heads.append((temp_dir, services.start_ray_head(
                ports, 1, temp_dir, env={"RAY_AUTH_TOKEN": tokens[name], **object_store.env()})))
            (root / f"{name}.token").write_text(tokens[name])
            entries[name] = {
                "provider": "local", "launcher": str(REPO / "ray_clusters/local-dev.yaml"),
                "jobs_api": f"http://{services.HOST}:{ports.dashboard}", "token_file": f"{name}.token",
                "storage": {"runs": f"s3://{bucket}/runs", "data": f"s3://{bucket}/datasets",
                            "endpoint": object_store.endpoint},
                "hotfix": {"env": {"WILDTRAIN_HOTFIX": name}},
            }
        entries["a-wrong-token"] = {**entries["a"], "token_file": "b.token"}
        entries["a-no-token"] = {**entries["a"], "token_file": "missing.token"}
        entries["nowhere"] = {**entries["a"], "jobs_api": f"http://{services.HOST}:{services.free_port()}"}
        path = root / "clusters.yaml"
        path.write_text(yaml.safe_dump({"clusters": entries}))
        yield registry.load(path)
    finally:
        for temp_dir, address in heads:
            services.stop_ray_head(temp_dir, address)


def wildtrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wildtrain", *args], capture_output=True, text=True, timeout=120)


def test_check_passes_on_each_cluster_and_names_each_fault_in_one_line(two_clusters, mlflow_url):
    for name in ("a", "b"):
        done = wildtrain("clusters", "--registry", str(two_clusters.path), "check", name, "--tracking-uri", mlflow_url)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "ok   jobs API" in done.stdout and "ok   Ray version" in done.stdout
        assert f"ok   report card: cluster {name}: 0 runs" in done.stdout
    expected = {
        "a-wrong-token": "refused the token in", "a-no-token": "no token: clusters.a-no-token.token_file",
        "nowhere": "unreachable",
    }
    for name, message in expected.items():
        done = wildtrain("clusters", "--registry", str(two_clusters.path), "check", name, "--tracking-uri", mlflow_url)
        assert done.returncode == 1
        (line,) = [line for line in done.stdout.splitlines() if line.startswith("FAIL jobs API")]
        assert message in line, done.stdout
        assert "Traceback" not in done.stdout + done.stderr
        assert secrets_in(two_clusters).isdisjoint(done.stdout.split()), "a token was printed"


def secrets_in(reg) -> set[str]:
    return {c.token_file.read_text().strip() for c in reg.clusters.values() if c.token_file.is_file()}


def test_submit_runs_the_train_command_with_the_clusters_settings_and_refuses_a_wrong_token(two_clusters, tmp_path):
    b = two_clusters.get("b")
    # Data that is not there: the job must get as far as the driver's data check on b's
    # store, and no further (a training run here would cost a minute of this machine).
    submitted = submit(b, ["experiment=tiny", "run.name=moved-nowhere", "data.datasets=[{uri: s3://wildtrain-test/cluster-b/none}]"],
                       working_dir=REPO)
    client = JobSubmissionClient(b.entry.jobs_api, headers=jobs_api.auth_headers(b))
    info = client.get_job_info(submitted.job_id)
    assert "python -m wildtrain train cluster=local cluster.name=b run.storage=s3://wildtrain-test/cluster-b/runs" in info.entrypoint
    assert info.entrypoint.endswith("run.name=moved-nowhere")
    assert info.runtime_env["env_vars"] == {"WILDTRAIN_HOTFIX": "b"}
    logs = []
    with pytest.raises(jobs_api.ClusterError, match=r"^b: job wildtrain-moved-nowhere-\w{8} ended FAILED$"):
        submit(b, ["experiment=tiny", "run.name=moved-nowhere", "data.datasets=[{uri: s3://wildtrain-test/cluster-b/none}]"],
               working_dir=REPO, follow=logs.append)
    assert "s3://wildtrain-test/cluster-b/none" in "".join(logs) and "Traceback" not in "".join(logs)
    assert client.get_job_status(submitted.job_id) in (JobStatus.FAILED, JobStatus.RUNNING, JobStatus.PENDING)

    done = wildtrain("submit", "--cluster", "a-wrong-token", "--registry", str(two_clusters.path), "experiment=tiny")
    assert done.returncode == 1
    assert done.stderr.strip().startswith("wildtrain: a-wrong-token: http://127.0.0.1:")
    assert "wrong token for this cluster" in done.stderr and len(done.stderr.strip().splitlines()) == 1
