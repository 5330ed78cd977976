import os
import shutil
from pathlib import Path

from wildtrain import services

REPO = Path(__file__).resolve().parents[1]

# No test downloads from the Hugging Face Hub: Transformers, huggingface_hub and Datasets
# (lm-eval's tasks) read these when imported, so they are set before any test module
# imports them; Ray clusters the tests start pass them on to their workers.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

# Every Ray cluster a test starts uses token authentication, as `wildtrain up` does. Ray
# reads the mode once, when it is imported, so it is set before any test module imports it.
# A GPU machine running tests/gpu (bench/gpu_all.sh) has no Ray, and no `ray` to make a token.
if shutil.which(services.ray_cli()):
    os.environ.update(services.token_auth_env())


def pytest_configure(config):
    # The stand-in accelerator of tests/unit/test_placement.py must be registered before
    # autograd first runs in this process: autograd sizes its per-device queues then, and a
    # device registered later fails its backward passes. It replaces no real GPU: where
    # CUDA is, the placement tests skip and nothing is registered.
    import torch

    if not torch.cuda.is_available():
        from tests.helpers import standin_device

        standin_device.device()
