"""Sphinx configuration: MyST pages, the tutorial notebooks and an API reference from the public names
(``sphinx-build -W docs OUT``).

Nothing is fetched while building (no intersphinx) and nothing is executed: the pages' code blocks run in
``tests/test_docs.py``, the notebooks in ``tests/test_notebooks.py``; the site shows the notebooks' stored outputs.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # the checkout's relprop, also without an install

project = "relprop"
author = "relprop developers"
copyright = "2026, relprop developers"

# myst-nb reads the Markdown pages (it includes myst-parser) and the notebooks of docs/tutorials
extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
exclude_patterns = ["_build", "**.ipynb_checkpoints"]

# the notebooks are committed with their outputs, which the site shows as they are
nb_execution_mode = "off"

# MyST: `#` headings get anchors down to level 3, so pages link to sections as page.md#section
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# autodoc: documented by the public path (relprop.LRP, relprop.rules.Epsilon), members in __all__ order
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "description"
add_module_names = True

napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False

html_theme = "furo"
html_title = "relprop"
html_static_path = ["_static"]
html_css_files = ["wide.css"]  # an article wide enough for the guide's 120-column code blocks


# Docstrings in src that do not parse as reStructuredText (each one a warning, and so an error under -W). They are
# patched here, in the build only, until the docstring itself is fixed; then the build fails with "remove it from
# DOCSTRING_FIXES" so that the entry goes. Each entry: object (its public path) -> (text in the docstring, text the
# build uses instead).
DOCSTRING_FIXES: dict[str, tuple[str, str]] = {}


def _fix_docstring(app, what, name, obj, options, lines):
    if name not in DOCSTRING_FIXES:
        return
    old, new = DOCSTRING_FIXES[name]
    text = "\n".join(lines)
    if old not in text:
        from sphinx.util import logging

        logging.getLogger(__name__).warning("docs/conf.py: the docstring of %s no longer contains %r: remove it from "
                                            "DOCSTRING_FIXES", name, old)
        return
    lines[:] = text.replace(old, new).split("\n")


def setup(app):
    app.connect("autodoc-process-docstring", _fix_docstring, priority=100)  # before napoleon (500) reads sections
