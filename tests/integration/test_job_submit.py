"""The cluster path: the same tiny run sent with `ray job submit`, as the README shows."""

from __future__ import annotations

import subprocess
import uuid

import pytest
from ray.job_submission import JobStatus, JobSubmissionClient

from tests.conftest import REPO

pytestmark = pytest.mark.integration


def test_ray_job_submit_of_the_tiny_run_succeeds(ray_cluster, tiny_overrides):
    dashboard = f"http://{ray_cluster.webui_url}"
    submission_id = f"wildtrain-test-{uuid.uuid4().hex[:8]}"
    done = subprocess.run(
        [
            "ray", "job", "submit", "--address", dashboard, "--working-dir", str(REPO),
            "--submission-id", submission_id,
            "--", "python", "-m", "wildtrain", "train", *tiny_overrides, "train.steps=4",
        ],
        capture_output=True, text=True, timeout=480,
    )
    # The submit's own output first: where the submission itself failed ("No available agent
    # to submit job"), there is no job whose status could say why.
    output = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, output
    assert JobSubmissionClient(dashboard).get_job_status(submission_id) == JobStatus.SUCCEEDED, output
    assert "step 4/4" in done.stdout
    assert "finished" in done.stdout
