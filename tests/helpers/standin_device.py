"""A stand-in accelerator for CPU-only test runs: tensors that say they live on device
`standin:0`, compute on the CPU, and refuse to meet a host tensor in one op as a GPU
would. Every defect of the first GPU pass was a tensor on the wrong device; with this
device the CPU suite catches that class of bug.

    with standin() as device:
        model = Transformer(cfg).to(device)
        model(tokens.to(device)).sum().backward()   # fine
        model(tokens)                               # HostTensorInAcceleratorOp

How: PyTorch's PrivateUse1 backend, renamed `standin` and given the Python device guard
and hooks of `torch.utils.backend_registration._setup_privateuseone_for_python_backend`
(experimental in torch 2.13). A stand-in tensor is a wrapper subclass (`StandInTensor`)
holding a CPU tensor; its `__torch_dispatch__` unwraps the arguments, runs the CPU
kernel and wraps the results again. `standin()` also enters a dispatch mode, because a
factory call with `device=standin` (torch.arange in a mask) or a host tensor's
`.to(device)` has no stand-in argument to dispatch on; the mode passes CPU-only ops
through untouched. Autograd runs above the dispatcher, so gradients, `.grad` and the
optimizer states are stand-in tensors too, and torch's fused AdamW runs (its CPU kernel):
torch lists the PrivateUse1 backend among its fused devices. Random numbers come from
the CPU generator, so a seeded model draws the same weights on both devices.

An op with kernels for some devices only runs its composite decomposition here, as on a
backend without that kernel: SDPA is torch's math attention (placement of its inner ops is
checked; which CUDA kernel it would pick is not).

Which mixes are refused: an op given stand-in tensors and a host tensor of one or more
dimensions, as on CUDA; 0-dim host tensors pass, as CUDA lets CPU scalars into kernels.
Copies (`.to`, `copy_`) cross devices by design. Stricter than CUDA: indexing a device
tensor with host indices (CUDA copies them over, a sync each time) is refused.

Errors in the backward pass: torch's autograd engine holds a stream guard around every
node of an accelerator, and when a Python exception unwinds through it, the guard's
restore calls the Python device guard (`PythonDeviceGuard::exchangeStream`, noexcept),
which fails with the exception pending: std::terminate ends the whole process (gdb:
under `~InlineStreamGuard` in `Engine::evaluate_function`). So inside a backward pass a
failing op does not raise: it returns a `_Failed` object, which torch's C++ side refuses ("Unable to
cast <the message> to Tensor"), a C++ error that `.backward()` raises as RuntimeError.
The message is also logged (pytest shows it under "Captured log"), as ops returning
lists or nothing lose it from the cast error. Python code that raises on the backward
thread itself (a tensor hook, a checkpoint's recompute) still aborts the process.

What was tried and failed:
- `FakeTensorMode` with `device="cuda"` checks devices, but Python indexing (`t[0]`,
  `t[:, 1:]`) and random init fail on a CPU build: THPVariable_getitem takes a CUDA device
  guard before dispatch ("PyTorch is not linked with support for cuda devices").
- This wrapper carrying `cuda`: the same guard, and `AdamW(fused=True)` asks CUDA whether
  it is compiled in ("Torch not compiled with CUDA enabled").
- Carrying `meta`: indexing works (meta has a guard), but fused AdamW refuses meta
  parameters, and a real meta tensor (`device="meta"`, `to_empty`) could not be told
  from a stand-in one.
- PrivateUse1 under its own name, `privateuseone`, not renamed: torch then has no
  accelerator, and backward refuses the device ("Cannot access accelerator device when
  none is available"); renaming makes it torch's accelerator.
- `torch.autograd.set_multithreading_enabled(False)` runs backward on the calling thread
  but keeps the stream guard: a Python error still aborts.

The backend is process-wide and registered once (torch refuses a second rename), and a
registered PrivateUse1 backend is torch's accelerator ahead of CUDA (`torch.accelerator`,
pinned memory, autograd's streams) for the rest of the process: so `device()` refuses to
register it where CUDA is. The dispatch mode is active only inside `standin()`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.backend_registration import _DummyBackendModule, _setup_privateuseone_for_python_backend

NAME = "standin"
HOST = torch.device("cpu")
# Ops whose point is to move data between devices.
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}
log = logging.getLogger(__name__)


class HostTensorInAcceleratorOp(RuntimeError):
    """A host tensor met stand-in (accelerator) tensors in one op: on a GPU, a device error."""


class _Backend(_DummyBackendModule):
    """`torch.standin`: what torch asks a device's module for. Activation checkpointing
    saves the device's autocast state and RNG state to recompute under them; the stand-in's
    random numbers come from the CPU generator, so its RNG state is the CPU's."""

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    def device(self, index: Any) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)


@functools.cache
def device() -> torch.device:
    """The stand-in device, registering the backend on first use."""
    if torch.cuda.is_available():
        raise RuntimeError(
            "the stand-in device would replace CUDA as torch's accelerator for the rest of this "
            "process: use it where there is no GPU"
        )
    _setup_privateuseone_for_python_backend(NAME, backend_module=_Backend())
    return torch.device(NAME, 0)


class StandInTensor(torch.Tensor):
    """A tensor on the stand-in device; its values are the CPU tensor `host`."""

    host: torch.Tensor

    @staticmethod
    def __new__(cls, host: torch.Tensor) -> "StandInTensor":
        return torch.Tensor._make_wrapper_subclass(
            cls,
            host.shape,
            strides=host.stride(),
            storage_offset=host.storage_offset(),
            dtype=host.dtype,
            layout=host.layout,
            device=device(),
            requires_grad=host.requires_grad,
        )

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host

    def __repr__(self) -> str:
        return f"StandInTensor({self.host!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


class _Failed:
    """What a failing op returns inside a backward pass (see the module's docstring)."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __str__(self) -> str:
        return f"\n{self.message}\n"


def _dispatch(func, args: tuple, kwargs: dict) -> Any:
    if torch._C._current_graph_task_id() == -1:
        return _run(func, args, kwargs)
    try:
        return _run(func, args, kwargs)
    except Exception as e:
        message = f"{type(e).__name__} in the backward pass on {device()}: {e}"
        log.error(message)
        failed = _Failed(message)
        returns = func._schema.returns
        return tuple(failed for _ in returns) if len(returns) > 1 else failed


def _map(fn: Callable[[Any], Any], x: Any) -> Any:
    """`fn` on each leaf of an op's arguments or results (nested tuples, lists, dicts): a
    fraction of the cost of torch's pytree.tree_map, which was most of the stand-in's time."""
    if isinstance(x, (tuple, list)):
        return type(x)(_map(fn, v) for v in x)
    if isinstance(x, dict):
        return {k: _map(fn, v) for k, v in x.items()}
    return fn(x)


def _is_standin(target: Any) -> bool:
    return target is not None and torch.device(target).type == NAME


def _describe(t: torch.Tensor) -> str:
    return f"{t.device.type} {t.dtype} {list(t.shape)}"


def _run(func, args: tuple, kwargs: dict) -> Any:
    """`func` on the CPU values of its arguments; results on the stand-in device when any
    argument was (or `device=` says so)."""
    standins: list[StandInTensor] = []
    hosts: list[torch.Tensor] = []

    def collect(x: Any) -> Any:
        if isinstance(x, StandInTensor):
            standins.append(x)
        elif isinstance(x, torch.Tensor):
            hosts.append(x)
        return x

    _map(collect, (args, kwargs))
    target = kwargs.get("device")
    if standins and any(t.dim() > 0 for t in hosts) and func not in _COPIES:
        raise HostTensorInAcceleratorOp(
            f"{func} got host tensor(s) ({', '.join(_describe(t) for t in hosts if t.dim() > 0)}) together with "
            f"{device()} tensor(s) ({', '.join(_describe(t) for t in standins)}): on a GPU this is a device "
            f"mismatch; move the host tensor to the device (or build it there)"
        )
    if not standins and not _is_standin(target):
        return func(*args, **kwargs)
    unwrap = lambda x: x.host if isinstance(x, StandInTensor) else x  # noqa: E731
    cpu_kwargs = {k: HOST if k == "device" and _is_standin(v) else v for k, v in _map(unwrap, kwargs).items()}
    out = func(*_map(unwrap, args), **cpu_kwargs)
    if target is not None and not _is_standin(target):
        return out  # an explicit copy off the device (.cpu(), .to("cpu"))
    # In-place and out= ops return their argument: the same tensor, not a new wrapper (a host
    # tensor stays one: `host.copy_(on_device)`).
    given = {id(t.host): t for t in standins} | {id(t): t for t in hosts}

    def wrap(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return given[id(x)] if id(x) in given else StandInTensor(x)

    return _map(wrap, out)


class _FactoriesOnStandIn(TorchDispatchMode):
    """Sees every op, so that factories and host-to-device copies reach `_run`."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Else torch wraps __torch_dispatch__ in dynamo.disable, which imports dynamo (seconds)
        # and costs every op a frame switch; nothing here is compiled.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


@contextlib.contextmanager
def standin() -> Iterator[torch.device]:
    """The stand-in device, usable (factories, `.to(device)`) inside the block."""
    dev = device()
    with _FactoriesOnStandIn():
        yield dev
