"""What every local service needs: a free port on 127.0.0.1, a wait until it answers that
says why it did not, a stop of its process group, and a folder only its owner reads."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

HOST = "127.0.0.1"


class ServiceError(RuntimeError):
    pass


# Ports handed out by `free_port` (or claimed by `claim_ports`) in this process: the kernel
# often gives a port that was just released again at once, before whoever it was chosen for
# has bound it, so two services of one `up` would get the same one.
_handed_out: set[int] = set()


def claim_ports(ports) -> None:
    """Keep `free_port` from handing out `ports`, which are chosen already."""
    _handed_out.update(ports)


def free_port() -> int:
    for _ in range(100):
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise ServiceError(f"no free port on {HOST} that this process has not handed out already")


def free_port_with_offset(offset: int) -> int:
    """A free port p such that p + `offset` is free too."""
    for _ in range(100):
        port = free_port()
        if port + offset <= 65535:
            with socket.socket() as s:
                try:
                    s.bind((HOST, port + offset))
                except OSError:
                    continue
            return port
    raise ServiceError(f"no free port p with p + {offset} also free on {HOST}")


def is_healthy(url: str, timeout_s: float = 2.0) -> bool:
    """True once `url` answers; a 401 counts, since Ray's token auth guards its APIs."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except urllib.error.HTTPError as e:
        return e.code == 401
    except OSError:
        return False


def wait_healthy(url: str, process: subprocess.Popen | None, log: Path, timeout_s: float) -> None:
    wait_until(lambda: is_healthy(url), f"{url} did not answer", process, log, timeout_s)


def wait_until(
    ready: Callable[[], bool], failure: str, process: subprocess.Popen | None, log: Path, timeout_s: float
) -> None:
    """Poll `ready` until it holds; if `process` exits first or time runs out, raise with the
    end of its log, which says why far better than a timeout does."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if process is not None and process.poll() is not None:
            raise ServiceError(f"{' '.join(process.args[:4])} exited with {process.returncode}; see {log}{_tail(log)}")
        if time.monotonic() > deadline:
            raise ServiceError(f"{failure} within {timeout_s:g} s; see {log}{_tail(log)}")
        time.sleep(0.2)


def _tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:  # not every service has a log file of its own
        return ""


def stop_process(pid: int, timeout_s: float = 15.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after `timeout_s`."""
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if _exited(pid):
                return
            time.sleep(0.1)


def _exited(pid: int) -> bool:
    try:
        # A child of this process (a test fixture's server) stays a zombie, which signal 0
        # still finds, until it is reaped here.
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
    except ChildProcessError:  # not our child: its own parent reaps it
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def private_dir(path: Path) -> Path:
    """`path` created readable by its owner only: it holds the user's data and keys."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)  # mkdir leaves an existing folder's mode as it was
    return path
