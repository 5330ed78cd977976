"""What a user sees first in the MLflow UI, checked the way a user looks: Debian's Chromium,
headless and driven by Selenium, on the session's MLflow server, at the address the driver
prints for a finished run that wildtrain's own code created and logged. The screenshots are
kept as artifacts of that run (ui/)."""

from __future__ import annotations

import re
import shutil
import time
import uuid

import pytest
from mlflow.tracking import MlflowClient

from tests.helpers.runs import open_mlflow_run
from wildtrain.config import StorageConfig, load_config
from wildtrain.elastic.controller import ControllerEvents
from wildtrain.tracking.controller.mlflow_run import MlflowRecorder
from wildtrain.tracking.mlflow_client import run_url
from wildtrain.tracking.reports.runs import report_run
from wildtrain.worker_report import WorkerReport

pytestmark = pytest.mark.integration

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
# As root on a machine whose only network is the package registries: no sandbox, and none
# of Chromium's own connections (each refused, many at a time).
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1600,1400",
)
PAGE_TIMEOUT_S = 60


@pytest.fixture
def browser(tmp_path):
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip(
            "needs Debian's chromium and chromium-driver (/usr/bin/chromium, /usr/bin/chromedriver): "
            "`make test` installs them where it runs as root with apt-get"
        )
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium: pip install -e '.[test]'")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(flag)
    # The system's driver: Selenium Manager would try to download one.
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def finished_run(mlflow_url: str, tmp_path) -> tuple[str, str]:
    """(experiment id, run id) of a small finished run, created and logged by wildtrain's code
    as a training run's driver and controller do: config, eight steps of reports with two
    validations and a save, its goodput report."""
    cfg = load_config(
        [
            "experiment=tiny",
            f"tracking.uri={mlflow_url}",
            f"tracking.experiment=ui-{uuid.uuid4().hex[:8]}",
            "run.name=ui",
        ]
    )
    experiment_id, run_id = open_mlflow_run(cfg, None)
    callback = ControllerEvents(
        [MlflowRecorder(mlflow_url, run_id, str(tmp_path / "hangs"), StorageConfig(), tmp_path / "tracking")]
    )
    start = time.time() - 60
    for step in range(2, 10, 2):
        windows = [
            {
                "step": s,
                "at": start + 5 * s,
                "loss": 5.0 - 0.3 * s,
                "lr": 1e-3,
                "tokens_seen": 64.0 * s,
                "tokens_per_s": 800.0 + s,
                "step_time_s": 0.4,
                "world_size": 2,
                "epoch": 0,
                "mfu": 0.2,
                "time/forward_s": 0.1,
                "time/backward_s": 0.2,
                "time/data_wait_s": 0.01,
                "memory/peak_gb": 1.0,
                **({"val/loss": 5.2 - 0.3 * s, "val/bpb": 2.0 - 0.1 * s} if s % 4 == 0 else {}),
            }
            for s in (step - 1, step)
        ]
        saved = {"checkpoint/bytes": 4096.0, "checkpoint/save_s": 0.2} if step == 8 else {}
        callback.after_report(
            None, [WorkerReport(step, 64 * step, 2, windows=tuple(windows), checkpoint=saved).to_dict()]
        )
    callback.after_controller_finish(None)
    MlflowClient(mlflow_url).set_terminated(run_id, "FINISHED")
    report_run(mlflow_url, run_id)
    return experiment_id, run_id


def text_of(browser) -> str:
    from selenium.webdriver.common.by import By

    return browser.find_element(By.TAG_NAME, "body").text


def wait_for(browser, condition, what: str) -> str:
    """The page's text once `condition(text)` holds; fails naming `what` and what is shown."""
    deadline = time.monotonic() + PAGE_TIMEOUT_S
    while True:
        text = text_of(browser)
        if condition(text):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{what} not shown within {PAGE_TIMEOUT_S} s at {browser.current_url}; the page shows:\n{text[:3000]}"
            )
        time.sleep(0.5)


def keep(browser, client: MlflowClient, run_id: str, name: str, tmp_path) -> None:
    path = tmp_path / f"{name}.png"
    browser.save_screenshot(str(path))
    client.log_artifact(run_id, str(path), "ui")


def test_the_mlflow_ui_opens_wildtrains_run_on_its_loss_and_its_experiment_in_the_training_view(
    browser, mlflow_url, tmp_path
):
    experiment_id, run_id = finished_run(mlflow_url, tmp_path)
    client = MlflowClient(mlflow_url)
    address = run_url(mlflow_url, experiment_id, run_id)

    # The address the driver prints: the run's Overview, its goodput among its figures.
    browser.get(address)
    text = wait_for(browser, lambda t: "goodput/wall_s" in t, "the run's goodput")
    keep(browser, client, run_id, "overview", tmp_path)

    # Its Model metrics tab: validation's section, then the training curves, each chart
    # captioned "<run> (<key>)"; step timings, memory, checkpoints are on System metrics, and
    # goodput is no chart.
    browser.get(address.replace(f"/runs/{run_id}", f"/runs/{run_id}/model-metrics"))
    text = wait_for(browser, lambda t: "ui (tokens_per_s)" in t, "the run's metric charts")
    keep(browser, client, run_id, "model-metrics", tmp_path)
    lines = text.splitlines()
    sections = [line for line, after in zip(lines, lines[1:]) if re.fullmatch(r"\(\d+\)", after)]
    charts = re.findall(r"^ui \((.+)\)$", text, re.M)
    assert sections == ["val", "Model metrics"], sections
    assert charts[:5] == ["val/bpb", "val/loss", "loss", "lr", "mfu"] and "tokens_per_s" in charts, charts
    assert not [key for key in charts if key.startswith(("system/", "goodput", "badput", "checkpoint", "time/"))]

    # The experiment, in the view the address asks for: its runs in the model-training view,
    # not the GenAI view's overview of traces and "Detect issues" (where MLflow 3.17 opens
    # an experiment's bare address, whatever its kind tag says).
    browser.get(address.split(f"/runs/{run_id}")[0] + "?" + address.split("?")[1])
    text = wait_for(browser, lambda t: "1 matching run" in t, "the experiment's runs")
    keep(browser, client, run_id, "experiment", tmp_path)
    assert "/runs" in browser.current_url and "workflowType=machine_learning" in browser.current_url, (
        browser.current_url
    )
    assert "detect issues" not in text.lower() and "Observability" not in text, text[:2000]

    assert {a.path for a in client.list_artifacts(run_id, "ui")} == {
        "ui/overview.png",
        "ui/model-metrics.png",
        "ui/experiment.png",
    }
