"""Sphinx configuration of the flatcli documentation.

Build: ``pip install -e ".[docs]" && sphinx-build -W -b html docs docs/_build/html``.

Sphinx with MyST: the docstrings are reStructuredText (``:math:`` roles, ``.. math::`` blocks),
which autodoc renders as they are, while the guide pages stay Markdown.
"""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))

from flatcli._version import __version__  # noqa: E402

project = "flatcli"
author = "flatcli contributors"
copyright = "flatcli contributors"
release = version = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    # MathJax 3 from the installed package, copied into _static/mathjax: formulas render without
    # a network (sphinx.ext.mathjax alone loads MathJax from a CDN)
    "sphinx-mathjax-offline",
    "sphinx.ext.doctest",
    "flatcli_docs",
]

# no typographic replacement: `--dry-run` stays two hyphens and "quotes" stay straight, so what
# a page shows pastes into a shell (MyST has none of its own unless its "smartquotes" or
# "replacements" extensions are enabled, which they are not)
smartquotes = False

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = [
    "_build",
    "_ext",
    "_generated",
    "benchmarks/data",
    "**/README.md",
]

# `name` in docstrings is a cross-reference where it resolves, plain code otherwise
default_role = "py:obj"
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_mock_imports = []
autosummary_generate = True
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
napoleon_use_ivar = True

doctest_global_setup = """
import flatcli
"""

html_theme = "furo"
html_title = f"flatcli {release}"
html_static_path = []
# the example results page (docs/_ext/flatcli_docs.py: write_report_example), at the site's root
html_extra_path = ["_generated/extra"]
(DOCS / "_generated" / "extra").mkdir(parents=True, exist_ok=True)  # checked before it is filled
