"""What every `wildtrain` command shares: its OVERRIDES and the config they resolve to, and
the one place where its known errors become one line on stderr and an exit code
(`one_line_errors`)."""

from __future__ import annotations

import functools
import sys

import click

from wildtrain.clusters import registry
from wildtrain.config import Config, load_config, redact

OVERRIDES = click.argument("overrides", nargs=-1)


def resolve_config(overrides: tuple[str, ...]) -> Config:
    """conf/ with OVERRIDES, where `cluster=NAME` of the registry brings that cluster's settings."""
    return load_config(registry.expand(list(overrides)))


def fail(message: str, code: int) -> None:
    """End the command with `message` as one line on stderr and exit `code`."""
    # Errors quote addresses from the config, which may carry a user:password.
    click.secho(f"wildtrain: {redact(message)}", fg="red", err=True)
    sys.exit(code)


# The errors a user can act on, by class name: their modules load Ray, DeepSpeed or MLflow,
# which a command must not wait for before it knows its input is good. A setting's (exit 2)
# or a run's, its data's, its store's, its cluster's (exit 1). tests/unit/test_cli.py checks
# that wildtrain defines each.
SETTING_ERRORS = frozenset({"ConfigError", "GridError"})
RUN_ERRORS = frozenset(
    {
        "CapacityError",
        "ClusterError",
        "DataError",
        "EvalError",
        "ExportError",
        "FitError",
        "LeaseError",
        "NotExpressible",
        "PromoteError",
        "RunFailed",
        "SampleError",
        "ServiceError",
        "StorageError",
        "SweepError",
        "SyncError",
        "TrackingError",
    }
)


def _is_one_of(error: Exception, names: frozenset[str]) -> bool:
    return any(cls.__name__ in names and cls.__module__.startswith("wildtrain.") for cls in type(error).__mro__)


def one_line_errors(*also: type[Exception]):
    """A command that ends on a known error with one line on stderr: exit 2 for a setting's
    (SETTING_ERRORS), 1 for the others (RUN_ERRORS and `also`); any other error is a bug,
    and keeps its traceback."""

    def decorate(command):
        @functools.wraps(command)
        def run(*args, **kwargs):
            try:
                return command(*args, **kwargs)
            except Exception as e:
                if _is_one_of(e, SETTING_ERRORS):
                    fail(str(e), 2)
                if _is_one_of(e, RUN_ERRORS) or isinstance(e, also):
                    fail(str(e), 1)
                raise

        return run

    return decorate
