"""tests/gpu: skipped where there is no CUDA device, so the suite passes on CPU machines.

`cuda_group` is the process group of one rank on NCCL that the single-process tests share,
started with torch.distributed itself: DeepSpeed adopts a group it finds, and a test that
needs only CUDA and the group does not skip where DeepSpeed is not installed."""

import os
import socket

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cuda_group():
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # DeepSpeed reads these when it adopts the group.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield torch.device("cuda", 0)
    dist.destroy_process_group()
