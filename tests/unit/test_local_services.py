"""Which Ray a run joins, what `wildtrain up` asks of `ray start`, and what never leaves the
machine in MLflow params, printed URLs and errors (no Ray, no servers)."""

import json
import os
import re
import secrets
import shlex
import subprocess
from dataclasses import fields
from pathlib import Path

import pytest

from wildtrain import services
from wildtrain.config import flatten, load_config, redact
from wildtrain.elastic.scaling import largest_group
from wildtrain.services import RayPorts, ServiceError, choose_ray_address
from wildtrain.services.ray_head import _names

STATE = Path(".wildtrain/services.json")


@pytest.mark.parametrize(
    "configured, environ, recorded, chosen",
    [
        ("10.0.0.5:6379", "127.0.0.1:7000", "127.0.0.1:6379", "10.0.0.5:6379"),
        (None, "127.0.0.1:7000", "127.0.0.1:6379", "127.0.0.1:7000"),
        (None, None, "127.0.0.1:6379", "127.0.0.1:6379"),
        (None, "", "127.0.0.1:6379", "127.0.0.1:6379"),
    ],
)
def test_the_address_is_the_config_then_ray_address_then_wildtrain_up(configured, environ, recorded, chosen):
    assert choose_ray_address(configured, environ, recorded, STATE) == chosen


def test_no_address_anywhere_is_an_error_that_says_to_run_wildtrain_up():
    with pytest.raises(ServiceError) as e:
        choose_ray_address(None, None, None, STATE)
    message = str(e.value)
    assert message.startswith("cluster.ray_address: ")
    assert "run `wildtrain up`" in message and str(STATE) in message and "RAY_ADDRESS" in message


def test_the_recorded_head_is_read_from_services_json(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "services.json").write_text('{"ray_address": "127.0.0.1:6390"}')
    assert services.ray_address(None, tmp_path) == "127.0.0.1:6390"
    with pytest.raises(ServiceError, match="wildtrain up"):
        services.ray_address(None, tmp_path / "elsewhere")


@pytest.mark.parametrize(
    "address, loopback",
    [("127.0.0.1:6379", True), ("localhost:6379", True), ("[::1]:6379", True), ("10.0.0.5:6379", False)],
)
def test_loopback_addresses(address, loopback):
    assert services.is_loopback(address) is loopback


def test_the_head_gets_every_port_and_its_own_temp_dir():
    ports = RayPorts().chosen()
    command = services.ray_head_command(ports, 4, Path("/tmp/wildtrain-ray-x"))
    env_only = {"autoscaler_metrics", "dashboard_metrics"}
    for field in fields(RayPorts):
        if field.name not in env_only:
            assert str(getattr(ports, field.name)) in command, field.name
    assert len({getattr(ports, f.name) for f in fields(RayPorts)}) == len(fields(RayPorts)), "each port its own"
    assert command[command.index("--temp-dir") + 1] == "/tmp/wildtrain-ray-x"
    assert command[command.index("--node-ip-address") + 1] == "127.0.0.1"


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_the_head_declares_the_gpus_it_was_given_with_a_trainer_slot_each():
    ports = RayPorts().chosen()
    command = services.ray_head_command(ports, 16, Path("/tmp/wildtrain-ray-x"), num_gpus=8)
    assert flag(command, "--num-gpus") == "8"
    # What conf/cluster/gpu.yaml's workers ask for besides a GPU.
    assert json.loads(flag(command, "--resources")) == {"trainer": 8}
    assert load_config(["cluster=gpu"]).cluster.worker_resources == {services.TRAINER_RESOURCE: 1}


def test_a_head_without_gpus_declares_none_rather_than_leave_them_to_ray():
    command = services.ray_head_command(RayPorts().chosen(), 4, Path("/tmp/wildtrain-ray-x"))
    assert flag(command, "--num-gpus") == "0"  # not Ray's own count, which torch may not share
    assert "--resources" not in command


def test_a_temp_dir_names_paths_inside_it_not_its_siblings():
    folder = Path("/tmp/wildtrain-ray-abc")
    assert _names("--temp-dir=/tmp/wildtrain-ray-abc", folder)
    assert _names("/tmp/wildtrain-ray-abc/session_1/logs", folder)
    assert _names("--log_dir=/tmp/wildtrain-ray-abc/session_1/logs", folder)
    assert not _names("--temp-dir=/tmp/wildtrain-ray-abcd", folder)
    assert not _names("/tmp/wildtrain-ray-abcd/session_1", folder)


@pytest.mark.parametrize(
    "text, shown",
    [
        ("http://user:secret@mlflow.example:5000", "http://***@mlflow.example:5000"),
        (
            "the MLflow server at https://tok@host/x is unreachable",
            "the MLflow server at https://***@host/x is unreachable",
        ),
        ("ray://u:p@10.0.0.5:10001 and s3://bucket/a@b", "ray://***@10.0.0.5:10001 and s3://bucket/a@b"),
        ("http://127.0.0.1:5000/#/experiments/1", "http://127.0.0.1:5000/#/experiments/1"),
    ],
)
def test_redact_hides_credentials_in_uris_only(text, shown):
    assert redact(text) == shown
    assert "secret" not in redact(text)


def test_params_of_a_config_with_credentials_show_none():
    cfg = load_config(
        ["tracking.uri=http://alice:hunter2@mlflow.example:5000", "cluster.ray_address=ray://bob:pw@h:10001"]
    )
    params = {key: redact(str(value)) for key, value in flatten(cfg).items()}
    assert params["tracking.uri"] == "http://***@mlflow.example:5000"
    assert not any("hunter2" in value or ":pw@" in value for value in params.values())


@pytest.mark.parametrize(
    "total, per_worker, max_workers, size",
    [
        ({"CPU": 2}, {"CPU": 1}, 2, 2),  # a 2-CPU private Ray: the group leaves no CPU to the data
        ({"CPU": 4}, {"CPU": 1}, 2, 2),
        ({"CPU": 3}, {"CPU": 1}, 4, 3),
        ({"CPU": 6, "slot": 3}, {"CPU": 1, "slot": 1}, 4, 3),
        ({"CPU": 8, "GPU": 2}, {"CPU": 1, "GPU": 1}, 4, 2),
    ],
)
def test_largest_group(total, per_worker, max_workers, size):
    assert largest_group(total, per_worker, max_workers) == size


def test_a_client_of_wildtrain_ups_head_authenticates_with_its_token(tmp_path, monkeypatch):
    (tmp_path / "services.json").write_text('{"ray_address": "127.0.0.1:6390"}')
    monkeypatch.setattr(
        os, "environ", {key: value for key, value in os.environ.items() if key not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    )
    services.prepare_ray_client("10.0.0.5:6379", tmp_path)  # another cluster: its own settings
    assert "RAY_AUTH_MODE" not in os.environ
    services.prepare_ray_client(None, tmp_path)
    assert os.environ["RAY_AUTH_MODE"] == "token"


def test_the_dashboard_line_names_the_command_that_prints_its_token_and_never_the_token(tmp_path, monkeypatch):
    token = secrets.token_hex(16)
    (tmp_path / "auth_token").write_text(token)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "auth_token"))
    url = "http://127.0.0.1:8265"
    assert services.dashboard_text(url, token_auth=False) == url

    line = services.dashboard_text(url, token_auth=True)
    assert line.startswith(url) and "ray get-auth-token" in line and token not in line
    # From a shell without the venv on PATH (`make demo`), the command names its `ray` by path.
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    line = services.dashboard_text(url, token_auth=True)
    command = re.search(r"`(.+)`", line)[1]
    assert command == f"{services.ray_cli()} get-auth-token" and token not in line
    printed = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == token  # the command named prints the token the dashboard asks for
