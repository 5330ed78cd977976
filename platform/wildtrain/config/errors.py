"""The error every config mistake becomes."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config that cannot run; the message names the key or file at fault."""
