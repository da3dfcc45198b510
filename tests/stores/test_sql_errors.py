"""The SQL store's error mapping is complete: every SQLAlchemy error has a decided meaning.

The store turns "the database cannot be reached" into :class:`StoreUnavailable` (the gate
re-queues a claim and retries a record) and lets every other database error through unchanged
(a constraint, a syntax error: a bug that must be seen). These tests walk the whole
``SQLAlchemyError`` tree and each installed driver's PEP 249 exceptions, so an error class a new
SQLAlchemy or driver adds fails here until it is classified below. No server is needed: the
errors are made, not provoked (test_sql_store.py provokes the real outages).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy.exc as sa_exc
import sqlalchemy.orm.exc  # noqa: F401 - its error classes join the tree walked below

from celery_idem.exceptions import StoreUnavailable
from celery_idem.stores.sql import SQLStore

# The outages: the pool had no connection in time, the connection broke, the server refused or
# went away, the driver could not talk to it. Each becomes StoreUnavailable.
UNAVAILABLE = {
    "TimeoutError", "DisconnectionError", "InvalidatePoolError", "OperationalError", "InterfaceError",
}

# Everything else propagates unchanged, grouped by why.
PROPAGATES = {
    # The database answered, and the answer is a bug or bad data (a DBAPIError that SQLAlchemy
    # saw as a disconnect is an outage whatever its class: tested separately below).
    "StatementError": "a statement failed before reaching the server (a bad parameter)",
    "DBAPIError": "a driver error of no PEP 249 class",
    "DatabaseError": "the server refused the statement",
    "DataError": "a value the column cannot hold",
    "IntegrityError": "a constraint: the claim handles the one it expects itself",
    "InternalError": "the server's own bug",
    "NotSupportedError": "a feature the server lacks",
    "ProgrammingError": "a syntax error or a missing table or column",
    # Misuse of SQLAlchemy or the ORM: the store's or the caller's bug, never an outage.
    **dict.fromkeys([
        "SQLAlchemyError", "ArgumentError", "AmbiguousForeignKeysError", "ConstraintColumnNotFoundError",
        "DuplicateColumnError", "NoForeignKeysError", "NoSuchModuleError", "ObjectNotExecutableError",
        "MappedAnnotationError", "CircularDependencyError", "CompileError", "UnsupportedCompilationError",
        "IdentifierError", "InvalidRequestError", "AmbiguousColumnError", "AwaitRequired",
        "IllegalStateChangeError", "MissingGreenlet", "MultipleResultsFound", "NoDBAPILoaded",
        "NoInspectionAvailable", "NoReferenceError", "NoReferencedColumnError", "NoReferencedTableError",
        "NoResultFound", "NoSuchColumnError", "NoSuchTableError", "PendingRollbackError",
        "ResourceClosedError", "UnboundExecutionError", "UnreflectableTableError", "UnevaluatableError",
        "LoaderStrategyException", "ObjectDeletedError", "UnmappedClassError", "UnmappedColumnError",
        "UnmappedError", "UnmappedInstanceError", "DetachedInstanceError", "FlushError",
        "ObjectDereferencedError", "StaleDataError",
    ], "a misuse of SQLAlchemy (a bug), not an outage"),
}


def _sqlalchemy_errors() -> list[type[sa_exc.SQLAlchemyError]]:
    """Every SQLAlchemyError subclass loaded (sqlalchemy.exc, the ORM's, any other module's)."""
    found: list[type[sa_exc.SQLAlchemyError]] = []
    todo: list[type[sa_exc.SQLAlchemyError]] = [sa_exc.SQLAlchemyError]
    todo += [c for c in vars(sa_exc).values() if inspect.isclass(c) and issubclass(c, sa_exc.SQLAlchemyError)]
    while todo:
        cls = todo.pop()
        if cls not in found:
            found.append(cls)
            todo.extend(cls.__subclasses__())
    # Only SQLAlchemy's own: a test module's subclass is not the library's tree.
    return sorted((c for c in found if c.__module__.startswith("sqlalchemy.")),
                  key=lambda c: (c.__module__, c.__qualname__))


SQLALCHEMY_ERRORS = _sqlalchemy_errors()


def _make(cls: type[sa_exc.SQLAlchemyError], *, invalidated: bool = False) -> sa_exc.SQLAlchemyError:
    """An instance of ``cls`` whatever its constructor takes, with a readable message."""
    if issubclass(cls, sa_exc.DBAPIError):
        return cls("SELECT 1", {}, Exception("server said no"), connection_invalidated=invalidated)
    if issubclass(cls, sa_exc.StatementError):
        return cls("bad parameter", "SELECT 1", {}, Exception("orig"))
    try:
        error = cls("something went wrong")
        str(error)  # some ORM errors take an instance state and fail only when shown
        return error
    except (TypeError, AttributeError):  # built from an instance or a state: only the class matters
        error = cls.__new__(cls)
        Exception.__init__(error, "something went wrong")
        return error


@pytest.fixture(scope="module")
def store() -> Iterator[SQLStore]:
    # Never connects: the mapping is pure. The URL names the server in the message.
    store = SQLStore("db+postgresql+psycopg://root@127.0.0.1:1/test", prefix="p:")
    yield store
    store.close()


def test_every_sqlalchemy_error_is_classified() -> None:
    names = {c.__qualname__ for c in SQLALCHEMY_ERRORS}
    unclassified = names - UNAVAILABLE - set(PROPAGATES)
    assert not unclassified, f"classify these in UNAVAILABLE or PROPAGATES: {sorted(unclassified)}"
    assert UNAVAILABLE.isdisjoint(PROPAGATES)
    # The walk found the tree, not a stub of it.
    assert {"OperationalError", "IntegrityError", "TimeoutError", "NoResultFound", "StaleDataError"} <= names
    assert len(SQLALCHEMY_ERRORS) >= 50


@pytest.mark.parametrize("error", SQLALCHEMY_ERRORS, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_every_sqlalchemy_error_maps_as_classified(
    store: SQLStore, error: type[sa_exc.SQLAlchemyError]
) -> None:
    raised = _make(error)
    if error.__qualname__ in UNAVAILABLE:
        with pytest.raises(StoreUnavailable, match=r"127\.0\.0\.1:1\b") as info, store._translate_errors():
            raise raised
        assert info.value.__cause__ is raised
    else:
        with pytest.raises(error) as caught, store._translate_errors():
            raise raised
        assert caught.value is raised  # unchanged, not wrapped


@pytest.mark.parametrize(
    "error",
    [c for c in SQLALCHEMY_ERRORS if issubclass(c, sa_exc.DBAPIError)],
    ids=lambda c: c.__qualname__,
)
def test_a_dbapi_error_sqlalchemy_saw_as_a_disconnect_is_an_outage(
    store: SQLStore, error: type[sa_exc.DBAPIError]
) -> None:
    raised = _make(error, invalidated=True)
    with pytest.raises(StoreUnavailable) as info, store._translate_errors():
        raise raised
    assert info.value.__cause__ is raised


def _driver_errors() -> Iterator[tuple[str, type[BaseException]]]:
    """Each installed driver's PEP 249 exception classes (the ones DBAPIError.instance wraps)."""
    pep249 = ("Warning", "Error", "InterfaceError", "DatabaseError", "DataError", "OperationalError",
              "IntegrityError", "InternalError", "ProgrammingError", "NotSupportedError")
    for module in ("psycopg", "psycopg2", "pymysql", "MySQLdb", "sqlite3"):
        try:
            dbapi = importlib.import_module(module)
        except ImportError:
            continue
        for name in pep249:
            if name != "Warning":  # not an error: drivers raise it only when asked to
                yield module, getattr(dbapi, name)


DRIVER_ERRORS = list(_driver_errors())


def test_the_drivers_of_the_tests_are_walked() -> None:
    assert {"psycopg", "pymysql", "sqlite3"} <= {module for module, _ in DRIVER_ERRORS}


@pytest.mark.parametrize(("driver", "error"), DRIVER_ERRORS, ids=lambda v: getattr(v, "__name__", v))
def test_every_driver_error_wrapped_as_sqlalchemy_wraps_it_maps_by_its_pep249_class(
    store: SQLStore, driver: str, error: type[Any]
) -> None:
    # The fast path wraps driver errors with DBAPIError.instance, as SQLAlchemy's own path does.
    dbapi = importlib.import_module(driver)
    wrapped = sa_exc.DBAPIError.instance("SELECT 1", {}, error("the driver's message"), dbapi.Error)
    assert type(wrapped).__name__ == (error.__name__ if error.__name__ != "Error" else "DBAPIError")
    name = type(wrapped).__qualname__
    if name in UNAVAILABLE:
        with pytest.raises(StoreUnavailable, match="the driver's message"), store._translate_errors():
            raise wrapped
    else:
        assert name in PROPAGATES
        with pytest.raises(type(wrapped)), store._translate_errors():
            raise wrapped
