"""The error every config mistake becomes, and the checks sections validate themselves with."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config that cannot run; the message names the key or file at fault."""


def positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{key}: must be positive, got {value}")


def zero_or_positive(key: str, value: float, zero_means: str) -> None:
    if value < 0:
        raise ConfigError(f"{key}: must be 0 ({zero_means}) or positive, got {value}")


def one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: expected one of {', '.join(allowed)}, got {value!r}")
