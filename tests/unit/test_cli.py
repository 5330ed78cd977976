"""The command line's answers to bad input: one line naming the culprit, a non-zero exit,
and no Ray started (these run in seconds, before any cluster exists)."""

import ast
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO
from tests.helpers.datasets import write_dataset
from wildtrain.cli_common import RUN_ERRORS, SETTING_ERRORS, one_line_errors
from wildtrain.clusters import registry
from wildtrain.config import redact
from wildtrain.services import free_port


def wildtrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wildtrain", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.micro_batch=3", "wildtrain: train.micro_batch: unknown key (did you mean train.micro_batch_size?)"),
        ("train.steps=abc", "wildtrain: train.steps: expected int, got 'abc' (str)"),
    ],
)
def test_config_errors_exit_2_with_one_line(override, message):
    done = wildtrain("train", override)
    assert done.returncode == 2
    assert done.stderr.strip() == message


def test_unprepared_dataset_exits_1_naming_the_key_and_how_to_prepare(tmp_path):
    done = wildtrain("train", f"data.datasets=[{{uri: {tmp_path}/missing}}]")
    assert done.returncode == 1
    assert f"data.datasets.0.uri: no manifest.json at {tmp_path}/missing; prepare the dataset first" in done.stderr
    assert "Traceback" not in done.stderr


def test_unreachable_mlflow_exits_1_naming_the_uri(tmp_path):
    dataset = tmp_path / "data"
    write_dataset(dataset, [np.zeros((32, 129), dtype=np.int32)], rows_per_group=16)
    uri = f"http://127.0.0.1:{free_port()}"
    runs = tmp_path / "runs"
    done = wildtrain("train", f"tracking.uri={uri}", f"run.storage={runs}", f"data.datasets=[{{uri: {dataset}}}]")
    assert done.returncode == 1
    assert f"tracking.uri: the MLflow server at {uri} is unreachable" in done.stderr
    assert "Traceback" not in done.stderr
    assert not runs.exists(), "nothing may be written before tracking works"


def test_config_command_prints_the_resolved_config():
    done = wildtrain("config", "experiment=tiny", "train.steps=9")
    assert done.returncode == 0
    assert "steps: 9" in done.stdout and "name: tiny" in done.stdout


def test_sweep_dry_run_prints_each_trial_with_its_hash_and_starts_nothing():
    done = wildtrain(
        "sweep",
        "abl",
        "--grid",
        "optim.lr=1e-3,3e-3",
        "--grid",
        "model.dim=64,128",
        "--steps",
        "5",
        "--dry-run",
        "experiment=tiny",
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "sweep abl: 4 trials over optim.lr, model.dim"
    assert len(lines) == 5 and all(line.split()[1] == f"abl-{line.split()[0]}" for line in lines[1:])
    assert (
        wildtrain(
            "sweep",
            "abl",
            "--grid",
            "optim.lr=1e-3,3e-3",
            "--grid",
            "model.dim=64,128",
            "--steps",
            "5",
            "--dry-run",
            "experiment=tiny",
        ).stdout
        == done.stdout
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ("sweep", "s", "--grid", "optim.lr=1,2", "--cluster", "big"),
            f"wildtrain: {REPO / 'ray_clusters' / 'clusters.yaml'}: clusters.big: no such cluster (known: "
            f"{', '.join(sorted(registry.load(REPO / 'ray_clusters' / 'clusters.yaml').clusters))})",
        ),
        (
            ("sweep", "s", "--grid", "optim.lr=1,fast"),
            "wildtrain: optim.lr: expected float, got 'fast' (str) (trial optim.lr=fast)",
        ),
        (
            ("promote", "s", "--to", "model=7b", "--submit"),
            "wildtrain: promote --submit: give the cluster with --cluster NAME",
        ),
    ],
)
def test_sweep_and_promote_refuse_what_they_cannot_do_with_one_line(args, message):
    done = wildtrain(*args)
    assert (done.returncode, done.stderr.strip()) == (2, message)


def test_every_error_the_command_line_knows_is_one_wildtrain_defines():
    defined = {
        node.name
        for path in (REPO / "platform/wildtrain").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    }
    assert SETTING_ERRORS | RUN_ERRORS <= defined, "renamed? update cli_common"
    assert not SETTING_ERRORS & RUN_ERRORS


def test_known_errors_end_a_command_with_one_line_and_others_keep_their_traceback(capsys):
    from wildtrain.config import ConfigError
    from wildtrain.services import ServiceError

    def command(error: Exception) -> None:
        raise error

    for error, code in (
        (ConfigError("train.steps: must be positive"), 2),
        (ServiceError("http://u:pw@h down"), 1),
        (LookupError("no run 'r'"), 1),
    ):
        with pytest.raises(SystemExit) as ended:
            one_line_errors(LookupError)(command)(error)
        assert ended.value.code == code
        assert capsys.readouterr().err == f"wildtrain: {redact(str(error))}\n"
    with pytest.raises(LookupError):  # not named by this command: a bug, with its traceback
        one_line_errors()(command)(LookupError("no run 'r'"))
