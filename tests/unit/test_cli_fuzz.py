"""Every command of `wildtrain` (and data_pipelines/prepare.py) with missing, unknown and
garbage arguments (issue 59): one line on stderr and a non-zero exit, never a traceback. The
cases are derived from each command's own parameters, and each fails in parsing or in the
checks of its input, before any service is started or reached."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from tests.conftest import REPO
from wildtrain.cli import main


def _load_prepare() -> click.Command:
    spec = importlib.util.spec_from_file_location("prepare_script", REPO / "data_pipelines" / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


PREPARE = _load_prepare()
GARBAGE = "gar\nbage\x00\U0001f600"


def commands(group: click.Group, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], click.Command]]:
    """Every command below `group`, by the words that invoke it (`("clusters", "check")`)."""
    found = []
    for name, command in group.commands.items():
        found.append(((*path, name), command))
        if isinstance(command, click.Group):
            found += commands(command, (*path, name))
    return found


def required(command: click.Command) -> list[str]:
    """Arguments that satisfy `command`'s required parameters (values no command gets to use)."""
    words = []
    for param in command.params:
        if isinstance(param, click.Option) and param.required:
            words += [param.opts[0], "x=1" if param.name in ("grid", "to") else "x"]
    words += [
        "x" for param in command.params if isinstance(param, click.Argument) and param.required and param.nargs == 1
    ]
    return words


def cases(path: tuple[str, ...], command: click.Command) -> list[tuple[str, list[str]]]:
    """(what is wrong, the arguments) for `command`: each required parameter missing, an
    unknown option, each option without its value, each typed option given garbage."""
    args = required(command)
    found = [("unknown option", [*path, *args, "--no-such-option"])]
    if args:
        found.append(("nothing given", list(path)))
    for param in command.params:
        if not isinstance(param, click.Option) or param.is_flag or param.hidden:
            continue
        option = param.opts[0]
        if param.required:
            i = args.index(option)
            found.append((f"{option} missing", [*path, *args[:i], *args[i + 2 :]]))
        found.append((f"{option} without a value", [*path, *args, option]))
        if not isinstance(param.type, click.types.StringParamType) and not isinstance(param.type, click.Path):
            found.append((f"{option} garbage", [*path, *args, option, GARBAGE]))
        if isinstance(param.type, click.types._NumberRangeBase):
            found.append((f"{option} out of range", [*path, *args, option, "-5"]))
    if not any(isinstance(p, click.Argument) and p.nargs == -1 for p in command.params):
        # Past the optional arguments too (report's RUN), or it would be taken for one.
        optional = ["x" for p in command.params if isinstance(p, click.Argument) and not p.required]
        found.append(("extra argument", [*path, *args, *optional, GARBAGE]))
    return found


CASES = [
    pytest.param(args, id=f"{' '.join(path)}: {what}")
    for path, command in commands(main)
    for what, args in cases(path, command)
]
# Input each command checks before it starts anything: overrides, grids, clusters of the
# registry, locations.
CHECKED = [
    ["train", GARBAGE],
    ["train", "model.n_heads=0"],
    ["train", "experiment=../x"],
    ["config", f"model.dim={GARBAGE}"],
    ["config", "data.datasets={uri: x}"],
    ["sweep", "abl", "--grid", GARBAGE, "--dry-run"],
    ["sweep", "abl", "--grid", "optim.lr=", "--dry-run"],
    ["sweep", "abl", "--grid", "optim.lr=1,2", "--cluster", "no-such-cluster"],
    ["export", "r", "--out", "x", "model.dim=abc"],
    ["sample", "r", "--prompt", "p", "--max-tokens", "0"],
    ["eval", "r", "train.steps=-1"],
    ["submit", "--cluster", "no-such-cluster"],
    ["clusters", "check", "no-such-cluster"],
    ["sync", "no-such-cluster:runs/x", "/tmp/x"],
    ["sync", "x", "no-such-cluster:nothing/x"],
    ["move", "r", "--from", "no-such-cluster", "--to", "other"],
    ["report"],
    ["promote", "s", "--to", "model=7b", "--submit"],
    ["up", "--ray-port", "99999"],
]


def one_line_and_no_traceback(result, args) -> None:
    assert result.exit_code not in (0, None), f"{args}: exit {result.exit_code}\n{result.output}"
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), (
        f"{args}: {result.exception!r}"
    )
    assert "Traceback" not in result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].split(": ")[0] in ("wildtrain", "prepare"), f"{args}: {result.stderr!r}"


@pytest.mark.parametrize("args", CASES)
def test_a_usage_mistake_is_one_line(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # `up` and `down` would keep their state in ./.wildtrain
    one_line_and_no_traceback(CliRunner().invoke(main, args), args)


@pytest.mark.parametrize("args", CHECKED, ids=lambda args: " ".join(args).replace("\n", "\\n"))
def test_input_the_command_checks_is_refused_in_one_line(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WILDTRAIN_CLUSTERS", str(REPO / "ray_clusters" / "clusters.yaml"))
    one_line_and_no_traceback(CliRunner().invoke(main, args), args)


@pytest.mark.parametrize("what, args", cases((), PREPARE), ids=lambda v: v if isinstance(v, str) else "")
def test_prepare_usage_mistakes_are_one_line(what, args):
    one_line_and_no_traceback(CliRunner().invoke(PREPARE, args), args)


def test_every_command_is_fuzzed():
    fuzzed = {args[0] for args in (case.values[0] for case in CASES)}
    listed = {
        "train",
        "config",
        "export",
        "eval",
        "sample",
        "sweep",
        "submit",
        "move",
        "sync",
        "clusters",
        "up",
        "down",
    }
    assert listed | {"report", "promote", "fit"} == fuzzed == set(main.commands)


@pytest.mark.parametrize(
    "args", [["train", "--no-such-option"], ["export"], ["sample", "r", "--prompt", "p", "--step", "gar\nbage"]]
)
def test_the_installed_command_prints_no_traceback(args):
    done = subprocess.run(
        [sys.executable, "-m", "wildtrain", *args], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("wildtrain: "), done.stderr


def test_a_usage_error_names_the_command_the_mistake_and_where_help_is():
    result = CliRunner().invoke(main, ["export", "r"], prog_name="wildtrain")
    assert result.stderr == "wildtrain: export: Missing option '--out'. (see wildtrain export --help)\n"
    result = CliRunner().invoke(main, ["clusters", "check"])
    assert result.stderr.startswith("wildtrain: clusters check: Missing argument 'NAME'.")
    assert CliRunner().invoke(main, ["--help"]).exit_code == 0
