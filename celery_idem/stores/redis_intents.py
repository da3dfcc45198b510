"""The intent verbs of the Redis store (``Store.intend`` ...), one Lua script each.

An intent is a string at ``<record's name>\\x1fintent``: a line of six decimal numbers,
``<enqueued> <deadline> <expires> <sent> <len(task id)> <len(queue)>`` (times in the server's
milliseconds, lengths in bytes of UTF-8), then the task id, the queue and the message, with no
separator (:func:`parse_intent`). One ``SET ... PX`` writes it (``lua/_intent.lua``), the
cheapest write on the enqueue's path; it expires an hour after its ``expires``. It is indexed by
deadline in the sorted set ``<prefix>\\x1fintents`` (member: the key); the queues' watermarks
are the hash ``<prefix>\\x1fwatermarks``. The index spans every key, so a Redis Cluster keeps
no intents.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from importlib import resources
from typing import Any, ClassVar, Protocol

from ..records import Intent, Record
from .redis_durability import text

__all__ = ["INTENT", "INTENT_LUA", "SCRIPTS", "RedisIntents", "intent_spec", "parse_intent"]

#: After a record's name, names its intent (never a record's name: a key is printable).
INTENT = "\x1fintent"

#: The intent's write (``write_intent``), shared with the enqueue check within the publish.
INTENT_LUA = resources.files(__package__).joinpath("lua", "_intent.lua").read_text("utf-8")

_NOW = "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000) "

_INTEND = INTENT_LUA + """
return write_intent(KEYS[1], KEYS[2], ARGV[3], ARGV[1], ARGV[2])
"""

#: The intent's numbers and where its task id starts: enqueued, deadline, expires, sent, then
#: the lengths as written ("<len(task id)> <len(queue)>\\n"), the task id's length, its index.
_HEAD = "'^(%d+) (%d+) (%d+) (%d+) ((%d+) %d+\\n)()'"

_DUE = _NOW + """
local members = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
local out = {now}
for _, m in ipairs(members) do
  local name = ARGV[1] .. m
  local i = redis.call('GET', name .. ARGV[3])
  if not i then
    redis.call('ZREM', KEYS[1], m)  -- gone with its expiry, long after it went stale
  else
    table.insert(out, m)
    table.insert(out, i)
    table.insert(out, redis.call('GET', name) or '')
  end
end
return out
"""

_RESCHEDULE = _NOW + """
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
local e, d, x, s, lengths, n, at = string.match(v, """ + _HEAD + """)
if d ~= ARGV[2] or string.sub(v, at, at + n - 1) ~= ARGV[1] then return 0 end
if ARGV[4] == '1' then s = string.format('%d', now) end
redis.call('SET', KEYS[1], e .. ' ' .. ARGV[3] .. ' ' .. x .. ' ' .. s .. ' ' .. lengths
           .. string.sub(v, at), 'KEEPTTL')
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[5])
return 1
"""

_CLOSE = """
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
local e, d, x, s, lengths, n, at = string.match(v, """ + _HEAD + """)
if not e or string.sub(v, at, at + n - 1) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[2])
return 1
"""

_RAISE = """
for n = 1, #ARGV, 2 do
  local old = tonumber(redis.call('HGET', KEYS[1], ARGV[n]) or '-1')
  if tonumber(ARGV[n + 1]) > old then redis.call('HSET', KEYS[1], ARGV[n], ARGV[n + 1]) end
end
return 1
"""

#: The scripts, by name, that ``stores.redis.Scripts`` registers beside the record verbs'.
SCRIPTS = {"intend": _INTEND, "due": _DUE, "reschedule": _RESCHEDULE, "close": _CLOSE,
           "raise": _RAISE}


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def intent_spec(task_id: str, queue: str, head: bytes, relay_after: int, ttl: int, eta: int) -> bytes:
    """The argument ``write_intent`` (``lua/_intent.lua``) builds an intent from: ``relay_after``,
    ``ttl`` and ``eta`` (ms; 0: none), the lengths, then ``task_id``, ``queue`` and the start of
    the message, ``head`` (the script appends the rest)."""
    t, q = task_id.encode(), queue.encode()
    return b"%d %d %d %d %d\n%b%b%b" % (relay_after, ttl, eta, len(t), len(q), t, q, head)


def parse_intent(key: str, value: bytes) -> Intent:
    """The intent of ``key`` from its stored ``value`` (the module's docstring)."""
    line = value.index(b"\n")
    enqueued, deadline, expires, sent, t, q = (int(n) for n in value[:line].split())
    start = line + 1
    return Intent(key, value[start:start + t].decode(), value[start + t:start + t + q].decode(),
                  bytes(value[start + t + q:]), enqueued / 1000, deadline / 1000, expires / 1000,
                  sent / 1000)


class _Host(Protocol):
    """What the mixin uses of its store."""

    client: Any
    prefix: str
    _scripts: Any

    def name_of(self, key: str) -> str: ...
    def _decode(self, key: str, value: bytes) -> Record: ...
    def _errors(self, key: str | None = None) -> AbstractContextManager[None]: ...
    def intent_index(self) -> str: ...


class RedisIntents:
    """The intent verbs of :class:`~celery_idem.stores.redis.RedisStore` (a mixin: it runs the
    store's client, prefix and error mapping)."""

    keeps_intents: ClassVar[bool] = True

    def intent_index(self: _Host) -> str:
        """The Redis key of the intents' index (sorted by deadline)."""
        return self.prefix + "\x1fintents"

    def intend(self: _Host, key: str, task_id: str, queue: str, message: bytes, *,
               relay_after: float, ttl: float, eta: float | None = None) -> Intent:
        args = [intent_spec(task_id, queue, b"", _ms(relay_after), max(1, _ms(ttl)),
                            _ms(eta) if eta else 0), message, key]
        with self._errors(key):
            now, deadline, expires = self._scripts.registered["intend"](
                keys=(self.name_of(key) + INTENT, self.intent_index()), args=args)
        return Intent(key, task_id, queue, bytes(message), now / 1000, deadline / 1000,
                      expires / 1000, now / 1000)

    def due_intents(self: _Host, limit: int = 500) -> list[tuple[Intent, Record | None]]:
        with self._errors():
            reply = self._scripts.registered["due"](
                keys=(self.intent_index(),), args=[self.prefix, limit, INTENT])
        found: list[tuple[Intent, Record | None]] = []
        for n in range(1, len(reply), 3):
            member, stored, value = reply[n:n + 3]
            key = text(member)
            found.append((parse_intent(key, stored), self._decode(key, value) if value else None))
        return found

    def reschedule_intent(self: _Host, intent: Intent, deadline: float, *,
                          resent: bool = False) -> bool:
        with self._errors(intent.key):
            done = self._scripts.registered["reschedule"](
                keys=(self.name_of(intent.key) + INTENT, self.intent_index()),
                args=[intent.task_id, _ms(intent.deadline), _ms(deadline), "1" if resent else "0",
                      intent.key])
        return bool(done)

    def reschedule_intents(self: _Host, moves: Sequence[tuple[Intent, float]], *,
                           resent: bool = False) -> list[bool]:
        if not moves:
            return []
        script = self._scripts.registered["reschedule"]
        with self._errors():
            # One round trip for the batch (the pipeline loads the script first if the
            # server lacks it); each compare-and-set is still atomic on its own.
            pipe = self.client.pipeline(transaction=False)
            for intent, deadline in moves:
                script(keys=(self.name_of(intent.key) + INTENT, self.intent_index()),
                       args=[intent.task_id, _ms(intent.deadline), _ms(deadline),
                             "1" if resent else "0", intent.key], client=pipe)
            return [bool(done) for done in pipe.execute()]

    def close_intent(self: _Host, key: str, task_id: str) -> None:
        with self._errors(key):
            self._scripts.registered["close"](
                keys=(self.name_of(key) + INTENT, self.intent_index()), args=[task_id, key])

    def intents(self: _Host, count: int = 100) -> Iterator[Intent]:
        start = 0
        while True:
            with self._errors():
                members = self.client.zrange(self.intent_index(), start, start + count - 1)
                if not members:
                    return
                pipe = self.client.pipeline(transaction=False)
                for member in members:
                    pipe.get(self.name_of(text(member)) + INTENT)
                rows = pipe.execute()
            for member, stored in zip(members, rows, strict=True):
                if stored is not None:
                    yield parse_intent(text(member), stored)
            start += count

    def watermarks(self: _Host) -> dict[str, float]:
        with self._errors():
            raw = self.client.hgetall(self.prefix + "\x1fwatermarks")
        return {text(queue): int(mark) / 1000 for queue, mark in raw.items()}

    def raise_watermarks(self: _Host, marks: Mapping[str, float]) -> None:
        if not marks:
            return
        args = [arg for queue, mark in marks.items() for arg in (queue, _ms(mark))]
        with self._errors():
            self._scripts.registered["raise"](keys=(self.prefix + "\x1fwatermarks",), args=args)
