"""Every collective the training loop issues, on a device its process group can carry, and
the attempt's fail-fast: a rank that fails takes its peers out of their collectives at once.

Two process groups, each for what it is good at:

- The default group (Ray Train's: NCCL on GPUs, gloo on CPUs) carries device tensors: the
  gradients (DeepSpeed's own), the loss (`mean_over_ranks`), the health check's bandwidth
  probe (`sum_`). Its timeout (elastic.collective_timeout_s) is short, because a collective
  that waits that long means a peer is gone.
- The control group (`open_control_group`: gloo, CPU) carries flags, floats and objects.
  A flag on an NCCL group is a device copy and a sync per call; here it is neither. Its
  timeout is long: the longest legitimate wait of one rank for another happens here
  (rank 0 converting a checkpoint to the universal format while the others wait, a save
  that must commit), and must not trip the default group's short bound.

NCCL moves only CUDA tensors and gloo only CPU ones, and a wrong guess does not fail
cleanly: NCCL given a CPU tensor raises deep inside c10d, and a CPU tensor per step on a
GPU run costs a device sync. So no module of `wildtrain.train` calls `torch.distributed`
directly (tests/unit/test_collectives.py enforces it); they call these functions.

Without a control group (its opening is the loop's: tests and benches that call these
functions in a plain group) the flags go over the default group, on the CPU when it has a
CPU backend, else on the current CUDA device (the caller must have called
`torch.cuda.set_device`; Ray Train does, `bench/` does). Without a process group (unit
tests) every function is the identity of a group of one.

Fail fast (`PeerWatch`): on a restart, Ray tears the process group down on every worker,
and a survivor whose collective waits for the failed rank blocks until the collective
times out (NCCL: its shutdown can block for good). So a rank that raises writes why into
the group's rendezvous store, and every other rank's watcher thread, blocked on that key on
a connection of its own, aborts its process groups: their pending and next collectives
raise at once, and the attempt ends on every rank within seconds.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from typing import Any, Iterator, Optional, TypeVar

import torch
import torch.distributed as dist

from wildtrain.elastic.rendezvous_keys import PEER_FAILED
from wildtrain.elastic.signals import PeerFailed
from wildtrain.train.failures import TOGETHER, FailureKind, classify

T = TypeVar("T")

_control: Optional[dist.ProcessGroup] = None
_control_of: Optional[dist.ProcessGroup] = None  # the default group `_control` was opened beside

# How long one wait of a watcher lasts: a failure wakes it at once, and c10d logs a warning
# each time a wait runs out, so it runs out rarely (under the 24.8 days of milliseconds
# that its socket poll can wait). A stopped watcher ends when the store goes with its
# group, or with its process.
_WATCH_SLICE = datetime.timedelta(days=7)


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


def open_control_group(timeout_s: float) -> None:
    """Open the control group beside the default one (a collective: every rank calls it,
    once per worker group): gloo, with `timeout_s` for its collectives."""
    global _control, _control_of
    if not _active():
        return
    _control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    _control_of = dist.group.WORLD


def control_group() -> Optional[dist.ProcessGroup]:
    """The control group (gloo) of the current default group, if one was opened."""
    # A control group of an earlier default group (destroyed since: a test, a bench) is gone with it.
    return _control if _control is not None and _control_of is dist.group.WORLD else None


def _flags() -> tuple[Optional[dist.ProcessGroup], torch.device]:
    """The group and device for flags, floats and objects."""
    control = control_group()
    if control is not None:
        return control, torch.device("cpu")
    return None, small_tensor_device(str(dist.get_backend()))


def world_size() -> int:
    return dist.get_world_size() if _active() else 1


def all_ranks(ok: bool) -> bool:
    """True on every rank when `ok` is true on every rank."""
    if not _active():
        return bool(ok)
    group, device = _flags()
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def any_rank(yes: bool) -> bool:
    """True on every rank when `yes` is true on some rank."""
    return not all_ranks(not yes)


def broadcast_flag(value: bool, src: int = 0) -> bool:
    """Rank `src`'s `value`, on every rank."""
    return bool(broadcast_int(int(value), src))


def broadcast_int(value: int, src: int = 0) -> int:
    """Rank `src`'s `value`, on every rank: one small tensor, not a pickled object."""
    if not _active():
        return int(value)
    group, device = _flags()
    box = torch.tensor([int(value)], dtype=torch.int64, device=device)
    dist.broadcast(box, src=src, group=group)
    return int(box.item())


def broadcast_object(value: T, src: int = 0) -> T:
    """Rank `src`'s `value` (anything picklable), on every rank."""
    if not _active():
        return value
    group, device = _flags()
    box = [value]
    dist.broadcast_object_list(box, src=src, group=group, device=device)
    return box[0]


def all_gather_object(value: Any) -> list:
    """Every rank's `value`, in rank order, on every rank."""
    if not _active():
        return [value]
    group, _ = _flags()  # also a clear error for a backend the object collectives cannot use
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def all_gather_floats(values: float | list[float]) -> list:
    """Every rank's float (or equally long list of floats), in rank order, in one tensor
    collective rather than a pickled object per rank."""
    single = isinstance(values, (int, float))
    row = torch.tensor([float(values)] if single else [float(v) for v in values], dtype=torch.float64)
    if _active():
        group, device = _flags()
        row = row.to(device)
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, row, group=group)
    else:
        rows = [row]
    # One host copy of the whole gather: a sync, but one per call, not one per rank.
    table = torch.stack(rows).cpu().tolist()
    return [r[0] for r in table] if single else table


def mean_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """The mean of `tensor` over all ranks, on `tensor`'s device when the default group
    carries that device (the loss stays on the GPU until it is read), else on the group's
    device."""
    out = tensor.detach().float().clone()
    if not _active():
        return out
    backend = str(dist.get_backend())
    if not carries(backend, out.device):
        out = out.to(small_tensor_device(backend))
    dist.all_reduce(out)
    return out / dist.get_world_size()


def sum_(tensor: torch.Tensor) -> torch.Tensor:
    """All-reduce (sum) `tensor` in place over the default group, on its own device: for
    buffers whose device is the point, such as the health check's bandwidth probe. A device
    the group cannot carry is an error here rather than deep inside c10d."""
    if not _active():
        return tensor
    backend = str(dist.get_backend())
    if not carries(backend, tensor.device):
        raise ValueError(f"a {tensor.device.type} tensor cannot be all-reduced over a {backend!r} process group")
    dist.all_reduce(tensor)
    return tensor


class PeerWatch:
    """One rank's end of the fail-fast (see the module docstring): `tell_peers` when this
    rank fails; `failed_peer` says why when another did (the watcher sets `peer_failure`
    before it aborts this rank's groups). Through `store`, else the store the default
    group rendezvoused through; inert without either (no group, or not a TCP store)."""

    def __init__(self, store: Optional[dist.Store] = None) -> None:
        self.peer_failure: Optional[str] = None
        self._stopped = threading.Event()
        self._store = store if store is not None else _rendezvous_store() if _active() else None
        if self._store is None:
            return
        watching = self._store.clone()  # a connection of its own: a wait holds its connection
        threading.Thread(target=self._watch, args=(watching,), name="wildtrain-peer-watch", daemon=True).start()

    def tell_peers(self, reason: str) -> None:
        """Make every other rank's collectives raise; `reason` is what they will say. Call
        it from the training thread, which then uses no group again.

        The reason is in the store before this rank's groups go down, because a gloo peer may
        learn of the failure from its connection closing first and then reads why from the
        store (`failed_peer`). What frees whom: NCCL's abort frees the waits of the rank
        that aborts (the peers' watchers); gloo's does not, and a gloo peer's wait ends
        when this rank's connections close, which happens only when nothing else holds
        the group (in a run, DeepSpeed's engine does: there Ray's teardown of the group,
        bounded by elastic.group_shutdown_timeout_s, ends the peers)."""
        if self._store is None:
            return
        self._stopped.set()  # this rank is done; its watcher must not abort it again
        try:
            self._store.set(PEER_FAILED, reason)
        except Exception:  # noqa: BLE001 - the store is gone: so is the group, and peers see that
            pass
        global _control, _control_of
        _control = _control_of = None
        # Aborts every group and drops torch's references to them, which the watchers'
        # `abort_groups` must not do under a training thread that may be using them.
        dist.distributed_c10d._abort_process_group()

    def failed_peer(self) -> Optional[str]:
        """Another rank's reason, if one failed: asked of the store as well, since a gloo
        collective raises for the closed connection before the watcher may have woken."""
        if self.peer_failure is not None or self._store is None:
            return self.peer_failure
        try:
            return self._store.get(PEER_FAILED).decode() if self._store.check([PEER_FAILED]) else None
        except Exception:  # noqa: BLE001 - the store's host is gone: nothing to read
            return None

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self, store: dist.Store) -> None:
        while not self._stopped.is_set():
            try:
                store.wait([PEER_FAILED], _WATCH_SLICE)
                reason = store.get(PEER_FAILED).decode()
            except dist.DistStoreError:
                continue  # the slice passed with no failure
            except Exception as e:  # noqa: BLE001 - the store's host (rank 0's process) is gone
                reason = f"the worker group's rendezvous store is unreachable ({e})"
            if self._stopped.is_set():
                return
            self.peer_failure = reason
            abort_groups()
            return


@contextlib.contextmanager
def failing_together(
    rank: int, together: tuple[type[BaseException], ...] = TOGETHER, store: Optional[dist.Store] = None
) -> Iterator[PeerWatch]:
    """Run the attempt's body so that an exception on this rank ends the attempt on every
    rank: its reason goes to the others (`PeerWatch`, through `store` if given), and an error
    this rank meets because another failed is raised as `PeerFailed` with that rank's reason.
    Exceptions of the `together` types are raised by every rank at once (a planned regrow):
    they tell no one (`failures.classify` says which an error is)."""
    watch = PeerWatch(store)
    try:
        yield watch
    except BaseException as e:
        peer_failure = watch.failed_peer()
        kind = classify(e, peer_failure, together)
        if kind is FailureKind.TOGETHER:
            raise
        if kind is FailureKind.PEER:
            raise PeerFailed(rank, peer_failure) from e
        first_line = (str(e).strip().splitlines() or [""])[0][:300]
        watch.tell_peers(f"rank {rank}: {type(e).__name__}: {first_line}")
        raise
    finally:
        watch.stop()


def _rendezvous_store() -> Optional[dist.TCPStore]:
    """The TCP store the default group rendezvoused through (Ray Train's tcp:// init)."""
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, dist.TCPStore) else None


def abort_groups() -> None:
    """Abort every process group of this rank from another thread: the collectives that wait
    in them, and every later one, raise. Every one, not only the world and the control group:
    DeepSpeed reduces gradients over a group of its own. (torch's `_abort_process_group`
    would also clear the groups' registry under the training thread.)"""
    for group in list(dist.distributed_c10d._world.pg_map):
        group.abort()
