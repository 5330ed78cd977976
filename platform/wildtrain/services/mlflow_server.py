"""The local MLflow tracking server: SQLite for runs, a folder for artifacts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from wildtrain.services.process import HOST, ServiceError, private_dir, stop_process, wait_healthy

# MLflow's server starts a job runner with eight Huey consumer processes for its GenAI jobs
# (LLM judges, trace roll-ups), which wildtrain never submits: each imports MLflow, which
# costs CPU at every start and memory for as long as the server runs (docs/benchmarks.md).
MLFLOW_SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def start_mlflow(root: Path, port: int, timeout_s: float = 120.0) -> subprocess.Popen:
    """An MLflow tracking server on 127.0.0.1:`port`, storing runs in `root`."""
    root = private_dir(root.resolve())
    log = root / "mlflow.log"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            HOST,
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination",
            str(root / "artifacts"),
        ],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # outlives the shell that ran `wildtrain up`
        env={**os.environ, **MLFLOW_SERVER_ENV},
    )
    try:
        wait_healthy(f"http://{HOST}:{port}/health", process, log, timeout_s)
    except ServiceError:
        stop_process(process.pid)  # a server that came up late must not outlive the error
        raise
    return process
