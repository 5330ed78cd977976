"""What a process that joins a Ray cluster needs: which head (`ray_address`), the settings
to reach it before Ray is imported (`prepare_ray_client`), and how its dashboard is
signed in to (`dashboard_text`); joining it (`connect_ray`)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Optional

from wildtrain.config import redact
from wildtrain.services.process import ServiceError
from wildtrain.services.ray_head import LOOPBACK_ONLY_ENV, ray_cli
from wildtrain.services.state import DEFAULT_STATE_DIR, recorded_address

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def choose_ray_address(
    configured: Optional[str], environ_address: Optional[str], recorded: Optional[str], state_file: Path
) -> str:
    """The cluster a run joins: `cluster.ray_address`, else $RAY_ADDRESS, else the head
    `wildtrain up` recorded in `state_file`. Never a private Ray started on the spot: its
    CPUs would be whatever this machine has, not what the run was sized for, and a run that
    cannot get them waits forever."""
    for address in (configured, environ_address, recorded):
        if address:
            return address
    raise ServiceError(
        f"cluster.ray_address: not set, RAY_ADDRESS is not set and there is no {state_file.absolute()}; "
        f"run `wildtrain up` to start the local services, or set cluster.ray_address "
        f"(or RAY_ADDRESS) to a running cluster"
    )


def ray_address(configured: Optional[str], state_dir: Path = DEFAULT_STATE_DIR) -> str:
    return choose_ray_address(
        configured, os.environ.get("RAY_ADDRESS"), recorded_address(state_dir), state_dir / "services.json"
    )


def is_loopback(address: str) -> bool:
    return address.rsplit(":", 1)[0].strip("[]") in LOOPBACK_HOSTS


def prepare_ray_client(configured: Optional[str], state_dir: Path = DEFAULT_STATE_DIR) -> None:
    """Let this process reach the head the run will join where that is a loopback-only one
    or `wildtrain up`'s (which requires Ray's token authentication); call before Ray is
    imported, which reads both settings once. Where there is no head to join, the driver
    says so, after the checks a user should hear about first (data, MLflow)."""
    try:
        address = ray_address(configured, state_dir)
    except ServiceError:
        return
    if is_loopback(address):
        os.environ.update(LOOPBACK_ONLY_ENV)
    if address == recorded_address(state_dir):
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def connect_ray(configured: Optional[str]) -> Optional[str]:
    """Join the chosen cluster (`cluster.ray_address` as `configured`, see `choose_ray_address`)
    unless this process already has (a test fixture, a caller with its own `ray.init`); the
    dashboard URL."""
    import ray  # here: `prepare_ray_client` must run before Ray is imported

    from wildtrain import ray_compat

    if not ray.is_initialized():
        # Ray's INFO lines say it is connecting and where the dashboard is: printed by the run.
        ray.init(address=ray_address(configured), logging_level=logging.WARNING)
    url = ray_compat.dashboard_url()
    if not url:
        return None
    return redact(url if url.startswith("http") else f"http://{url}")


def token_command() -> str:
    """The command that prints the token of Ray's token authentication (`token_auth_env`), as
    a shell can run it: the `ray` beside this Python, by its path where PATH finds another
    (`make demo` runs .venv/bin/wildtrain from a shell without the venv)."""
    ours = ray_cli()
    return f"{'ray' if shutil.which('ray') == ours else ours} get-auth-token"


def uses_token_auth() -> bool:
    """Whether this process's Ray authenticates with a token (`prepare_ray_client`)."""
    return os.environ.get("RAY_AUTH_MODE") == "token"


def dashboard_text(url: str, token_auth: bool) -> str:
    """The dashboard's address as printed: under token authentication its sign-in asks for
    the token, so with the command that prints it; never the token itself, which would stay
    in terminals' scrollback, job logs and CI output."""
    return f"{url} (sign in with the token `{token_command()}` prints)" if token_auth else url
