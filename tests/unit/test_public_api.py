"""The public API, pinned: a change here is a change to the contract."""

from __future__ import annotations

import subprocess
import sys

import celery_idem

EXPECTED_ALL = [
    "CachedResult",
    "CorruptRecord",
    "IdempotencyError",
    "IdempotencyKeyMismatch",
    "IdempotentTask",
    "ImproperlyConfigured",
    "InvalidKey",
    "LeaseLost",
    "StoreUnavailable",
    "TerminalError",
    "__version__",
    "idempotency_key",
]


def test_all_is_exactly_the_public_api() -> None:
    assert sorted(celery_idem.__all__) == EXPECTED_ALL
    assert len(celery_idem.__all__) == len(set(celery_idem.__all__))


def test_every_name_in_all_exists() -> None:
    for name in celery_idem.__all__:
        assert hasattr(celery_idem, name), name


def test_no_other_public_name_is_exported_by_accident() -> None:
    for name in celery_idem.__all__:  # the Celery seam's names are loaded on first access
        getattr(celery_idem, name)
    public = {
        name for name, value in vars(celery_idem).items()
        if not name.startswith("_")
        and not isinstance(value, type(sys))  # submodules are fine
        and type(value).__name__ != "_Feature"  # `from __future__ import annotations`
    }
    assert public == set(EXPECTED_ALL) - {"__version__"}


def test_the_version_is_a_string() -> None:
    assert isinstance(celery_idem.__version__, str) and celery_idem.__version__


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from celery_idem import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == EXPECTED_ALL


def test_importing_the_package_imports_no_store_backend() -> None:
    # In a fresh interpreter: `import celery_idem` must not pull in redis or sqlalchemy
    code = (
        "import sys\n"
        "import celery_idem\n"
        "print(sorted(m for m in ('redis', 'sqlalchemy') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_a_memory_store_app_needs_no_store_backend() -> None:
    # Building and using the memory:// store must not pull them in either
    code = (
        "import sys\n"
        "from celery_idem.stores import store_from_url\n"
        "store = store_from_url('memory://')\n"
        "store.get('k')\n"
        "print(sorted(m for m in ('redis', 'sqlalchemy') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"
