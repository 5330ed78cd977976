"""The storage settings a driver hands every process of its run: what it hands over, that a
process given them resolves s3:// as the driver does whatever its node's environment held,
how a view that still differs is named (never with a key), and that no key reaches the
config, MLflow's params or a repr."""

from __future__ import annotations

import pytest
from ray.train.v2._internal.execution.controller import state as ray_states
from ray.train.v2._internal.execution.worker_group.poll import WorkerGroupPollStatus, WorkerStatus

from wildtrain import storage
from wildtrain.config import StorageConfig, flatten, load_config, redact, to_yaml
from wildtrain.elastic.controller import StorageSettings
from wildtrain.elastic.restarts import classify_restart, seen
from wildtrain.elastic.signals import RunCannotContinue
from wildtrain.train.entry import check_storage

ACCESS, SECRET = "AKIDRIVER0000000", "driver-secret-value"
SEAWEED = "http://127.0.0.1:8333"
KEY_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "CW_KEY", "CW_SECRET")


@pytest.fixture
def environ(monkeypatch):
    """Sets this process's storage variables, from none of them; all are restored after the
    test, those that code under test set included."""
    for name in KEY_VARIABLES:
        monkeypatch.setenv(name, "")  # records the variable's value before the test
        monkeypatch.delenv(name)

    def set_to(**values: str) -> None:
        for name in KEY_VARIABLES:
            monkeypatch.delenv(name, raising=False)
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    return set_to


def test_the_driver_hands_over_its_endpoint_and_key_pair_and_an_empty_endpoint_for_aws(environ):
    environ(AWS_ENDPOINT_URL=SEAWEED, AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET)
    assert storage.handover_env(StorageConfig()) == {
        "AWS_ENDPOINT_URL": SEAWEED,
        "AWS_ACCESS_KEY_ID": ACCESS,
        "AWS_SECRET_ACCESS_KEY": SECRET,
    }
    # A cluster's store from the registry: its endpoint in the config, its keys in the variables it names.
    environ(AWS_ENDPOINT_URL=SEAWEED, CW_KEY=ACCESS, CW_SECRET=SECRET)
    cw = StorageConfig(
        endpoint="https://object.lga1.coreweave.com", access_key_env="CW_KEY", secret_key_env="CW_SECRET"
    )
    assert storage.handover_env(cw) == {
        "AWS_ENDPOINT_URL": "https://object.lga1.coreweave.com",
        "CW_KEY": ACCESS,
        "CW_SECRET": SECRET,
    }
    # AWS, with its default credential chain: an endpoint on a node must not win, no keys to give.
    environ(AWS_ACCESS_KEY_ID=ACCESS)
    assert storage.handover_env(StorageConfig()) == {"AWS_ENDPOINT_URL": ""}


@pytest.mark.parametrize(
    "node",
    [
        {},  # a cluster other than `wildtrain up`'s: nothing about the store
        {"AWS_ENDPOINT_URL": "http://10.0.0.9:9000", "AWS_ACCESS_KEY_ID": "AKIDNODE", "AWS_SECRET_ACCESS_KEY": "node"},
    ],
)
@pytest.mark.parametrize(
    "drivers",
    [
        {"AWS_ENDPOINT_URL": SEAWEED, "AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": SECRET},
        {},  # AWS and the default credential chain
    ],
)
def test_a_process_given_the_handover_resolves_as_the_driver_whatever_its_node_held(
    environ, monkeypatch, node, drivers
):
    environ(**drivers)
    config = StorageConfig()
    env, view = storage.handover_env(config), storage.StorageView.here(config)
    environ(**node)
    for name, value in env.items():  # what a runtime env's env_vars do to the node's environment
        monkeypatch.setenv(name, value)
    assert storage.StorageView.here(config).differences(view) == []
    assert storage.endpoint(config) == drivers.get("AWS_ENDPOINT_URL")
    if drivers:
        assert storage.StorageView.here(config) == view


def test_a_view_that_differs_names_what_differs_and_never_a_key(environ):
    environ(AWS_ENDPOINT_URL=SEAWEED, AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET)
    drivers = storage.StorageView.here(StorageConfig())
    assert storage.StorageView.here(StorageConfig()).differences(drivers) == []
    environ()
    assert storage.StorageView.here(StorageConfig()).differences(drivers) == [
        f"endpoint AWS, the driver's {SEAWEED}",
        "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY not both set, the driver's are",
    ]
    environ(AWS_ENDPOINT_URL=SEAWEED, AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY="another-secret")
    other = storage.StorageView.here(StorageConfig(region="eu-west-1")).differences(drivers)
    assert other == [
        "region eu-west-1, the driver's us-east-1",
        "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY hold other keys than the driver's",
    ]
    assert not any(value in text for value in (ACCESS, SECRET, "another-secret") for text in [*other, repr(drivers)])
    # Where the driver used its machine's credential chain, a node's own keys are not a difference.
    environ(AWS_ENDPOINT_URL=SEAWEED)
    without_keys = storage.StorageView.here(StorageConfig())
    environ(AWS_ENDPOINT_URL=SEAWEED, AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET)
    assert storage.StorageView.here(StorageConfig()).differences(without_keys) == []


def test_a_worker_that_resolves_unlike_the_driver_ends_the_run_in_one_line(environ):
    environ(AWS_ENDPOINT_URL=SEAWEED, AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET)
    cfg = load_config(["experiment=tiny"])
    drivers = storage.StorageView.here(cfg.storage)
    environ(AWS_ENDPOINT_URL="http://10.0.0.9:9000", AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET)
    with pytest.raises(RunCannotContinue) as raised:
        check_storage(drivers, cfg)
    message = raised.value.message
    assert message.startswith("storage: a worker on ") and "\n" not in message
    assert message.endswith(f"resolves s3:// unlike the driver: endpoint http://10.0.0.9:9000, the driver's {SEAWEED}")
    # Not restarted into the same error: the controller ends the run with the line.
    failed = WorkerGroupPollStatus({0: WorkerStatus(running=False, error=raised.value)}).get_worker_group_error()
    restart = classify_restart(seen(ray_states.RestartingState(failed)))
    assert restart.fatal and restart.cause == message


def test_the_controller_takes_the_drivers_settings_as_it_starts(environ):
    environ()
    handover = StorageSettings(
        {"AWS_ENDPOINT_URL": SEAWEED, "AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": SECRET}
    )
    assert SECRET not in repr(handover)
    handover.after_controller_start(train_run_context=None)
    assert storage.endpoint(StorageConfig()) == SEAWEED
    assert storage.StorageView.here(StorageConfig()).keys_sha256 is not None


def test_no_key_reaches_the_config_or_its_mlflow_params(environ):
    environ(AWS_ENDPOINT_URL=SEAWEED, AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET)
    cfg = load_config(["experiment=tiny", "data.datasets=[{uri: s3://wildtrain/datasets/tiny}]"])
    assert set(storage.handover_env(cfg.storage).values()) == {SEAWEED, ACCESS, SECRET}
    # What run_setup.open_run logs: each param, and the config as config.yaml.
    logged = [redact(str(value)) for value in flatten(cfg).values()] + [redact(to_yaml(cfg))]
    assert not any(ACCESS in text or SECRET in text for text in logged)
