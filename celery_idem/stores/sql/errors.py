"""Which database errors mean "the store cannot be reached": the SQL store's error seam.

An outage becomes :class:`~celery_idem.exceptions.StoreUnavailable`; every other database error
is a bug or bad data and propagates unchanged (tests/stores/test_sql_errors.py decides each class).
"""

from __future__ import annotations

from sqlalchemy import exc as sa_exc

from ...exceptions import StoreUnavailable

__all__ = ["outage"]

# The classes that are outages whatever their message.
_OUTAGES = (
    sa_exc.TimeoutError,  # the pool had no free connection in time
    sa_exc.DisconnectionError,
    sa_exc.OperationalError,  # the server went away, refused the connection, shut down
    sa_exc.InterfaceError,  # the driver could not talk to it
)


def outage(exc: sa_exc.SQLAlchemyError, shown_url: str) -> StoreUnavailable | None:
    """The :class:`StoreUnavailable` ``exc`` means, or None when it is not an outage.

    Args:
        exc: What SQLAlchemy (or the psycopg fast path, which wraps errors the same way) raised.
        shown_url: The store's URL without its password, for the message.
    """
    if isinstance(exc, _OUTAGES) or (isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated):
        # The second: any other error SQLAlchemy saw as a disconnect.
        reason = getattr(exc, "orig", None) or exc
        first_line = (str(reason).strip().splitlines() or [type(reason).__name__])[0]
        return StoreUnavailable(f"celery_idem could not reach the SQL store at {shown_url}: {first_line}")
    return None

