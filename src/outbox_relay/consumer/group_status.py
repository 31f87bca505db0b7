"""Where a consumer group stands on its streams: pending, unread, idle (read-only Redis).

``XPENDING`` summaries, ``XINFO GROUPS`` and each stream's newest entry, pipelined: how many
entries of the group are pending (:func:`group_pending`, :func:`foreign_pending`: on which keys
another consumer holds some), how many are unread (:func:`unread`, :func:`outstanding`), and
whether the group is done with its streams (:func:`group_idle`, ``--until-idle``). The
consumer's gauges (:func:`owned_streams`), its readiness (:func:`missing_group`) and
``outbox status`` (:func:`stream_report`) read their Redis side here too. Nothing here changes
a stream or a group: the consumer's commands that do are in :mod:`consumer.streams` and
:mod:`consumer.letter_streams`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis

from outbox_relay.consumer.streams import id_tuple, text
from outbox_relay.shared import keys
from outbox_relay.shared.redis_conn import node_of, translate_redis_errors


def group_pending(client: redis.Redis, stream_keys: list[str], group: str) -> dict[str, int]:
    """How many entries of ``group`` are pending on each key (all consumers), pipelined."""
    if not stream_keys:
        return {}
    with translate_redis_errors():
        pipe = client.pipeline(transaction=False)
        for key in stream_keys:
            pipe.xpending(key, group)
        replies: Any = pipe.execute()
    return {key: int(reply["pending"]) for key, reply in zip(stream_keys, replies, strict=True)}


def group_idle(client: redis.Redis, stream_keys: list[str], group: str) -> bool:
    """Whether ``group`` has nothing pending (all consumers, retries waiting included) and
    nothing unread on every one of ``stream_keys`` (``XPENDING`` summaries, ``XINFO GROUPS``
    and each stream's newest id, pipelined; see :func:`unread`). A stream that does not exist
    holds nothing; one without the group, or a reply Redis refused, is not idle."""
    if not stream_keys:
        return True
    with translate_redis_errors():
        pipe = client.pipeline(transaction=False)
        for key in stream_keys:
            pipe.exists(key)
            pipe.xpending(key, group)
            pipe.xinfo_groups(key)
            pipe.xrevrange(key, count=1)
        replies: list[Any] = pipe.execute(raise_on_error=False)
    for i in range(0, len(replies), 4):
        exists, pending, groups, newest = replies[i:i + 4]
        if exists == 0:
            continue
        if any(isinstance(r, Exception) for r in (exists, pending, groups, newest)):
            return False
        info = next((g for g in groups if text(g["name"]) == group), None)
        if info is None or int(pending["pending"]) or unread(info, newest) != 0:
            return False
    return True


def outstanding(
    client: redis.Redis, stream_keys: list[str], group: str
) -> tuple[int, int | None]:
    """``(pending, unread)`` of ``group`` summed over ``stream_keys``: entries delivered and
    not acknowledged (retries waiting included), and entries not read yet (:func:`unread`;
    None when Redis cannot tell for some stream). One pipeline; a stream that does not
    exist, or lacks the group, adds nothing."""
    if not stream_keys:
        return 0, 0
    with translate_redis_errors():
        pipe = client.pipeline(transaction=False)
        for key in stream_keys:
            pipe.xpending(key, group)
            pipe.xinfo_groups(key)
            pipe.xrevrange(key, count=1)
        replies: list[Any] = pipe.execute(raise_on_error=False)
    pending, behind = 0, 0
    unknown = False
    for i in range(0, len(replies), 3):
        summary, groups, newest = replies[i:i + 3]
        if any(isinstance(r, Exception) for r in (summary, groups, newest)):
            continue  # no such key or group: nothing of ours there
        info = next((g for g in groups if text(g["name"]) == group), None)
        if info is None:
            continue
        pending += int(summary["pending"])
        lag = unread(info, newest)
        unknown = unknown or lag is None
        behind += lag or 0
    return pending, None if unknown else behind


def foreign_pending(
    client: redis.Redis, stream_keys: list[str], group: str, consumer: str
) -> set[str]:
    """The keys on which another consumer of ``group`` holds pending entries (``XPENDING``
    summaries, pipelined).

    The owner of a partition stream asks after each read, new or pending: a consumer that
    lost the lease can still have had a read, or an ``XCLAIM`` of its own pending pass,
    executed by Redis after the takeover (its process paused between its lease check and the
    send), leaving entries older than what the owner reads next in its pending list; the
    owner must take those over and apply them first, never read past them.
    """
    if not stream_keys:
        return set()
    with translate_redis_errors():
        pipe = client.pipeline(transaction=False)
        for key in stream_keys:
            pipe.xpending(key, group)
        replies: Any = pipe.execute()
    me = consumer.encode()
    return {
        key for key, reply in zip(stream_keys, replies, strict=True)
        if any(_bytes(c["name"]) != me for c in reply.get("consumers") or [])
    }


def unread(group_info: Mapping[str, Any], newest: list[Any] | None) -> int | None:
    """How many entries of a stream ``group`` has not read: 0 when the group's last-delivered
    id is at or above the stream's newest entry (``newest``: the reply of
    ``XREVRANGE key + - COUNT 1``; ``None`` when not known), else ``XINFO GROUPS``' lag
    (``None`` when Redis cannot tell).

    Redis's lag is ``entries-added - entries-read``, and a replica's copy of a group has no
    valid ``entries-read`` (Redis 7.0 does not replicate it with the reads): after a failover
    the promoted replica estimates it, and on a trimmed stream the estimate can stay a few
    entries short for good, showing a lag that no entry is behind. The id comparison is exact.
    """
    last = group_info.get("last-delivered-id")
    if newest is not None and (not newest or (last is not None and id_tuple(
            text(newest[0][0])) <= id_tuple(text(last)))):
        return 0
    lag = group_info.get("lag")
    return None if lag is None else int(lag)


def owned_streams(
    client: redis.Redis, prefix: str, group: str, owned: Mapping[str, tuple[str, int]]
) -> list[tuple[Any, Any, Any, Any, Any]]:
    """Per key of ``owned`` (stream key -> ``(stream, partition)``): (XPENDING summary, XINFO
    GROUPS, XLEN of its dead-letter stream, XLEN of the stream, its newest entry), in one
    pipeline; a command Redis refused (no group yet) leaves its error in place, a lost
    connection raises."""
    if not owned:
        return []
    with translate_redis_errors():
        pipe = client.pipeline(transaction=False)
        for key, (stream, partition) in owned.items():
            pipe.xpending(key, group)
            pipe.xinfo_groups(key)
            pipe.xlen(keys.dead_letter_key(prefix, stream, partition))
            pipe.xlen(key)
            pipe.xrevrange(key, count=1)  # the newest entry: lag 0 once the group read it
        flat: list[Any] = pipe.execute(raise_on_error=False)
        _raise_unavailable(flat)
    return [(flat[i], flat[i + 1], flat[i + 2], flat[i + 3], flat[i + 4])
            for i in range(0, len(flat), 5)]


def missing_group(client: redis.Redis, stream_keys: list[str], group: str) -> list[str]:
    """The keys on which ``group`` does not exist (``XINFO GROUPS``, pipelined; a lost
    connection raises)."""
    with translate_redis_errors():
        pipe = client.pipeline(transaction=False)
        for key in stream_keys:
            pipe.xinfo_groups(key)
        replies: list[Any] = pipe.execute(raise_on_error=False)
        _raise_unavailable(replies)
    return [k for k, r in zip(stream_keys, replies, strict=True)
            if group_info(r, group) is None]


def group_info(groups: Any, group: str) -> dict[str, Any] | None:
    """``group``'s entry in an ``XINFO GROUPS`` reply (None: absent, or the reply an error)."""
    if not isinstance(groups, list):
        return None
    for g in groups:
        name = g.get("name")
        if (name.decode() if isinstance(name, bytes) else name) == group:
            return dict(g)
    return None


def _raise_unavailable(replies: list[Any]) -> None:
    """Re-raise a connection error left in a pipeline's replies (a refused command, such as
    ``NOGROUP`` before the group exists, stays in place as "no value")."""
    for reply in replies:
        if isinstance(reply, redis.ConnectionError | redis.TimeoutError):
            raise reply


def stream_report(
    client: redis.Redis, prefix: str, known: set[tuple[str, int]]
) -> list[dict[str, Any]]:
    """``outbox status``'s view of the streams: each partition stream ``known`` (the
    database's, :func:`shared.partition_counts.known_partitions`), wherever it lives (on Redis
    Cluster, on its slot's master), and any other stream under ``prefix`` that a ``SCAN`` of
    the Redis we are connected to finds (written by hand); per stream its length, its groups
    (consumers, pending, lag, last delivered id), its dead letters and its cluster node."""
    out = []
    with translate_redis_errors():
        found = sorted({keys.stream_key(prefix, s, p) for s, p in known} | {
            k.decode() for k in client.scan_iter(match=keys.stream_key_pattern(prefix), count=1000)
        })
        for key in found:
            parsed = keys.parse_stream_key(prefix, key)
            if parsed is None or client.type(key) != b"stream":
                continue
            try:  # the newest entry: a group that read it has no lag (unread)
                newest: Any = client.xrevrange(key, count=1)
            except redis.exceptions.NoPermissionError:  # an older ACL (docs/security.md) lacks it
                newest = None
            groups = [
                {
                    "name": g["name"].decode(),
                    "consumers": g["consumers"],
                    "pending": g["pending"],
                    "lag": unread(g, newest),
                    "last_delivered_id": g["last-delivered-id"].decode(),
                }
                for g in client.xinfo_groups(key)
            ]
            out.append(
                {
                    "key": key,
                    "stream": parsed[0],
                    "partition": parsed[1],
                    "length": client.xlen(key),
                    "groups": groups,
                    "dead_letters": client.xlen(keys.dead_letter_key(prefix, *parsed)),
                    # On Redis Cluster, the master holding the stream's slot (None elsewhere).
                    "node": getattr(node_of(client, key), "name", None),
                }
            )
    return out


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()
