"""What the driver hands Ray Train (`train.entry`): the driver pickles the workers' function by
reference, and needs none of the modules only a worker runs."""

import subprocess
import sys

WORKERS_ONLY = ["wildtrain.train.loop", "wildtrain.engine", "wildtrain.model", "torch._dynamo"]


def imported(modules: list[str], of: list[str]) -> list[str]:
    """Those of `of` that importing `modules` imports, in a new Python."""
    code = f"import sys; [__import__(m) for m in {modules!r}]; print(sorted(set({of!r}) & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return eval(done.stdout)


def test_the_driver_imports_none_of_the_workers_modules():
    # They were 1.3 s of the driver's 3.6-4.2 s of imports here, before each run's first step.
    assert imported(["wildtrain.cli", "wildtrain.driver"], WORKERS_ONLY) == []


def test_the_driver_and_ray_trains_controller_start_without_torch():
    """Torch is half of the controller's imports before it starts any worker: the driver's
    trainer, backend and callbacks import none of it (the driver's in-process rendezvous
    imports it when it opens its store, the controller once its group started)."""
    controller = [
        "ray.train.v2._internal.execution.controller",
        "wildtrain.ray_compat",
        "wildtrain.elastic.controller",
        "wildtrain.elastic.survivors",
        "wildtrain.elastic.missed_commits",
        "wildtrain.tracking.controller.mlflow_run",
        "wildtrain.train.entry",
    ]
    assert imported(["wildtrain.cli", "wildtrain.driver", *controller], ["torch"]) == []


def test_a_joiner_begins_its_first_read_before_the_loops_imports():
    # The read mostly waits for Ray to start its read tasks' processes: begun first, it runs
    # beside the loop's 3-4 s of imports here (torch's the first) instead of after them.
    code = """
import sys, types
from wildtrain.data import stream
from wildtrain.train import entry

class Begun(Exception):
    pass

def begin(datasets, data, train, config):
    raise Begun(sorted(set(WORKERS_ONLY) & set(sys.modules)), datasets)

stream.warm_up_ahead = begin
entry.check_storage = lambda drivers, cfg: None
cfg = types.SimpleNamespace(data=None, train=None, storage=None)
inputs = types.SimpleNamespace(cfg=cfg, storage_view=None, data=types.SimpleNamespace(datasets=["the datasets"]))
try:
    entry.joiner_main(inputs, "token", "member.2", 2)
except Begun as begun:
    print(begun.args)
""".replace("WORKERS_ONLY", repr(["torch", *WORKERS_ONLY]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "([], ['the datasets'])"
