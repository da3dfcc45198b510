"""The remote provider: a real HTTP service (payments, e-mail and shipping APIs) and its client.

The server is a separate process (``python -m example_app.payments serve``) that persists every
effect in SQLite or PostgreSQL before it answers. Like real payment providers it honours an
``Idempotency-Key`` header: a repeated key gets the original response and creates nothing.
It also accepts a ``Fencing-Token`` header and refuses (409) a write whose token is lower than
the highest it has seen for that key. ``--ignore-idempotency-keys`` (or a per-order rule)
makes it behave like a provider without keys, which ignores both headers.

Faults are real socket-level behaviour, set per order through ``POST /_admin/rules``:

* ``drop``: commit the effect, then close the connection without a response;
* ``delay``: commit the effect, then answer only after ``seconds`` (longer than the client's
  timeout, so the client has given up);
* ``slow``: commit the effect, then answer after ``seconds`` (shorter than the client's timeout).

The client (:class:`ProviderClient`) uses only the standard library. It retries a request that
timed out or lost its connection ``retries`` times with the *same* headers (the first of the
three retry layers), then raises ``TimeoutError`` or ``ConnectionError``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import json
import logging
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

logger = logging.getLogger("example_app.payments")

#: The resources the provider serves: resource -> (the order field that names the effect's
#: reference, the field the demo counts effects by).
RESOURCES = {
    "charges": ("order_id", "order_id"),
    "emails": ("order_id", "to"),
    "shipments": ("order_id", "order_id"),
    # The checkout saga's other effects and its compensations (example_app/saga.py).
    "orders": ("order_id", "order_id"),
    "charge_refunds": ("order_id", "order_id"),
    "cancellations": ("order_id", "order_id"),
}
FAULT_EVENTS = {"drop": "response dropped", "delay": "response too late", "slow": "response slow"}
FAULTS = tuple(FAULT_EVENTS)


class ProviderError(Exception):
    """The provider answered with an error status (4xx/5xx); the request did not create anything."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"provider answered {status}: {body}")
        self.status = status
        self.body = body


class FencedOff(ProviderError):
    """409: the write carried a fencing token lower than one the provider has already seen."""


# --------------------------------------------------------------------------------------------
# client
# --------------------------------------------------------------------------------------------


class ProviderClient:
    """A small JSON-over-HTTP client (stdlib ``http.client``).

    Args:
        base_url: ``http://host:port`` of the provider.
        timeout: Seconds to wait for the connection and for the response.
        retries: How many times a request that timed out or lost its connection is sent again
            (same body, same headers): the HTTP client's own retry layer.
    """

    def __init__(self, base_url: str, timeout: float = 1.5, retries: int = 1) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.timeout = timeout
        self.retries = retries

    def request(self, method: str, path: str, body: Any = None,
                headers: dict[str, str] | None = None) -> Any:
        """Send one request (with the client's retries) and return the decoded JSON answer.

        Raises:
            TimeoutError: No answer within ``timeout``, on every try.
            ConnectionError: The connection was refused or closed without an answer, every try.
            ProviderError: The provider answered 4xx/5xx (never retried).
        """
        data = None if body is None else json.dumps(body).encode()
        sent = {"Content-Type": "application/json", **(headers or {})}
        for attempt in range(self.retries + 1):
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                conn.request(method, path, body=data, headers=sent)
                resp = conn.getresponse()
                payload = json.loads(resp.read() or b"null")
            except (TimeoutError, ConnectionError) as exc:
                if attempt == self.retries:
                    raise
                logger.info("%s %s failed (%s: %s); HTTP retry %d", method, path,
                            type(exc).__name__, exc, attempt + 1)
                continue
            finally:
                conn.close()
            if resp.status == 409:
                raise FencedOff(resp.status, payload)
            if resp.status >= 400:
                raise ProviderError(resp.status, payload)
            return payload
        raise AssertionError("unreachable")

    def _write(self, resource: str, body: dict[str, Any], idempotency_key: str | None,
               fencing_token: int | None) -> Any:
        headers = {}
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        if fencing_token is not None:
            headers["Fencing-Token"] = str(fencing_token)
        return self.request("POST", f"/v1/{resource}", body, headers)

    def charge(self, order_id: str, amount_cents: int, currency: str = "usd", *,
               idempotency_key: str | None = None, fencing_token: int | None = None) -> Any:
        return self._write("charges", {"order_id": order_id, "amount_cents": amount_cents,
                                       "currency": currency}, idempotency_key, fencing_token)

    def send_email(self, to: str, template: str, order_id: str, *,
                   idempotency_key: str | None = None, fencing_token: int | None = None) -> Any:
        return self._write("emails", {"to": to, "template": template, "order_id": order_id},
                           idempotency_key, fencing_token)

    def create_shipment(self, order_id: str, address: str, *,
                        idempotency_key: str | None = None, fencing_token: int | None = None) -> Any:
        return self._write("shipments", {"order_id": order_id, "address": address},
                           idempotency_key, fencing_token)

    def charges_for(self, order_id: str) -> list[dict[str, Any]]:
        """The charges the provider holds for an order (a read: safe to repeat)."""
        return list(self.request("GET", f"/v1/charges?order_id={order_id}"))

    # -- admin (used by the demo and the tests) --

    def add_rule(self, order_id: str, resource: str, fault: str | None = None, count: int = 1,
                 seconds: float = 0.0, keys: bool | None = None) -> None:
        """Make the next ``count`` requests for ``order_id`` on ``resource`` misbehave."""
        self.request("POST", "/_admin/rules", {"order_id": order_id, "resource": resource,
                                               "fault": fault, "count": count,
                                               "seconds": seconds, "keys": keys})

    def ledger(self, prefix: str = "") -> dict[str, Any]:
        """Effects and events whose order id starts with ``prefix``."""
        return dict(self.request("GET", f"/_admin/ledger?prefix={prefix}"))

    def health(self) -> bool:
        try:
            return bool(self.request("GET", "/health").get("ok"))
        except (OSError, ProviderError):
            return False


# --------------------------------------------------------------------------------------------
# server
# --------------------------------------------------------------------------------------------


@dataclass
class Rule:
    fault: str | None
    count: int
    seconds: float
    keys: bool | None


@dataclass
class Outcome:
    status: int
    body: Any
    fault: str | None = None
    seconds: float = 0.0
    events: list[str] = field(default_factory=list)


class Ledger:
    """The provider's database: effects, idempotency keys, fences and an event log."""

    def __init__(self, url: str, table_prefix: str = "", honour_keys: bool = True) -> None:
        import sqlalchemy as sa

        self.sa = sa
        self.honour_keys = honour_keys
        kwargs: dict[str, Any] = {}
        if url.startswith("sqlite"):
            kwargs["connect_args"] = {"timeout": 30, "check_same_thread": False}
        self.engine = sa.create_engine(url, **kwargs)
        if url.startswith("sqlite"):
            sa.event.listen(self.engine, "connect", _sqlite_wal)
        md = sa.MetaData()
        p = table_prefix
        col = sa.Column
        self.effects = sa.Table(
            f"{p}provider_effects", md,
            col("id", sa.String(40), primary_key=True),
            col("resource", sa.String(20), nullable=False),
            col("order_id", sa.String(120), nullable=False, index=True),
            col("counted_by", sa.String(200), nullable=False),
            col("body", sa.Text, nullable=False),
            col("created", sa.Float, nullable=False),
        )
        self.keys = sa.Table(
            f"{p}provider_idempotency_keys", md,
            col("key", sa.String(255), primary_key=True),
            col("request_hash", sa.String(64), nullable=False),
            col("response", sa.Text, nullable=False),
        )
        self.fences = sa.Table(
            f"{p}provider_fences", md,
            col("key", sa.String(255), primary_key=True),
            col("token", sa.BigInteger, nullable=False),
        )
        self.events = sa.Table(
            f"{p}provider_events", md,
            col("id", sa.Integer, primary_key=True, autoincrement=True),
            col("order_id", sa.String(120), nullable=False, index=True),
            col("resource", sa.String(20), nullable=False),
            col("kind", sa.String(40), nullable=False),
            col("created", sa.Float, nullable=False),
        )
        self.tables = (self.effects, self.keys, self.fences, self.events)
        md.create_all(self.engine)
        self.rules: dict[tuple[str, str], Rule] = {}
        self.lock = threading.Lock()  # one writer at a time: check-then-insert is atomic

    def add_rule(self, order_id: str, resource: str, rule: Rule) -> None:
        with self.lock:
            self.rules[(resource, order_id)] = rule

    def _take_rule(self, resource: str, order_id: str) -> Rule | None:
        rule = self.rules.get((resource, order_id))
        if rule is None:
            return None
        if rule.fault is not None:
            rule.count -= 1
            if rule.count <= 0:  # the fault is used up; the key mode (if set) stays
                self.rules[(resource, order_id)] = Rule(None, 0, 0.0, rule.keys)
        return rule

    def write(self, resource: str, body: dict[str, Any], key: str | None, token: int | None) -> Outcome:
        """Apply one POST: fence check, key replay or a new effect, all in one transaction."""
        sa = self.sa
        ref_field, count_field = RESOURCES[resource]
        order_id = str(body.get(ref_field, ""))
        with self.lock, self.engine.begin() as conn:
            rule = self._take_rule(resource, order_id)
            honour = self.honour_keys if rule is None or rule.keys is None else rule.keys
            out = self._apply(conn, resource, body, order_id, str(body.get(count_field, "")),
                              key if honour else None, token if honour else None)
            if rule is not None and rule.fault:
                out.fault, out.seconds = rule.fault, rule.seconds
                out.events.append(FAULT_EVENTS[rule.fault])
            now = time.time()
            for kind in out.events:
                conn.execute(sa.insert(self.events).values(order_id=order_id, resource=resource,
                                                           kind=kind, created=now))
        return out

    def _apply(self, conn: Any, resource: str, body: dict[str, Any], order_id: str,
               counted_by: str, key: str | None, token: int | None) -> Outcome:
        sa = self.sa
        if key and token is not None:
            seen = conn.execute(sa.select(self.fences.c.token).where(self.fences.c.key == key)).scalar()
            if seen is not None and token < seen:
                return Outcome(409, {"error": "fenced", "token": token, "highest_seen": seen},
                               events=["fenced off"])
            if seen is None:
                conn.execute(sa.insert(self.fences).values(key=key, token=token))
            elif token > seen:
                conn.execute(sa.update(self.fences).where(self.fences.c.key == key).values(token=token))
        request_hash = hashlib.sha256(json.dumps([resource, body], sort_keys=True).encode()).hexdigest()
        if key:
            row = conn.execute(sa.select(self.keys).where(self.keys.c.key == key)).mappings().first()
            if row is not None:
                if row["request_hash"] != request_hash:
                    return Outcome(422, {"error": "idempotency key reused with another request"},
                                   events=["key mismatch"])
                return Outcome(200, json.loads(row["response"]), events=["replayed by key"])
        effect_id = f"{resource[:2]}_{uuid.uuid4().hex[:12]}"
        response = {"id": effect_id, "status": "succeeded", **body}
        conn.execute(sa.insert(self.effects).values(
            id=effect_id, resource=resource, order_id=order_id, counted_by=counted_by,
            body=json.dumps(body), created=time.time()))
        if key:
            conn.execute(sa.insert(self.keys).values(key=key, request_hash=request_hash,
                                                     response=json.dumps(response)))
        return Outcome(201, response, events=["created"])

    def charges_for(self, order_id: str) -> list[dict[str, Any]]:
        sa = self.sa
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(self.effects).where(
                (self.effects.c.resource == "charges") & (self.effects.c.order_id == order_id)
            ).order_by(self.effects.c.created)).mappings().all()
        return [{"id": r["id"], **json.loads(r["body"])} for r in rows]

    def summary(self, prefix: str) -> dict[str, Any]:
        sa = self.sa
        like = prefix.replace("%", r"\%").replace("_", r"\_") + "%"
        out: dict[str, Any] = {name: {} for name in RESOURCES}
        with self.engine.connect() as conn:
            for resource, counted_by in conn.execute(sa.select(
                    self.effects.c.resource, self.effects.c.counted_by).where(
                    self.effects.c.order_id.like(like, escape="\\"))):
                bucket = out[resource]
                bucket[counted_by] = bucket.get(counted_by, 0) + 1
            events: dict[str, dict[str, Counter[str]]] = {}
            for order_id, resource, kind in conn.execute(sa.select(
                    self.events.c.order_id, self.events.c.resource, self.events.c.kind).where(
                    self.events.c.order_id.like(like, escape="\\")).order_by(self.events.c.id)):
                events.setdefault(order_id, {}).setdefault(resource, Counter())[kind] += 1
        out["events"] = {o: {r: dict(c) for r, c in v.items()} for o, v in events.items()}
        return out


def _sqlite_wal(dbapi_connection: Any, _record: Any) -> None:
    cur = dbapi_connection.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.close()


class Handler(BaseHTTPRequestHandler):
    server: ProviderServer
    protocol_version = "HTTP/1.0"  # one request per connection: a dropped answer is a closed socket

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"null")

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        ledger = self.server.ledger
        if url.path == "/health":
            self._send(200, {"ok": True, "honour_keys": ledger.honour_keys})
        elif url.path == "/v1/charges":
            self._send(200, ledger.charges_for(query.get("order_id", "")))
        elif url.path == "/_admin/ledger":
            self._send(200, ledger.summary(query.get("prefix", "")))
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        ledger = self.server.ledger
        try:
            body = self._body()
        except ValueError:
            self._send(400, {"error": "body is not JSON"})
            return
        if url.path == "/_admin/rules":
            if body.get("resource") not in RESOURCES or body.get("fault") not in (None, *FAULTS):
                self._send(400, {"error": f"resource in {list(RESOURCES)}, fault in {FAULTS}"})
                return
            ledger.add_rule(str(body["order_id"]), body["resource"], Rule(
                body.get("fault"), int(body.get("count", 1)), float(body.get("seconds", 0)),
                body.get("keys")))
            self._send(200, {"ok": True})
            return
        resource = url.path.removeprefix("/v1/")
        if resource not in RESOURCES or not isinstance(body, dict):
            self._send(404, {"error": "not found"})
            return
        token = self.headers.get("Fencing-Token")
        out = ledger.write(resource, body, self.headers.get("Idempotency-Key"),
                           int(token) if token is not None else None)
        if out.fault == "drop":
            # Committed; now hang up without a status line. The client sees RemoteDisconnected.
            self.close_connection = True
            return
        if out.fault in ("delay", "slow"):
            time.sleep(out.seconds)
        # The client may have given up waiting (the "delay" fault): the effect stays committed.
        with contextlib.suppress(OSError):
            self._send(out.status, out.body)


class ProviderServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], ledger: Ledger) -> None:
        super().__init__(address, Handler)
        self.ledger = ledger


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m example_app.payments serve")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    p.add_argument("--db", default="sqlite:///provider.sqlite",
                   help="SQLAlchemy URL of the provider's own database (SQLite or PostgreSQL)")
    p.add_argument("--table-prefix", default="", help="prefix of the provider's table names")
    p.add_argument("--ignore-idempotency-keys", action="store_true",
                   help="behave like a provider without idempotency keys (and without fencing)")
    return p


def health_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m example_app.payments health")
    p.add_argument("--url", default="http://127.0.0.1:8080")
    return p


def serve(argv: list[str]) -> None:
    args = serve_parser().parse_args(argv)
    ledger = Ledger(args.db, args.table_prefix, honour_keys=not args.ignore_idempotency_keys)
    server = ProviderServer((args.host, args.port), ledger)
    host, port = server.server_address[:2]
    # The demo waits for this line to learn the port.
    print(f"provider listening on http://{host}:{port}", flush=True)
    try:
        server.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        serve(argv[1:])
        return 0
    if argv[:1] == ["health"]:
        ok = ProviderClient(health_parser().parse_args(argv[1:]).url, timeout=2, retries=0).health()
        print("ok" if ok else "unhealthy")
        return 0 if ok else 1
    print("usage: python -m example_app.payments {serve,health} [options]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sys.exit(main())
