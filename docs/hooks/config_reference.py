"""MkDocs hook: the configuration reference, rendered from the config classes at build time
(wildtrain.config.reference), in place of the marker line in docs/configuration.md; and every
message a setting's check can print, in place of its marker in docs/troubleshooting.md."""

from __future__ import annotations

from pathlib import Path

from wildtrain.config.reference import render, render_messages

MARKER = "<!-- config-reference -->"
MESSAGES_MARKER = "<!-- config-messages -->"
# The checkout's conf/, beside docs/: the groups the reference lists.
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MESSAGES_MARKER in markdown:
        markdown = markdown.replace(MESSAGES_MARKER, render_messages())
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, render(CONF_DIR))
    return markdown
