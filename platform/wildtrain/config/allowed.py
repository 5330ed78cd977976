"""Each setting's valid values, declared once beside its field with `setting(...)`, and the
one check that walks every section against them (`check_declared`). The same declaration
words the error and the configuration reference (config/reference.py). Relations between
fields (`dim % n_heads`, `min_workers <= max_workers`) stay in the sections' `validate()`
and in config/checks.py."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any, Optional

from wildtrain.config.errors import ConfigError

# Where `setting` files its declaration in a dataclass field's metadata.
_METADATA_KEY = "wildtrain.allowed"
# What every integer setting fits in: torch's and numpy's integers, which sizes, seeds and
# steps end up in, are 64-bit.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class Allowed:
    """The values a setting takes: a range (bounds `gt`/`ge` below, `lt`/`le` above), a set
    of `choices`, or a list that is `nonempty`. `special` is one value outside the range and
    what it means (`(0, "off")`); `note` says what part of the range means (a share below 1)."""

    gt: Optional[float] = None
    ge: Optional[float] = None
    lt: Optional[float] = None
    le: Optional[float] = None
    choices: tuple = ()
    nonempty: bool = False
    special: Optional[tuple[Any, str]] = None
    note: Optional[str] = None

    def admits(self, value: Any) -> bool:
        if self.special is not None and value == self.special[0]:
            return True
        if self.choices:
            return value in self.choices
        if self.nonempty:
            return len(value) > 0
        # Written as what must hold, so that NaN, which fails every comparison, is refused.
        return (
            (self.gt is None or value > self.gt)
            and (self.ge is None or value >= self.ge)
            and (self.lt is None or value < self.lt)
            and (self.le is None or value <= self.le)
        )

    def describe(self, nullable: bool = False) -> str:
        """The allowed values in words: `positive`, `0 (off) or positive`, `one of a, b`,
        `positive or null`; what the reference shows and an error says after `must be`."""
        if self.choices:
            phrase = f"one of {', '.join(map(str, self.choices))}"
        elif self.nonempty:
            phrase = "non-empty"
        else:
            phrase = self._range()
        if self.note:
            phrase += f" ({self.note})"
        if self.special is not None:
            phrase = f"{self.special[0]} ({self.special[1]}) or {phrase}"
        return f"{phrase} or null" if nullable else phrase

    def _range(self) -> str:
        low = ("above", self.gt) if self.gt is not None else ("at least", self.ge) if self.ge is not None else None
        high = ("below", self.lt) if self.lt is not None else ("at most", self.le) if self.le is not None else None
        if low and high:
            if (low[0], high[0]) == ("above", "below"):
                return f"between {low[1]:g} and {high[1]:g} (exclusive)"
            if (low[0], high[0]) == ("at least", "at most"):
                return f"between {low[1]:g} and {high[1]:g} (inclusive)"
            return f"{low[0]} {low[1]:g} and {high[0]} {high[1]:g}"
        if low == ("above", 0):
            return "positive"
        bound = low or high
        return f"{bound[0]} {bound[1]:g}" if bound else "any"

    def refusal(self, key: str, value: Any, nullable: bool) -> str:
        """The one line a value outside the declaration gets: the key, what is allowed, the value."""
        if self.choices:
            return f"{key}: expected one of {', '.join(map(str, self.choices))}, got {value!r}"
        shown = repr(value) if isinstance(value, str) else value
        return f"{key}: must be {self.describe(nullable)}, got {shown}"


def setting(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    gt: Optional[float] = None,
    ge: Optional[float] = None,
    lt: Optional[float] = None,
    le: Optional[float] = None,
    choices: tuple = (),
    nonempty: bool = False,
    special: Optional[tuple[Any, str]] = None,
    note: Optional[str] = None,
) -> Any:
    """A dataclass field whose valid values are declared beside it: `n_heads: int =
    setting(4, gt=0)`. OmegaConf's structured configs read the field as any other."""
    allowed = Allowed(gt, ge, lt, le, tuple(choices), nonempty, special, note)
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_METADATA_KEY: allowed})


def allowed_of(f: dataclasses.Field) -> Optional[Allowed]:
    """The declaration of a field; None where any value of its type suits it."""
    return f.metadata.get(_METADATA_KEY)


@functools.cache
def field_types(section: type) -> dict[str, Any]:
    return typing.get_type_hints(section)


def is_nullable(declared: Any) -> bool:
    return typing.get_origin(declared) in (typing.Union, types.UnionType) and type(None) in typing.get_args(declared)


def check_declared(section: Any, prefix: str = "") -> None:
    """A ConfigError, naming the full key, for the first value in `section` (the whole
    `Config`, a section, a list's item) outside its declaration; list items are walked as
    `data.datasets.0`."""
    for f in dataclasses.fields(section):
        key = f"{prefix}{f.name}"
        value = getattr(section, f.name)
        allowed = allowed_of(f)
        if type(value) is int and not INT64_MIN <= value <= INT64_MAX:
            raise ConfigError(f"{key}: must fit in a 64-bit integer, got {value}")
        if allowed is not None and value is not None and not allowed.admits(value):
            raise ConfigError(allowed.refusal(key, value, is_nullable(field_types(type(section))[f.name])))
        if dataclasses.is_dataclass(value):
            check_declared(value, f"{key}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    check_declared(item, f"{key}.{i}.")
