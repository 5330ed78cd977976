"""Reading the layers of a config (conf/ files, command-line overrides) and checking each
against the schema before OmegaConf merges them, so every mistake is a `ConfigError` that
starts with the full key path. Old names of moved keys (`RENAMED`) are read with a warning."""

from __future__ import annotations

import difflib
import functools
import re
import types
import typing
import warnings
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import BooleanNode, FloatNode, IntegerNode, OmegaConf, StringNode
from omegaconf.errors import OmegaConfBaseException, ValidationError

from wildtrain.config.errors import ConfigError
from wildtrain.config.schema import GROUPS, RENAMED, Config

# The first line of a group's file that sets keys of other sections too, as Hydra spells it:
# its keys are full paths from the top (cluster.name, checkpoint.reshard_ahead), not its group's.
GLOBAL_PACKAGE = "# @package _global_"
# A choice of conf/<group>/ or conf/experiment/: a file name there, never a path.
_CHOICE = re.compile(r"\w[\w.-]*")
# What OmegaConf reads as bracket syntax or an escape inside a key.
_NOT_IN_KEYS = re.compile(r"[\[\]\\]")


def split_overrides(overrides: list[str]) -> tuple[dict[str, str], Optional[str], list[tuple[str, Any]]]:
    """Group choices, the experiment, and the dotlist as (key, value) pairs, each checked
    against the schema before any file is read."""
    groups: dict[str, str] = {}
    experiment = None
    dotlist = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or "" in key.split("."):
            raise ConfigError(f"{item}: an override must look like key=value")
        if key == "experiment" or key in GROUPS:
            if not _CHOICE.fullmatch(text):
                raise ConfigError(f"{item}: {text!r} is not the name of a file in conf/{key}/")
            if key == "experiment":
                experiment = text
            else:
                groups[key] = text
            continue
        if key in RENAMED:
            key = _renamed(key, "on the command line")
        declared = _type_at(key)
        value = _parse_value(key, text)
        check(value, declared, key)
        dotlist.append((key, value))
    return groups, experiment, dotlist


def _parse_value(key: str, text: str) -> Any:
    """`text` read as YAML, as OmegaConf reads a dotlist's values."""
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([f"value={text}"]))["value"]
    except Exception as e:  # PyYAML's errors and OmegaConf's (a key YAML reads as a list)
        raise ConfigError(f"{key}: {text!r} is not a value ({_first_line(e)})") from None


def _renamed(old: str, where: str) -> str:
    new = RENAMED[old]
    warnings.warn(
        f"{old} ({where}) is now {new}; the old name is read until the next release", FutureWarning, stacklevel=3
    )
    return new


def move_renamed(layer: dict, where: str) -> None:
    """The old names a YAML layer sets moved to their new homes, in place."""
    for old, new in RENAMED.items():
        section, _, name = old.partition(".")
        home, _, new_name = new.partition(".")
        if not isinstance(layer.get(section), dict) or name not in layer[section]:
            continue
        if layer.get(home) is None:
            layer[home] = {}
        if not isinstance(layer[home], dict):
            continue  # `check` names what is wrong with it
        if new_name in layer[home]:
            raise ConfigError(f"{old}: now {new}, which {where} also sets: keep only {new}")
        layer[home][new_name] = layer[section].pop(name)
        _renamed(old, f"in {where}")


def _first_line(e: Exception) -> str:
    """What is wrong, without PyYAML's multi-line excerpt of where."""
    return getattr(e, "problem", None) or str(e).splitlines()[0]


def read_yaml(path: Path, kind: str = "config") -> dict:
    if not path.is_file():
        choices = sorted(p.stem for p in path.parent.glob("*.yaml")) if path.parent.is_dir() else []
        hint = f" (available: {', '.join(choices)})" if choices else ""
        raise ConfigError(f"{kind}={path.stem}: no such file {path}{hint}")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as e:
        raise ConfigError(f"{path}: not valid YAML: {_first_line(e)}") from None
    if not isinstance(data or {}, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values, got a list")
    return data or {}


def group_layer(conf_dir: Path, group: str, choice: str) -> dict:
    """conf/<group>/<choice>.yaml as a layer of the whole config: below its group's key, or
    from the top where it starts with `GLOBAL_PACKAGE`."""
    path = conf_dir / group / f"{choice}.yaml"
    data = read_yaml(path, kind=group)
    return data if path.read_text().startswith(GLOBAL_PACKAGE) else {group: data}


def layer_keys(layer: dict, prefix: str = "") -> list[str]:
    """The dotted keys a layer sets (`model.dim`, ...); a list counts as one key."""
    return [
        k
        for key, value in layer.items()
        for k in (layer_keys(value, f"{prefix}{key}.") if isinstance(value, dict) and value else [f"{prefix}{key}"])
    ]


def _required(declared: Any) -> Any:
    """`X` of `Optional[X]`; any other type as it is."""
    if typing.get_origin(declared) in (typing.Union, types.UnionType):
        return next(arg for arg in typing.get_args(declared) if arg is not type(None))
    return declared


@functools.cache
def _fields(section: type) -> dict[str, Any]:
    return typing.get_type_hints(section)


def _unknown(key: str, at: str, known: dict[str, Any]) -> str:
    parent, _, leaf = at.rpartition(".")
    guess = difflib.get_close_matches(leaf, list(known), n=1)
    hint = f" (did you mean {parent + '.' if parent else ''}{guess[0]}?)" if guess else ""
    if at in RENAMED:
        hint = f" (now {RENAMED[at]})"
    return f"{key}: unknown key{'' if at == key else ' ' + at}{hint}"


def _type_at(key: str) -> Any:
    """The declared type of `key` (`data.datasets.0.uri`); a ConfigError names the part of
    it that is no key."""
    declared: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        parent = ".".join(parts[:i])
        inner = _required(declared)
        if is_dataclass(inner):
            if part not in _fields(inner):
                raise ConfigError(_unknown(key, ".".join(parts[: i + 1]), _fields(inner)))
            declared = _fields(inner)[part]
        elif typing.get_origin(inner) is list:
            if not re.fullmatch(r"[0-9]+", part):
                raise ConfigError(f"{key}: {parent} is a list, and {part!r} is not an item number")
            declared = typing.get_args(inner)[0]
        elif typing.get_origin(inner) is dict:
            if _NOT_IN_KEYS.search(part):
                raise ConfigError(f"{key}: a key may not contain [, ] or \\")
            declared = typing.get_args(inner)[1]
        else:
            raise ConfigError(f"{key}: {parent} ({_type_name(declared)}) has no keys below it")
    return declared


def _type_name(declared: Any) -> str:
    inner = _required(declared)
    if inner is not declared:
        return f"{_type_name(inner)} or null"
    if is_dataclass(inner):
        return f"a mapping of {', '.join(_fields(inner))}"
    if typing.get_origin(inner) is list:
        return f"a list of {_type_name(typing.get_args(inner)[0])}"
    if typing.get_origin(inner) is dict:
        return f"a mapping of names to {_type_name(typing.get_args(inner)[1])}"
    return inner.__name__


# What OmegaConf converts a scalar with (a str "3" to the int 3); the same conversions here.
_SCALARS = {int: IntegerNode, float: FloatNode, bool: BooleanNode, str: StringNode}


def check(value: Any, declared: Any, path: str) -> None:
    """A ConfigError naming the full key of the first thing in `value` (a YAML layer, an
    override's value) that the `declared` type cannot hold. OmegaConf's own errors name keys
    inside list items without the list (`w: unknown key` for data.datasets.0.w), and it lets
    lists and mappings into a mapping or list of strings (run.tags, eval.tasks)."""
    if isinstance(value, str) and "${" in value:
        return  # an interpolation: OmegaConf checks what it resolves to
    if value == "???":
        raise ConfigError(f"{path}: ??? (OmegaConf's missing value) is not a value")
    inner = _required(declared)
    if value is None:
        if inner is declared:
            raise ConfigError(f"{path}: expected {_type_name(declared)}, got null")
        return
    if is_dataclass(inner) or typing.get_origin(inner) is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected {_type_name(inner)}, got {value!r}")
        for name, item in value.items():
            key = f"{path}.{name}" if path else str(name)
            if item is None and ":" in str(name):  # `{w:1}`: YAML's flow mappings need `: `
                written = str(name).replace(":", ": ", 1)
                raise ConfigError(
                    f"{path or key}: {{{name}}} reads as the key {name!r} without a value: write {{{written}}}"
                )
            if is_dataclass(inner):
                if name not in _fields(inner):
                    raise ConfigError(_unknown(key, key, _fields(inner)))
                check(item, _fields(inner)[name], key)
            else:
                if not isinstance(name, str):
                    raise ConfigError(f"{key}: the names in {path} must be text, not {type(name).__name__}")
                check(item, typing.get_args(inner)[1], key)
    elif typing.get_origin(inner) is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, e.g. {path}=[a,b]")
        for i, item in enumerate(value):
            check(item, typing.get_args(inner)[0], f"{path}.{i}")
    elif isinstance(value, (dict, list)) or not _holds(inner, value):
        raise ConfigError(f"{path}: expected {_type_name(declared)}, got {value!r} ({type(value).__name__})")


def _holds(scalar: type, value: Any) -> bool:
    try:
        _SCALARS[scalar](value)
    except ValidationError:
        return False
    return True


def check_item_numbers(merged: Any, key: str) -> None:
    """An item past the end of its list (OmegaConf would call it the wrong type)."""
    parts = key.split(".")
    for i in range(1, len(parts)):
        at = ".".join(parts[:i])
        if typing.get_origin(_required(_type_at(at))) is list:
            items = len(OmegaConf.select(merged, at))
            if int(parts[i]) >= items:
                numbers = f" (0..{items - 1})" if items > 1 else " (0)" if items else ""
                raise ConfigError(
                    f"{key}: {at} has {items} item{'' if items == 1 else 's'}{numbers}; set the whole list: {at}=[...]"
                )


def explain(e: OmegaConfBaseException, at: Optional[str]) -> str:
    """`full.key: what is wrong` for what OmegaConf finds beyond `_check`: interpolations
    that do not resolve, or resolve to the wrong type."""
    key = re.sub(r"\[(\w+)\]", r".\1", getattr(e, "full_key", None) or "") or at or "config"
    return f"{key}: {str(e).splitlines()[0]}"
