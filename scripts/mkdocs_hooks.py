"""MkDocs hooks for the API reference (loaded through ``hooks:`` in mkdocs.yml).

The package's docstrings use a few Sphinx habits (``:class:`X```, ``:func:`~a.b.c```, a
paragraph ending in ``::`` before a literal block). mkdocstrings renders them as Markdown, so
the role names would show up as text. This hook removes them from the rendered HTML.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|exc|data|obj|const):(<code>)")
_TILDE = re.compile(r"<code>~(?:[\w]+\.)*(\w+)</code>")
_LITERAL_MARKER = re.compile(r"::(</p>)")


def on_page_content(html: str, **kwargs: Any) -> str:
    """Strip Sphinx cross-reference roles and ``::`` literal-block markers."""
    html = _ROLE.sub(r"\1", html)
    html = _TILDE.sub(r"<code>\1</code>", html)
    return _LITERAL_MARKER.sub(r":\1", html)
