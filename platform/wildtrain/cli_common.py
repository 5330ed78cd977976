"""What every `wildtrain` command shares: its OVERRIDES and the config they resolve to, and
the one place where its known errors become one line on stderr and an exit code
(`one_line_errors`), its usage errors too (`OneLineUsage`)."""

from __future__ import annotations

import contextlib
import functools
import sys

import click

from wildtrain.clusters import registry
from wildtrain.config import Config, load_config, redact

OVERRIDES = click.argument("overrides", nargs=-1)


def resolve_config(overrides: tuple[str, ...]) -> Config:
    """conf/ with OVERRIDES, where `cluster=NAME` of the registry brings that cluster's settings."""
    return load_config(registry.expand(list(overrides)))


def one_line(text: str) -> str:
    """`text` with its line breaks and other unprintable characters escaped (`\\n`, `\\ud83d`):
    errors quote what the user typed, which may hold them."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def fail(message: str, code: int) -> None:
    """End the command with `message` as one line on stderr and exit `code`."""
    # Errors quote addresses from the config, which may carry a user:password.
    click.secho(f"wildtrain: {one_line(redact(message))}", fg="red", err=True)
    sys.exit(code)


class _UsageLine(click.ClickException):
    """A usage error (a missing or unknown argument, an option's value of the wrong type)
    shown as one line, as the commands' own errors are, instead of click's usage block."""

    def __init__(self, error: click.ClickException, prefix: str) -> None:
        ctx = getattr(error, "ctx", None)
        # A subcommand's error names it below the top command, which the prefix names.
        below = ctx.command_path.partition(" ")[2] if ctx is not None else ""
        where = f"{below}: " if below else ""
        hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        super().__init__(f"{where}{error.format_message()}{hint}")
        self.exit_code = error.exit_code
        self.prefix = prefix

    def show(self, file=None) -> None:
        click.secho(f"{self.prefix}: {one_line(self.message)}", fg="red", err=True)


@contextlib.contextmanager
def _usage_in_one_line(prefix: str):
    try:
        yield
    except click.exceptions.NoArgsIsHelpError:
        raise  # the command alone: its help, as click shows it
    except click.ClickException as e:
        raise e if isinstance(e, _UsageLine) else _UsageLine(e, prefix) from None


class OneLineUsage(click.Group):
    """A group whose commands' (and subgroups') usage errors are one line on stderr, `wildtrain:
    <command>: <what is wrong>`, with click's exit code (2)."""

    prefix = "wildtrain"

    def make_context(self, *args, **kwargs) -> click.Context:
        with _usage_in_one_line(self.prefix):
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: click.Context):
        with _usage_in_one_line(self.prefix):
            return super().invoke(ctx)


class OneLineUsageCommand(click.Command):
    """`OneLineUsage` for a script of a single command, its errors prefixed by `prefix`:
    `@click.command(cls=OneLineUsageCommand, prefix="prepare")`."""

    def __init__(self, *args, prefix: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prefix = prefix

    def make_context(self, *args, **kwargs) -> click.Context:
        with _usage_in_one_line(self.prefix):
            return super().make_context(*args, **kwargs)


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
