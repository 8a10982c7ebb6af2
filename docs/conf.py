"""Sphinx configuration for gpushuffle's docs site (`bash ci/docs.sh`)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

project = "gpushuffle"
author = "the gpushuffle developers"
extensions = [
    # MyST Markdown and the notebooks under notebooks/, executed at every
    # build (CI's docs step runs them on a live CPU cluster).
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx_click",
]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
nb_execution_mode = "force"
nb_execution_timeout = 300
nb_execution_raise_on_error = True
nb_execution_show_tb = True
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]
html_theme = "pydata_sphinx_theme"
html_title = "gpushuffle"
html_theme_options = {"navigation_depth": 2, "show_toc_level": 2}
exclude_patterns = ["_build", "_generated/*.md.txt", "**/.ipynb_checkpoints"]
autodoc_typehints = "description"
autodoc_member_order = "bysource"
suppress_warnings = ["myst.xref_missing"] if False else []


def _generate(app) -> None:
    """The configuration table, from gpushuffle.yaml and its comments."""
    from gpushuffle.config_reference import markdown_table

    out = Path(app.srcdir) / "_generated"
    out.mkdir(exist_ok=True)
    table = markdown_table()
    target = out / "configuration-keys.md"
    if not target.exists() or target.read_text() != table:
        target.write_text(table)


def setup(app):
    app.connect("builder-inited", _generate)
