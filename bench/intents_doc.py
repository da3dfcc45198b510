"""The section "Intents (measured <date>)" of docs/benchmarks.md, from ``python -m bench.intents
--write-docs`` (``python -m bench --write-docs`` keeps it as it is: ``bench.cli.KEPT_SECTIONS``)."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

import redis

from bench.intents import AT_REST_TARGET, BATCHED, ENQUEUE_TARGET, PG_RELAY_TARGET, REDIS_RELAY_TARGET

HEADING = "Intents ("


def section(results: dict[str, Any], tables: dict[str, str], args: argparse.Namespace,
            load: tuple[float, float], elapsed: float) -> str:
    """The page's section: the tables, each target against what was measured."""
    import datetime as dt

    from bench.report import machine

    when = dt.datetime.now(dt.timezone.utc)
    client = redis.Redis.from_url(args.redis_url)
    try:
        git = machine(client, None)["celery-idem (git)"]
    finally:
        client.close()
    defaults = {"n": 2000, "reps": 5, "tasks": 1000, "relay_redis": 5000, "relay_pg": 2000,
                "relay_reps": 3, "rest": 10.0, "e2e_tasks": 1000, "e2e_reps": 3}
    cmd = "python -m bench.intents" + "".join(
        f" --{k.replace('_', '-')} {getattr(args, k):g}" for k, v in defaults.items()
        if getattr(args, k) != v) + (" --profile" if args.profile else "") + (
        "" if args.pg else " --no-pg")
    parts = [f"## {HEADING}measured {when:%Y-%m-%d})\n",
             f"`{cmd} --write-docs` (bench/intents.py), git {git}, {when:%H:%M} UTC, "
             f"{elapsed:.0f} s; 1-minute load average {load[0]:.1f} before, {load[1]:.1f} after, "
             f"on {os.cpu_count()} CPUs shared with other test runs: read the side-by-side ratios, "
             f"not the absolute µs. What `idempotency_intent=True` costs and what the relay "
             f"sustains.\n"]
    verdict = lambda ok: "met" if ok else "**MISSED**"  # noqa: E731
    enq = results.get("enqueue")
    if enq:
        fused = next(v for k, v in enq.items() if k.startswith("fused"))
        other = next(v for k, v in enq.items() if k.startswith("fused (store on another db"))
        first = next(v for k, v in enq.items() if k.startswith("read first"))
        p = fused["parts_us"]
        parts.append(
            f"**Enqueue.** `delay()` of a unique key through a Redis broker, the same no-op "
            f"`IdempotentTask` with intents off and on, blocks of {args.n} calls alternating "
            f"(order swapped every repetition), {args.reps} repetitions; µs are the medians of the "
            f"blocks' per-call medians, *on / off* the geometric mean of the two orders' median "
            f"per-repetition ratios (`bench.intents.balanced`). What the block method resolves "
            f"here: the off task against itself in the same alternating blocks (an A/A control "
            f"on the first path), second block over first "
            f"{' / '.join(f'{r:.2f}' for r in fused['aa_second'])}, balanced ratio "
            f"{fused['aa_ratio']:.3f}.\n\n"
            f"The *interleaved* rows time the same two tasks taking turns call by call "
            f"(`bench.accel`'s method: both see the same moment of the shared machine).\n\n"
            f"{tables['enqueue']}\n\n"
            f"Target on the fused path at most {ENQUEUE_TARGET:.2f}: {fused['ratio']:.2f} in "
            f"blocks, {fused['il_ratio']:.2f} interleaved (CPU {fused['on_cpu'] / fused['off_cpu']:.2f} "
            f"and {fused['il_on_cpu'] / fused['il_off_cpu']:.2f}), "
            f"{verdict(fused['ratio'] <= ENQUEUE_TARGET)} in blocks, "
            f"{verdict(fused['il_ratio'] <= ENQUEUE_TARGET)} interleaved. With the store on "
            f"another database of the broker's server the script selects each key's database: "
            f"{other['ratio']:.2f} in blocks, {other['il_ratio']:.2f} interleaved. The read-first path "
            f"adds a round trip (the intent's own script): {first['ratio']:.2f} in blocks, "
            f"{first['il_ratio']:.2f} interleaved. Under cProfile (500 fused "
            f"intent enqueues) `intent_of` takes "
            f"{p['intent_of']:.0f} µs "
            f"of a {p['total']:.0f} µs `delay()` (kombu's payload, which the publish encodes "
            f"either way, then the intent's head, TTL and eta) and `intent_spec` "
            f"{p['intent_spec']:.0f} µs: on the fused path the "
            f"publish's hook builds the intent from kombu's message and the script keeps the "
            f"payload it pushes after a short head (no second encoding of the message, no "
            f"second copy of it in the call); the rest of the difference is the script's "
            f"writes in the server (the intent's string with its expiry, the index) and their "
            f"argument.\n")
    wk = results.get("worker")
    if wk:
        per = {name: sum(v["worker"].values()) / args.tasks for name, v in wk.items()}
        parts.append(
            f"**Worker.** Store commands per task of a real `celery worker -P solo` running "
            f"{args.tasks} tasks, intents off and on, read with `MONITOR` on a private "
            f"`redis-server` holding the store alone (broker and backend elsewhere; a script "
            f"is one command, what it runs inside the server is left out); the messages are "
            f"enqueued before the worker starts, so the sides count apart; *worker start* is "
            f"the worker's connections, script loads and its relay's first poll (`due`). "
            f"Store on another server: the producer's check reads first (`reserve`); `due` in "
            f"the worker's rows is its relay's poll (about one a second).\n\n"
            f"{tables['worker']}\n\n"
            f"The worker's side: {per.get('off', 0):.2f} commands per task off, "
            f"{per.get('on', 0):.2f} on (claim and record): intents add no round trip "
            f"in the worker; the relay closes an intent when it next sees it due with its "
            f"outcome recorded.\n")
    relay_rows = [(k.split("/", 1)[1], v) for k, v in results.items() if k.startswith("relay/")]
    if relay_rows:
        lines = []
        for name, v in relay_rows:
            rate = v["variants"][BATCHED]["rate"]
            goal = REDIS_RELAY_TARGET if name == "redis" else PG_RELAY_TARGET
            lines.append(f"{name} {rate:,.0f}/s against at least {goal:,.0f}/s, {verdict(rate >= goal)}")
        text = (f"**Relay throughput.** `Relay.run_once` in a loop until none is due (a WARNING "
                f"line per re-send, to a `NullHandler`), "
                f"{args.relay_redis} lost intents on the Redis store (the shared server, the run's "
                f"prefix) and {args.relay_pg} on the SQL store on PostgreSQL (a private table), the "
                f"broker a private `redis-server`; {args.relay_reps} repetitions. Each intent is "
                f"written due at once with its queue's watermark above it (a later message of "
                f"its queue was claimed): lost, re-sent with reason `overtaken`. *batched CAS*: "
                f"the pass's compare-and-sets in one call (`Store.reschedule_intents`, one "
                f"pipeline on Redis, a loop on SQL); *one CAS per intent*: the store's default "
                f"loop, beside it. Every re-sent message is counted in the broker's queue. "
                f"*relay CPU µs/intent* is the relay thread's CPU time per re-send (less "
                f"sensitive to other load than the wall rate); *intents per CPU s* its inverse: "
                f"the client side's ceiling, the servers' time and the waits aside.\n\n"
                f"{tables['relay']}\n\nTargets: {'; '.join(lines)}.")
        for name, v in relay_rows:
            pp = v.get("parts")
            if pp and pp.get("total"):
                shown = ", ".join(f"{label} {sec / pp['total']:.0%}" for label, sec in pp.items()
                                  if label != "total")
                text += f" Under cProfile, a {name} round's time: {shown}."
        parts.append(text + "\n")
    rest = [(k.split("/", 1)[1], v) for k, v in results.items() if k.startswith("rest/")]
    if rest:
        lines = [f"{name} {v['rate']:.2f}/s, {verdict(v['rate'] <= AT_REST_TARGET + 0.05)}"
                 for name, v in rest]
        parts.append(
            f"**Relay at rest.** `Relay.run_forever` (interval 1 s, the default) with nothing "
            f"due for {args.rest:.0f} s; store round trips counted as the relay's calls of store "
            f"verbs (one round trip each by the store contract).\n\n{tables['rest']}\n\n"
            f"Target at most {AT_REST_TARGET:.0f}/s: {'; '.join(lines)}. A pass with nothing "
            f"due is the one `due_intents` read.\n")
    e2e = results.get("e2e")
    if e2e:
        from bench.e2e import INTENTS

        by = {(x.workload, x.system): x for x in e2e}
        lines = []
        for workload in ("unique", "duplicates"):
            idem, on = by.get((workload, "idem/redis")), by.get((workload, INTENTS))
            if idem and on and idem.ratio and on.ratio:
                lines.append(f"{workload}: {on.ratio:.2f} x plain with intents, {idem.ratio:.2f} "
                             f"without")
        parts.append(
            f"**End to end.** `bench.e2e` as `python -m bench` runs it (`celery worker -P prefork "
            f"-c 2`, Redis broker, backend and store, {args.e2e_tasks} messages per batch, "
            f"{args.e2e_reps} interleaved repetitions, ratios paired with the plain batch just "
            f"before), the systems `idem/redis` and `idem/redis (intents)` (the same task with "
            f"`idempotency_intent=True`, its worker running the relay) side by side; the other "
            f"systems of that run are left out here.\n\n{tables['e2e']}\n\n"
            f"{'; '.join(lines)}.\n")
    return "\n".join(parts)


def write_docs(text: str) -> Path:
    """Replace the page's section (or add it before "Peers: what each one does")."""
    from bench.cli import DOCS

    page = DOCS.read_text()
    chunks = re.split(r"(?m)^(?=## )", page)
    at = next((i for i, c in enumerate(chunks) if c.startswith(f"## {HEADING}")), None)
    if at is not None:
        chunks[at] = text.rstrip() + "\n\n"
    else:
        peers = next((i for i, c in enumerate(chunks) if c.startswith("## Peers")), len(chunks))
        chunks.insert(peers, text.rstrip() + "\n\n")
    DOCS.write_text("".join(chunks).rstrip() + "\n")
    return DOCS


