"""The intent verbs of the Redis store (``Store.intend`` ...), one Lua script each.

An intent is a hash at ``<record's name>\\x1fintent`` (fields ``t`` task id, ``q`` queue, ``m``
message, ``e`` enqueued, ``d`` deadline, ``x`` expires; times in the server's milliseconds),
indexed by deadline in the sorted set ``<prefix>\\x1fintents``; the queues' watermarks are the
hash ``<prefix>\\x1fwatermarks``. The index spans every key, so a Redis Cluster keeps no intents.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from importlib import resources
from typing import Any, ClassVar, Protocol

from ..records import Intent, Record
from .redis_durability import text

__all__ = ["INTENT", "INTENT_LUA", "SCRIPTS", "RedisIntents"]

#: After a record's name, names its intent (never a record's name: a key is printable).
INTENT = "\x1fintent"

#: The intent's write (``write_intent``), shared with the enqueue check within the publish.
INTENT_LUA = resources.files(__package__).joinpath("lua", "_intent.lua").read_text("utf-8")

_NOW = "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000) "

_INTEND = INTENT_LUA + """
return write_intent(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7])
"""

_DUE = _NOW + """
local members = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
local out = {now}
for _, m in ipairs(members) do
  local name = ARGV[1] .. m
  local i = redis.call('HMGET', name .. ARGV[3], 't', 'q', 'm', 'e', 'd', 'x', 's')
  if not i[1] then
    redis.call('ZREM', KEYS[1], m)  -- gone with its hash, long after it went stale
  else
    table.insert(out, m)
    for _, v in ipairs(i) do table.insert(out, v) end
    table.insert(out, redis.call('GET', name) or '')
  end
end
return out
"""

_RESCHEDULE = _NOW + """
local i = redis.call('HMGET', KEYS[1], 't', 'd')
if i[1] ~= ARGV[1] or i[2] ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'd', ARGV[3])
if ARGV[4] == '1' then redis.call('HSET', KEYS[1], 's', now) end
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[5])
return 1
"""

_CLOSE = """
if redis.call('HGET', KEYS[1], 't') ~= ARGV[1] then return 0 end
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
        args = [task_id, queue, message, _ms(relay_after), max(1, _ms(ttl)),
                _ms(eta) if eta else 0, key]
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
        for n in range(1, len(reply), 9):
            member, task_id, queue, message, enqueued, deadline, expires, sent, value = reply[n:n + 9]
            key = text(member)
            intent = Intent(key, text(task_id), text(queue), bytes(message), int(enqueued) / 1000,
                            int(deadline) / 1000, int(expires) / 1000, int(sent) / 1000)
            found.append((intent, self._decode(key, value) if value else None))
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
                    pipe.hmget(self.name_of(text(member)) + INTENT, "t", "q", "m", "e", "d", "x", "s")
                rows = pipe.execute()
            for member, row in zip(members, rows, strict=True):
                if row[0] is not None:
                    yield Intent(text(member), text(row[0]), text(row[1]), bytes(row[2]),
                                 *(int(t or 0) / 1000 for t in row[3:7]))
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
