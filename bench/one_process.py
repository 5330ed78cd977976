"""A helper of bench/gpu_smoke.py and bench/mfu.py, no benchmark: one process, one device.

What those GPU bench scripts share: a torch.distributed group of one (DeepSpeed needs a
group), no Ray. Import it before DeepSpeed: on CPU, DeepSpeed picks its accelerator from
DS_ACCELERATOR when it is first imported."""

from __future__ import annotations

import os
import socket
import sys

import torch


def on_cuda(device: str | None) -> bool:
    """Whether to run on CUDA (`device`: "cuda", "cpu", or None for CUDA when there is one),
    with the environment set for a group of one on that device."""
    cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here")
    if not cuda:
        os.environ["DS_ACCELERATOR"] = "cpu"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    return cuda
