"""The Redis commands on dead-letter streams: find them, read, delete and trim letters.

A partition's dead-letter stream is ``prefix:{stream:partition}:dead`` (:mod:`shared.keys`).
Every command the consumer sends to one is here (``SCAN``, ``XRANGE``, ``XDEL``, ``XTRIM``)
but the one that writes a letter, ``XADD`` in :func:`consumer.streams.dead_letter`, which
runs with the read and the ack of the entry it sets aside. What a letter means (its ``dlq.*``
fields, replay, purge) is :mod:`consumer.dead_letters`; which receipts a letter protects is
:mod:`consumer.prune`; when letters are trimmed is :mod:`consumer.hygiene`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import redis

from outbox_relay.consumer.streams import text
from outbox_relay.shared import keys
from outbox_relay.shared.redis_conn import translate_redis_errors

RawLetter = tuple[str, dict[bytes, bytes]]
"""A letter as read: its own entry id in the dead-letter stream, and all its fields."""

DEAD_SUFFIX = keys.dead_letter_key("p", "s", 0).removeprefix(keys.stream_key("p", "s", 0))
"""The suffix :func:`shared.keys.dead_letter_key` puts after a partition's stream key
(derived, not repeated)."""


def partition_of(prefix: str, dead_key: str) -> tuple[str, int] | None:
    """``(stream, partition)`` of a dead-letter stream key under ``prefix``; None if it is not
    one."""
    return keys.parse_stream_key(prefix, dead_key.removesuffix(DEAD_SUFFIX))


def dead_keys(
    client: redis.Redis, prefix: str, stream: str | None = None, partition: int | None = None
) -> list[str]:
    """Every dead-letter stream under ``prefix`` (optionally of one stream/partition), sorted:
    a ``SCAN`` unless both ``stream`` and ``partition`` name the one key."""
    if stream is not None and partition is not None:
        return [keys.dead_letter_key(prefix, stream, partition)]
    found: list[tuple[str, int, str]] = []
    with translate_redis_errors():
        pattern = keys.stream_key_pattern(prefix) + DEAD_SUFFIX
        for raw in client.scan_iter(match=pattern, count=1000):
            key = text(raw)
            parsed = partition_of(prefix, key)
            if parsed is None:
                continue
            if (stream is None or parsed[0] == stream) and (
                partition is None or parsed[1] == partition
            ):
                found.append((parsed[0], parsed[1], key))
    return [key for _s, _p, key in sorted(found)]


def read_range(
    client: redis.Redis, key: str, start: str, count: int, *, end: str = "+"
) -> list[RawLetter]:
    """``XRANGE key start end COUNT count``: up to ``count`` letters, oldest first."""
    with translate_redis_errors():
        reply = client.xrange(key, start, end, count=count)
    rows = cast(list[tuple[bytes, dict[bytes, bytes]]], reply)
    return [(text(dead_id), fields) for dead_id, fields in rows]


def walk(client: redis.Redis, key: str, batch: int) -> Iterator[list[RawLetter]]:
    """Every letter of ``key`` in pages of ``batch`` (:func:`read_range`), each page starting
    after the last id of the one before: robust to letters deleted behind the cursor."""
    start = "-"
    while True:
        page = read_range(client, key, start, batch)
        yield page
        if len(page) < batch:
            return
        start = f"({page[-1][0]}"


def delete(client: redis.Redis, key: str, *dead_ids: str) -> int:
    """``XDEL key id…``: how many of the letters were there to delete."""
    if not dead_ids:
        return 0
    with translate_redis_errors():
        return int(client.xdel(key, *dead_ids))


def trim_before(client: redis.Redis, dead: list[str], cutoff_ms: int) -> int:
    """``XTRIM key MINID cutoff_ms`` (exact) on each dead-letter stream, pipelined: every
    letter written before ``cutoff_ms`` goes (a letter's id is the Redis time it was written).
    Returns the number of letters removed."""
    if not dead or cutoff_ms <= 0:
        return 0
    with translate_redis_errors():
        pipe = client.pipeline(transaction=False)
        for key in dead:
            pipe.xtrim(key, minid=cutoff_ms, approximate=False)
        return sum(int(n) for n in pipe.execute())
