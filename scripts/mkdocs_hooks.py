"""MkDocs hooks (loaded through ``hooks:`` in mkdocs.yml).

* The API reference: the package's docstrings use a few Sphinx habits (``:class:`X```,
  ``:func:`~a.b.c```, a paragraph ending in ``::`` before a literal block). mkdocstrings renders
  them as Markdown, so the role names would show up as text. :func:`on_page_content` removes them.
* Offline diagrams: Material for MkDocs loads mermaid from unpkg.com at view time unless a global
  ``mermaid`` already exists, so offline or air-gapped the sequence diagrams stay raw text.
  :func:`on_files` serves ``mermaid.min.js`` from the site itself (listed in mkdocs.yml's
  ``extra_javascript``), taken from the npm registry's ``mermaid`` package at build time, pinned
  by version and checked against the registry's sha512 integrity, and cached under ``.cache/``.
  ``CELERY_IDEM_MERMAID_JS=/path/to/mermaid.min.js`` builds without the registry.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

#: The mermaid release served with the site: the major version Material for MkDocs 9 drives.
MERMAID_VERSION = "11.17.2"
#: ``dist.integrity`` of that release on registry.npmjs.org (``npm view mermaid@11.17.2``).
MERMAID_INTEGRITY = (
    "sha512-V6K3C8EBdEsPFZXSKMJe6ppQOENxuHARr9GvHX4hh47lAbhMRD9qf4oEK7LoaRQxULMa80/qt5gHO73aCleBBg=="
)
MERMAID_TARBALL = f"https://registry.npmjs.org/mermaid/-/mermaid-{MERMAID_VERSION}.tgz"
#: Where the site serves it (mkdocs.yml's extra_javascript names the same path).
MERMAID_PATH = "assets/javascripts/mermaid.min.js"
CACHE = Path(__file__).resolve().parents[1] / ".cache" / f"mermaid-{MERMAID_VERSION}.min.js"

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|exc|data|obj|const):(<code>)")
_TILDE = re.compile(r"<code>~(?:[\w]+\.)*(\w+)</code>")
_LITERAL_MARKER = re.compile(r"::(</p>)")


def on_page_content(html: str, **kwargs: Any) -> str:
    """Strip Sphinx cross-reference roles and ``::`` literal-block markers."""
    html = _ROLE.sub(r"\1", html)
    html = _TILDE.sub(r"<code>\1</code>", html)
    return _LITERAL_MARKER.sub(r":\1", html)


def _tarball() -> bytes:
    """The release's npm tarball: through ``npm pack`` when npm is installed, else over HTTPS."""
    if shutil.which("npm"):
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["npm", "pack", f"mermaid@{MERMAID_VERSION}", "--silent",
                            "--pack-destination", tmp], check=True, timeout=300,
                           stdout=subprocess.DEVNULL)
            return (Path(tmp) / f"mermaid-{MERMAID_VERSION}.tgz").read_bytes()
    with urllib.request.urlopen(MERMAID_TARBALL, timeout=120) as resp:
        return bytes(resp.read())


def mermaid_js() -> Path:
    """The vendored ``mermaid.min.js``, fetched and verified once, then from the cache."""
    given = os.environ.get("CELERY_IDEM_MERMAID_JS")
    if given:
        return Path(given)
    if not CACHE.exists():
        data = _tarball()
        algo, _, digest = MERMAID_INTEGRITY.partition("-")
        if base64.b64encode(hashlib.new(algo, data).digest()).decode() != digest:
            raise RuntimeError(f"mermaid {MERMAID_VERSION}: the tarball does not match its "
                               f"npm integrity {MERMAID_INTEGRITY}")
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            member = tar.extractfile("package/dist/mermaid.min.js")
            assert member is not None
            js = member.read()
        CACHE.parent.mkdir(exist_ok=True)
        partial = CACHE.with_suffix(".partial")
        partial.write_bytes(js)
        partial.replace(CACHE)
    return CACHE


def on_files(files: Any, config: Any, **kwargs: Any) -> Any:
    """Add the vendored mermaid to the site, at the path extra_javascript names."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, MERMAID_PATH, abs_src_path=str(mermaid_js())))
    return files
