"""`tracking.mlflow_client`: the one module that calls MLflow, against a real store (SQLite,
no server)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import wildtrain
from wildtrain.tracking.mlflow_client import Client, Refused

_CLIENT_MODULE = Path("tracking", "mlflow_client.py")


def _mlflow_imports(source: str) -> list[int]:
    """The lines of `source` that import MLflow, at the top or inside a function."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        names = (
            [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and node.level == 0
            else []
        )
        if any(name == "mlflow" or name.startswith("mlflow.") for name in names):
            lines.append(node.lineno)
    return lines


def test_no_module_but_the_client_imports_mlflow():
    for caught in (
        "from mlflow.tracking import MlflowClient",
        "import mlflow",
        "def f():\n    from mlflow.exceptions import MlflowException",
        "import os, mlflow.entities",
    ):
        assert _mlflow_imports(caught), caught  # what the scan is for
    assert not _mlflow_imports("from wildtrain.tracking.mlflow_client import Client\nimport mlflow_like")
    package = Path(wildtrain.__file__).parent
    found = [
        f"{path.relative_to(package)}:{line}"
        for path in sorted(package.rglob("*.py"))
        if path.relative_to(package) != _CLIENT_MODULE
        for line in _mlflow_imports(path.read_text())
    ]
    assert found == [], "call MLflow through tracking.mlflow_client"


def test_the_cli_the_reports_and_the_sweeps_load_mlflow_only_when_they_call_it():
    # A command that fails on its input, and a worker, must not wait for MLflow to import.
    modules = [
        "wildtrain.cli",
        "wildtrain.tracking.mlflow_client",
        "wildtrain.tracking.record",
        "wildtrain.tracking.run_setup",
        "wildtrain.tracking.reports.runs",
        "wildtrain.sweeps.report",
        "wildtrain.tracking.worker.stragglers",
    ]
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint('mlflow' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


@pytest.fixture
def client(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root of a new experiment: ./mlruns
    return Client(f"sqlite:///{tmp_path / 'mlflow.db'}")


def test_a_search_reads_every_page_oldest_first_and_newest_first_reads_one_page(client):
    experiment = client.experiment_id("pages")
    other = client.experiment_id("elsewhere")
    runs = [client.create_run(experiment, f"r{i}", {"kind": "wanted" if i != 2 else "other"}) for i in range(6)]
    client.create_run(other, "r6", {"kind": "wanted"})

    found = [run.info.run_id for run in client.search_runs([experiment], "tags.kind = 'wanted'", page_size=2)]
    assert found == [runs[i] for i in (0, 1, 3, 4, 5)]  # three pages, in start order
    everywhere = client.search_runs(None, "tags.kind = 'wanted'", page_size=2)
    assert len(list(everywhere)) == 6
    assert (
        next(client.search_runs(None, "attributes.run_name = 'r4'", newest_first=True, page_size=1)).info.run_id
        == runs[4]
    )


def test_an_experiment_is_created_once_and_found_after(client):
    first = client.experiment_id("once")
    assert Client(client.uri).experiment_id("once") == first
    assert client.experiment_ids().count(first) == 1


def test_params_beyond_one_request_and_metric_points_beyond_one_request_are_all_logged(client):
    run_id = client.create_run(client.experiment_id("big"), "big", {})
    client.log_params(run_id, {f"p{i}": str(i) for i in range(250)})
    client.log_metrics(run_id, [("loss", float(step), 1000 * step, step) for step in range(2500)])
    run = client.get_run(run_id)
    assert len(run.data.params) == 250 and run.data.params["p249"] == "249"
    assert [m.step for m in sorted(client.metric_history(run_id, "loss"), key=lambda m: m.step)] == list(range(2500))


def test_ending_a_run_and_running_it_again(client):
    run_id = client.create_run(client.experiment_id("ends"), "ends", {})
    client.end_run(run_id, "FAILED", end_time_ms=5000)
    assert (client.get_run(run_id).info.status, client.get_run(run_id).info.end_time) == ("FAILED", 5000)
    client.set_running(run_id)
    assert client.get_run(run_id).info.status == "RUNNING"
    assert client.run_or_none("no-such-run") is None


def test_an_artifact_is_downloaded_and_a_missing_one_is_refused_with_mlflows_reason(client, tmp_path):
    run_id = client.create_run(client.experiment_id("files"), "files", {})
    client.log_text(run_id, "a: 1\n", "config.yaml")
    assert client.has_artifacts(run_id, "") and not client.has_artifacts(run_id, "events")
    assert Path(client.download(run_id, "config.yaml", str(tmp_path))).read_text() == "a: 1\n"
    with pytest.raises(Refused, match="events"):
        client.download(run_id, "events", str(tmp_path))
