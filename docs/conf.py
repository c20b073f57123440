"""Sphinx configuration of cachelife's documentation: `nox -s docs`, or
`sphinx-build -W --keep-going -b html docs docs/_build/html` after `pip install -e ".[docs]"`.

Every table and diagram that restates the code or a results file is generated while the site is built, by the
local extension in `_ext/cachelife_docs`, so that the pages cannot drift from what they describe.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
# `bench` (the benchmark registry) is a top-level folder of the repository, not part of the package.
sys.path.append(str(ROOT))

import cachelife  # noqa: E402 - after the paths above

project = "cachelife"
author = "the cachelife authors"
copyright = "cachelife authors"
version = release = cachelife.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "cachelife_docs"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "_ext"]
# The docstrings write `name` for code, as Markdown does.
default_role = "code"

autodoc_member_order = "bysource"
autodoc_typehints = "signature"

myst_heading_anchors = 3

html_theme = "alabaster"
html_static_path = ["_static"]
html_css_files = ["cachelife.css"]
html_theme_options = {"page_width": "1200px", "sidebar_width": "240px"}

cachelife_repository = str(ROOT)
