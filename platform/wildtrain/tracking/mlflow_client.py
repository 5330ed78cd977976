"""The one module that calls MLflow's client: every other module talks to MLflow through a
`Client` (open an experiment and a run, log to it, page through a search, end it, register a
model) or the functions beside it. MLflow is imported on first use, not with this module:
the CLI's start-up and the workers never pay for it (`engine.py` hides it from DeepSpeed).

Runs returned (`get_run`, `search_runs`) are MLflow's own `Run` objects, read by attribute
(`run.info.run_id`, `run.data.tags`); nothing outside this module names an MLflow type.
"""

from __future__ import annotations

import contextlib
import json
import os
import urllib.error
import urllib.request
from typing import Iterator, Optional, Sequence

# MLflow 3 opens an experiment in its GenAI view (traces, latency, "Detect issues") unless it
# is a model-training one: the kind the UI's own switch writes, set when wildtrain creates it.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"
# MLflow refuses more per `log_batch` request: metric points, params (whose values it caps
# at 6000 characters).
METRICS_PER_REQUEST = 1000
_PARAMS_PER_BATCH = 100
_PAGE_SIZE = 1000  # runs per search request: MLflow's own default
_DATASET_ATTEMPTS = 3
# How SQLite, PostgreSQL and MySQL name a broken unique key, through MLflow's SQL store.
_DUPLICATE_KEY = ("UNIQUE constraint failed", "UniqueViolation", "Duplicate entry")

Row = tuple[str, float, int, int]  # a metric point: key, value, milliseconds since the epoch, step


class TrackingError(RuntimeError):
    """The MLflow server is unreachable."""


class Refused(RuntimeError):
    """MLflow answered a request with an error (no such artifact, a bad request), for the
    callers that report it as their own."""


def quiet_mlflow() -> None:
    """No MLflow console output in this process unless the user asked for it: a progress
    bar per artifact download (the events a report reads) and the run's address when it
    ends, which the driver printed at its start. MLflow reads both at each call."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


def bound_requests(timeout_s: float) -> None:
    """Process-wide: each request fails after `timeout_s`, once, where MLflow's own retries
    (7, minutes in all) would hold its caller without a word. For the controller, whose
    buffer retries with its own backoff and records the outage."""
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(timeout_s)
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as response:
            if response.status == 200:
                return
            reason = f"HTTP {response.status}"
    except (urllib.error.URLError, OSError) as e:
        reason = str(getattr(e, "reason", e))
    raise TrackingError(
        f"tracking.uri: the MLflow server at {uri} is unreachable ({reason}); start the local one "
        "with `wildtrain up`, or point tracking.uri at yours"
    )


def run_url(uri: str, experiment_id: str, run_id: str) -> str:
    """The run's page. MLflow 3.17's UI shows every experiment in the view of its own switch
    (GenAI unless the browser chose otherwise) and ignores the experiment's kind tag: the
    address asks for the model-training view, which its links keep."""
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def is_transient(error: BaseException) -> bool:
    """Whether a failed request may succeed later (the server or network), rather than being
    refused for good (a bad request, a deleted run)."""
    import requests
    from mlflow.exceptions import MlflowException

    if isinstance(error, MlflowException):
        status = error.get_http_status_code()
        return status >= 500 or status == 429
    return isinstance(error, (OSError, requests.RequestException))


class Client:
    """MLflow's tracking and model-registry client at `uri`."""

    def __init__(self, uri: str) -> None:
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self._client = MlflowClient(uri)

    # Experiments and runs.

    def experiment_id(self, name: str) -> str:
        """The experiment's id; created, as a model-training one, if there is none. Two runs
        that start together may both create it: the one that loses finds the other's."""
        from mlflow.exceptions import MlflowException

        experiment = self._client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return self._client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: TRAINING_KIND})
        except MlflowException:
            experiment = self._client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return experiment.experiment_id

    def experiment_ids(self) -> list[str]:
        """Every experiment's id."""
        return [e.experiment_id for e in self._client.search_experiments()]

    def create_run(self, experiment_id: str, name: Optional[str], tags: dict[str, str]) -> str:
        return self._client.create_run(experiment_id, run_name=name, tags=tags).info.run_id

    def get_run(self, run_id: str):
        return self._client.get_run(run_id)

    def run_or_none(self, run_id: str):
        """The run, or None where MLflow has none of that id (or the id is not one)."""
        from mlflow.exceptions import MlflowException

        try:
            return self._client.get_run(run_id)
        except MlflowException:
            return None

    def search_runs(
        self,
        experiment_ids: Optional[Sequence[str]],
        query: str,
        newest_first: bool = False,
        page_size: int = _PAGE_SIZE,
    ) -> Iterator:
        """The runs matching `query` (MLflow's search syntax) in `experiment_ids` (None: in
        every experiment), by start time; read a page of `page_size` at a time, as the
        caller goes on (`next(...)` reads one page)."""
        ids = self.experiment_ids() if experiment_ids is None else list(experiment_ids)
        order = ["attributes.start_time DESC" if newest_first else "attributes.start_time ASC"]
        token = None
        while True:
            page = self._client.search_runs(ids, query, order_by=order, max_results=page_size, page_token=token)
            yield from page
            token = page.token
            if not token:
                return

    def set_running(self, run_id: str) -> None:
        """A run resumed: RUNNING again, and no longer ended."""
        self._client.update_run(run_id, status="RUNNING")

    def end_run(self, run_id: str, status: str, end_time_ms: Optional[int] = None) -> None:
        """FINISHED, FAILED or KILLED, at `end_time_ms` (default: now)."""
        self._client.set_terminated(run_id, status=status, end_time=end_time_ms)

    # Logging.

    def log_metrics(self, run_id: str, rows: Sequence[Row]) -> None:
        from mlflow.entities import Metric

        for i in range(0, len(rows), METRICS_PER_REQUEST):
            self._client.log_batch(
                run_id,
                metrics=[Metric(key, value, at, step) for key, value, at, step in rows[i : i + METRICS_PER_REQUEST]],
            )

    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(key, value) for key, value in params.items()]
        for i in range(0, len(items), _PARAMS_PER_BATCH):
            self._client.log_batch(run_id, params=items[i : i + _PARAMS_PER_BATCH])

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self._client.set_tag(run_id, key, value)

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        """In one request: a reader sees all of them or none."""
        from mlflow.entities import RunTag

        self._client.log_batch(run_id, tags=[RunTag(key, value) for key, value in tags.items()])

    def log_text(self, run_id: str, text: str, path: str) -> None:
        self._client.log_text(run_id, text, path)

    def log_artifact(self, run_id: str, local_path: str, folder: str) -> None:
        self._client.log_artifact(run_id, local_path, folder)

    def log_datasets(self, run_id: str, datasets: Sequence[tuple[str, str, int]]) -> None:
        """Each (uri, manifest sha256, bad records its preparation skipped) as an MLflow dataset
        input: the UI shows what each run trained on, and runs on different data show different
        digests. MLflow keeps one input per dataset and digest, so a resubmission logs nothing new."""
        from mlflow.entities import Dataset, DatasetInput, InputTag
        from mlflow.exceptions import MlflowException

        inputs = [
            DatasetInput(
                Dataset(
                    name=uri,
                    digest=sha256[:16],
                    source_type="wildtrain-manifest",
                    source=f"{uri}/manifest.json",
                    profile=json.dumps({"bad_records": bad}),
                ),
                tags=[InputTag("mlflow.data.context", "training")],
            )
            for uri, sha256, bad in datasets
        ]
        for attempt in range(_DATASET_ATTEMPTS):
            try:
                self._client.log_inputs(run_id, datasets=inputs)
                return
            except MlflowException as e:
                # Runs that start together (a sweep's trials) record the same new dataset at
                # once, and MLflow's store checks, then inserts: the losers' insert breaks its
                # unique key. Logged again, MLflow finds the winner's row and links to it.
                if attempt + 1 == _DATASET_ATTEMPTS or not any(m in str(e) for m in _DUPLICATE_KEY):
                    raise

    # Reading.

    def metric_history(self, run_id: str, key: str) -> list:
        """Every point logged under `key`, as MLflow returns them (`.timestamp`, `.step`, `.value`)."""
        return self._client.get_metric_history(run_id, key)

    def has_artifacts(self, run_id: str, folder: str) -> bool:
        return bool(self._client.list_artifacts(run_id, folder))

    def download(self, run_id: str, path: str, folder: str) -> str:
        """The run's artifact (a file or folder) at `path`, copied under `folder`: its local
        path. `Refused` where the run has none there."""
        with _refusals():
            return self._client.download_artifacts(run_id, path, folder)

    # The model registry.

    def register_version(
        self, name: str, source: str, run_id: Optional[str], tags: dict[str, str], description: str
    ) -> str:
        """A new version of the registered model `name` (created if there is none; another
        caller may create it at the same time); its version number. `Refused` if MLflow refuses."""
        from mlflow.exceptions import MlflowException

        with _refusals():
            try:
                self._client.create_registered_model(name)
            except MlflowException as e:
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
            version = self._client.create_model_version(name, source, run_id=run_id, tags=tags, description=description)
        return str(version.version)


@contextlib.contextmanager
def _refusals() -> Iterator[None]:
    """MLflow's errors as `Refused`, with MLflow's message, for the callers that report them."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as e:
        raise Refused(e.message) from e
