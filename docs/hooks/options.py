"""MkDocs hook (mkdocs.yml `hooks:`): the deploy page's table of options, made when the site is built from the
schema that `patchkit serve --config` checks and `patchkit serve --help` lists (patchkit/config/file.py)."""

from __future__ import annotations

from typing import Any

from patchkit.config import file as config_file


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Called by MkDocs for every page before it is rendered: the marker line becomes the table."""
    return markdown.replace(config_file.TABLE_MARKER, config_file.markdown_table())
