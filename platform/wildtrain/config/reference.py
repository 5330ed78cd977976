"""The configuration reference (docs/configuration.md), rendered from the config classes so
that it cannot drift from them: every key with its type, default, allowed values (its
`setting(...)`, config/allowed.py) and meaning (the first sentence of the comment above its
field), then the config groups of conf/."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wildtrain.config.allowed import allowed_of, field_types, is_nullable
from wildtrain.config.overrides import group_layer, layer_keys, read_yaml
from wildtrain.config.schema import GROUPS, Config

# A sentence ends at a full stop before a capital, a backtick or a bracket, except after
# "e.g." and "i.e.".
_SENTENCE_END = re.compile(r"(?<=[.!?])(?<!e\.g\.)(?<!i\.e\.)\s+(?=[A-Z`(\[])")


@dataclass(frozen=True)
class Entry:
    """One row of a section's table; `key` is the full dotted path, list items' keys as
    `data.datasets[].uri`."""

    key: str
    type: str
    default: str
    allowed: str
    meaning: str


@functools.cache
def field_comments(section: type) -> dict[str, str]:
    """Each field's comment in the class source: the `#` lines right above it, or, for a
    field right below another without a blank line, the comment of the group it is in."""
    source = textwrap.dedent(inspect.getsource(section))
    lines = source.splitlines()
    comments: dict[str, str] = {}
    group, previous_end = "", None
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            previous_end = None
            continue
        above, at = [], node.lineno - 2
        while at >= 0 and lines[at].strip().startswith("#"):
            above.insert(0, lines[at].strip().lstrip("#").strip())
            at -= 1
        if above:
            group = " ".join(above)
        elif previous_end != node.lineno - 1:
            group = ""
        comments[node.target.id] = group
        previous_end = node.end_lineno
    return comments


def first_sentence(text: str) -> str:
    return _SENTENCE_END.split(text, maxsplit=1)[0]


def type_name(declared: Any) -> str:
    if is_nullable(declared):
        inner = next(arg for arg in typing.get_args(declared) if arg is not type(None))
        return f"{type_name(inner)} or null"
    origin, args = typing.get_origin(declared), typing.get_args(declared)
    if origin is list:
        return "list of items (below)" if dataclasses.is_dataclass(args[0]) else f"list of {type_name(args[0])}"
    if origin is dict:
        return f"map of {type_name(args[0])} to {type_name(args[1])}"
    return declared.__name__


def default_of(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
        return f"{len(value)} item{'' if len(value) == 1 else 's'} of the defaults below"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def entries(section: type, prefix: str) -> list[Entry]:
    """The rows of `section`'s keys under `prefix` (`model.`), each list of dataclasses
    followed by its items' keys."""
    types, comments = field_types(section), field_comments(section)
    rows = []
    for f in dataclasses.fields(section):
        declared, key = types[f.name], f"{prefix}{f.name}"
        allowed = allowed_of(f)
        rows.append(
            Entry(
                key=key,
                type=type_name(declared),
                default=default_of(f),
                allowed=allowed.describe(is_nullable(declared)) if allowed else "any",
                meaning=first_sentence(comments[f.name]),
            )
        )
        if typing.get_origin(declared) is list and dataclasses.is_dataclass(typing.get_args(declared)[0]):
            rows.extend(entries(typing.get_args(declared)[0], f"{key}[]."))
    return rows


def section_doc(section: type) -> str:
    """The class docstring, less what dataclass writes where there is none (its signature)."""
    doc = inspect.getdoc(section) or ""
    return "" if doc.startswith(f"{section.__name__}(") else doc


def _cell(text: str) -> str:
    """`text` safe in a table cell: outside code spans, `<run.storage>` would read as an HTML
    tag and `|` as a column."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", r"\|")
    return "`".join(parts)


def render_section(name: str, section: type) -> str:
    rows = [
        f"## {name}",
        "",
        *([section_doc(section), ""] if section_doc(section) else []),
        "| Key | Type | Default | Allowed | Meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for entry in entries(section, f"{name}."):
        cells = (f"`{entry.key}`", entry.type, entry.default, _cell(entry.allowed), _cell(entry.meaning))
        rows.append(f"| {' | '.join(cells)} |")
    return "\n".join(rows) + "\n"


def render_groups(conf_dir: Path) -> str:
    """A table of the config groups: each one's files in conf/<group>/, the one
    conf/config.yaml picks, and the keys its files set."""
    picked = read_yaml(conf_dir / "config.yaml").get("defaults") or {}
    rows = [
        "## Config groups",
        "",
        "Pick a file of a group with `group=choice` (`model=125m`); its keys then replace the "
        "defaults above, and an experiment (`experiment=name`, conf/experiment/) may pick "
        "other files and change any key.",
        "",
        "| Group | Choices | Picked by conf/config.yaml | Keys its files set |",
        "| --- | --- | --- | --- |",
    ]
    for group in (*GROUPS, "experiment"):
        choices = sorted(path.stem for path in (conf_dir / group).glob("*.yaml"))
        keys = sorted({key for choice in choices for key in layer_keys(_layer(conf_dir, group, choice))})
        shown = ", ".join(f"`{key}`" for key in keys)
        default = f"`{picked[group]}`" if group in picked else "none"
        rows.append(f"| `{group}` | {', '.join(f'`{c}`' for c in choices)} | {default} | {shown} |")
    return "\n".join(rows) + "\n"


def _layer(conf_dir: Path, group: str, choice: str) -> dict:
    """What a group's file sets; an experiment's `defaults:` picks files, and sets no key."""
    if group != "experiment":
        return group_layer(conf_dir, group, choice)
    layer = read_yaml(conf_dir / group / f"{choice}.yaml", kind=group)
    layer.pop("defaults", None)
    return layer


def render(conf_dir: Path) -> str:
    """The whole reference, in Markdown: a section per config section, then the groups of `conf_dir`."""
    sections = [render_section(f.name, field_types(Config)[f.name]) for f in dataclasses.fields(Config)]
    return "\n".join([*sections, render_groups(conf_dir)])


class _Placeholder:
    """What a message shows where it quotes the value given: `<value>`."""

    def __repr__(self) -> str:
        return "<value>"

    __str__ = __repr__


def declared_refusals(section: type = Config, prefix: str = "") -> list[tuple[str, str]]:
    """(key, the line its `setting(...)` refuses a value with) for every declared key, list
    items' keys as `data.datasets.<n>.uri`."""
    rows = []
    for f in dataclasses.fields(section):
        declared, key = field_types(section)[f.name], f"{prefix}{f.name}"
        allowed = allowed_of(f)
        if allowed is not None:
            rows.append((key, allowed.refusal(key, _Placeholder(), is_nullable(declared))))
        inner = typing.get_args(declared)[0] if typing.get_origin(declared) is list else declared
        if dataclasses.is_dataclass(inner):
            rows.extend(declared_refusals(inner, f"{key}.<n>." if inner is not declared else f"{key}."))
    return rows


def _template(node: ast.expr) -> str:
    """An f-string's text, each name in it as `<name>` (`<n_heads>` for `self.n_heads`) and
    any other expression as `<...>`."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(_template(part) for part in node.values)
    if isinstance(node, ast.FormattedValue) and isinstance(node.value, (ast.Name, ast.Attribute)):
        return f"<{ast.unparse(node.value).removeprefix('self.').removeprefix('cfg.')}>"
    return "<...>"


def raised_messages(modules: list) -> list[str]:
    """The message of every `raise ConfigError(...)` in `modules`' source, as a template, in
    source order; one made by a function of theirs (`explain`) as each of its returns."""
    trees = [ast.parse(inspect.getsource(module)) for module in modules]
    returned = {
        node.name: [r.value for r in ast.walk(node) if isinstance(r, ast.Return) and isinstance(r.value, ast.JoinedStr)]
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
    }
    found = []
    for tree in trees:
        raises = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Raise)), key=lambda n: n.lineno)
        for node in raises:
            call = node.exc
            if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "ConfigError" and call.args):
                continue
            made = call.args[0]
            if isinstance(made, ast.Call) and getattr(made.func, "id", None) in returned:
                found += [_template(text) for text in returned[made.func.id]]
            elif isinstance(made, (ast.JoinedStr, ast.Constant)):
                found.append(_template(made))
    return list(dict.fromkeys(found))


def render_messages() -> str:
    """Every line a setting's check can print, in Markdown: each declared key's refusal, then
    the relations between keys, the types and the overrides' form (config/checks.py, the
    sections' `validate()`, config/overrides.py, config/allowed.py)."""
    import wildtrain.config as package
    from wildtrain.config import allowed, checks, overrides, system, training

    rows = [
        "| Key | Message |",
        "| --- | --- |",
        *(f"| `{key}` | `{message}` |" for key, message in declared_refusals()),
        "",
        "Relations between keys, and the checks of every value's type and of the overrides' form "
        "(`<...>` stands for what the line shows there):",
        "",
        *(f"- `{message}`" for message in raised_messages([checks, training, system, allowed, package, overrides])),
    ]
    return "\n".join(rows) + "\n"
