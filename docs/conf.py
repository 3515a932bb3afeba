"""Sphinx configuration: MyST guides and an API reference generated from the docstrings.

Build with ``sphinx-build -W docs docs/_build`` (warnings are errors; ``.ci/run`` does it). The package is
imported for real (no mocks): it imports on CPU without a GPU in a few seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's package, also when it is not installed

import lightning_dynmo  # noqa: E402

project = "lightning_dynmo"
author = "lightning_dynmo developers"
copyright = "2026, lightning_dynmo developers"
release = lightning_dynmo.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

# MyST: ``{eval-rst}`` blocks, heading anchors for links between guides.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# The API reference: one page per module, generated at build time from the docstrings.
autosummary_generate = True
autosummary_imported_members = False
templates_path = ["_templates"]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autoclass_content = "both"
# Our docstrings only: those inherited from Lightning and torch use roles of their own sites.
autodoc_inherit_docstrings = False

napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# "Attributes:" sections as fields: a NamedTuple's or dataclass's fields are documented once, by autodoc.
napoleon_use_ivar = True

html_theme = "alabaster"
html_static_path: list[str] = []
