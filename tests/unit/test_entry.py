"""What the driver hands Ray Train (`train.entry`): the driver pickles the workers' function by
reference, and needs none of the modules only a worker runs."""

import subprocess
import sys

WORKERS_ONLY = ["wildtrain.train.loop", "wildtrain.engine", "wildtrain.model", "torch._dynamo"]


def test_the_driver_imports_none_of_the_workers_modules():
    # They were 1.3 s of the driver's 3.6-4.2 s of imports here, before each run's first step.
    code = f"import sys, wildtrain.cli, wildtrain.driver; print(sorted(set({WORKERS_ONLY!r}) & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
