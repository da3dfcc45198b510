"""celery_idem benchmarks: ``python -m bench --help``.

* ``e2e``: end-to-end throughput through real ``celery worker`` subprocesses, a plain task
  against the same task with ``base=IdempotentTask``, interleaved, medians over repetitions.
* ``micro``: the in-process gate, the Redis floor, record size, and a profile of the hot path.
* ``intents`` (``python -m bench.intents``): what ``idempotency_intent`` costs at enqueue and in
  the worker, and the relay's throughput and polls at rest.

Everything a run writes to Redis lives under one random prefix (``bench-<hex>:``), queues and
result keys included, and is deleted at the end; the SQL store uses a private table, dropped
at the end.
"""
