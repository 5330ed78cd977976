"""Every collective the training loop issues, on a device its process group can carry.

NCCL moves only CUDA tensors and gloo only CPU ones, and a wrong guess does not fail
cleanly: NCCL given a CPU tensor raises deep inside c10d, and a CPU tensor per step on a
GPU run costs a device sync. So no module of `wildtrain.train` calls `torch.distributed`
directly (tests/unit/test_collectives.py enforces it); they call these functions, which
pick the device from the default group's backend:

- `nccl` alone: the current CUDA device. The caller must have called
  `torch.cuda.set_device` (Ray Train does, `bench/` does): torch's object collectives use
  the current device too, and every rank on cuda:0 would hang or corrupt memory.
- `gloo`, or a group with a CPU backend such as Ray Train's `cpu:gloo,cuda:nccl`: the CPU
  for flags, floats and objects (no device copy and no sync), while a CUDA tensor such as
  the loss stays on its device and goes through NCCL.

Without a process group (unit tests) every function is the identity of a group of one; a
group of one still communicates, so a one-GPU run exercises the device choice.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def small_tensor_device(backend: str) -> torch.device:
    """Where flags and scalars go for a group with this backend string: the CPU whenever the
    group has a CPU backend, else the current CUDA device."""
    if ":" in backend:  # "cpu:gloo,cuda:nccl": one backend per device type
        devices = [pair.split(":", 1)[0] for pair in backend.split(",")]
        if "cpu" in devices:
            return torch.device("cpu")
        if devices[0] != "cuda":
            raise ValueError(f"process group backend {backend!r}: no CPU or CUDA backend to run collectives on")
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    raise ValueError(f"process group backend {backend!r} is not supported: use gloo, nccl or cpu:gloo,cuda:nccl")


def carries(backend: str, device: torch.device) -> bool:
    """Whether a group with this backend string can all-reduce a tensor on `device`."""
    if ":" in backend:
        return device.type in {pair.split(":", 1)[0] for pair in backend.split(",")}
    return {"gloo": "cpu", "nccl": "cuda"}.get(backend) == device.type


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def _device() -> torch.device:
    return small_tensor_device(str(dist.get_backend()))


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_ranks(ok: bool) -> bool:
    """True on every rank when `ok` is true on every rank."""
    if not _active():
        return bool(ok)
    flag = torch.tensor([int(ok)], device=_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def any_rank(yes: bool) -> bool:
    """True on every rank when `yes` is true on some rank."""
    return not all_ranks(not yes)


def broadcast_flag(value: bool, src: int = 0) -> bool:
    """Rank `src`'s `value`, on every rank."""
    if not _active():
        return bool(value)
    flag = torch.tensor([int(value)], device=_device())
    dist.broadcast(flag, src=src)
    return bool(flag.item())


def broadcast_object(value: T, src: int = 0) -> T:
    """Rank `src`'s `value` (anything picklable), on every rank."""
    if not _active():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src, device=_device())
    return box[0]


def all_gather_object(value: Any) -> list:
    """Every rank's `value`, in rank order, on every rank."""
    if not _active():
        return [value]
    _device()  # a clear error for a backend the object collectives cannot use
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def all_gather_floats(values: float | list[float]) -> list:
    """Every rank's float (or equally long list of floats), in rank order, in one tensor
    collective rather than a pickled object per rank."""
    single = isinstance(values, (int, float))
    row = torch.tensor([float(values)] if single else [float(v) for v in values], dtype=torch.float64)
    if _active():
        row = row.to(_device())
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, row)
    else:
        rows = [row]
    # One host copy of the whole gather: a sync, but one per call, not one per rank.
    table = torch.stack(rows).cpu().tolist()
    return [r[0] for r in table] if single else table


def mean_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """The mean of `tensor` over all ranks, on `tensor`'s device when the group carries that
    device (the loss stays on the GPU until it is read), else on the group's device."""
    out = tensor.detach().float().clone()
    if not _active():
        return out
    backend = str(dist.get_backend())
    if not carries(backend, out.device):
        out = out.to(small_tensor_device(backend))
    dist.all_reduce(out)
    return out / dist.get_world_size()


def sum_(tensor: torch.Tensor) -> torch.Tensor:
    """All-reduce (sum) `tensor` in place, on its own device: for buffers whose device is the
    point, such as the health check's bandwidth probe. A device the group cannot carry is
    an error here rather than deep inside c10d."""
    if not _active():
        return tensor
    backend = str(dist.get_backend())
    if not carries(backend, tensor.device):
        raise ValueError(f"a {tensor.device.type} tensor cannot be all-reduced over a {backend!r} process group")
    dist.all_reduce(tensor)
    return tensor
