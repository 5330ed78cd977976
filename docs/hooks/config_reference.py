"""MkDocs hook: the configuration reference, rendered from the config classes at build time
(wildtrain.config.reference), in place of the marker line in docs/configuration.md."""

from __future__ import annotations

from pathlib import Path

from wildtrain.config.reference import render

MARKER = "<!-- config-reference -->"
# The checkout's conf/, beside docs/: the groups the reference lists.
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render(CONF_DIR))
