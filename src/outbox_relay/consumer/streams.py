"""The consumer's Redis commands: groups, read, take over, delivery counts, ack, dead letters.

Every command the consumer sends on its partition streams is here, but two kinds with a
module of their own: what a group has pending or unread (read-only ``XPENDING``, ``XINFO``,
``XLEN``) is read by :mod:`consumer.group_status`, and the dead-letter streams are listed,
read, deleted from and trimmed by :mod:`consumer.letter_streams` (the letters are written
here, :func:`dead_letter`). Idle consumers leave a group through :func:`drop_idle_consumers`
(group hygiene, :mod:`consumer.hygiene`).

Reads are bounded in memory (issue 28, finding 6): an entry larger than ``max_entry_bytes``
never leaves Redis. ``XREADGROUP`` runs inside a small script (:data:`READ_BOUNDED`) that
replaces the fields of such an entry by its size before the reply is sent, so the consumer
receives a few bytes for it (:class:`OversizedFields`), dead-letters it as ``oversized`` and
acknowledges it, and the partition goes on. Why a script: Redis has no command that returns
a stream entry's size without its data (``MEMORY USAGE`` is per key, ``XINFO`` and ``XRANGE``
return the fields), and an ``XREADGROUP`` sent by the client returns every entry whole. A
script cannot block, so a read that would wait (``block_ms``) polls instead: it tries again
after 1 ms, doubling up to :data:`POLL_MAX_S`, until ``block_ms`` has passed; with the
relay's doorbell (:mod:`consumer.doorbell`) a pause ends as soon as the relay appended.
What is bounded is the consumer (and the network): inside Redis the script holds a copy of
the entry while it counts, memory Redis gives back as soon as the script returns.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import redis

from outbox_relay.consumer.doorbell import Doorbell
from outbox_relay.shared import keys
from outbox_relay.shared.envelope import DEFAULT_MAX_DATA_BYTES
from outbox_relay.shared.errors import UnavailableError
from outbox_relay.shared.redis_conn import is_cluster, translate_redis_errors

log = logging.getLogger(__name__)

RawFields = Mapping[bytes, bytes]

ENTRY_HEADROOM_BYTES = 65_536
"""Room for an entry's other fields (id, source, type, trace context, signature) beyond its
``data``: an entry is refused unread when its fields and values, together, exceed
``max_data_bytes`` plus this."""
DEFAULT_MAX_ENTRY_BYTES = DEFAULT_MAX_DATA_BYTES + ENTRY_HEADROOM_BYTES
POLL_FIRST_S = 0.001
POLL_MAX_S = 0.02
"""The longest pause between two tries of a read that waits for new entries: the latency a
new entry can see on an idle consumer."""

READ_BOUNDED = """
local call = {'XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS'}
for i = 1, #KEYS do call[#call + 1] = KEYS[i] end
for i = 5, #ARGV do call[#call + 1] = ARGV[i] end
local reply = redis.call(unpack(call))
if not reply or #reply == 0 then return false end
if type(reply[1]) == 'string' then  -- key, entries, key, … (fakeredis flattens the pairs)
  local paired = {}
  for i = 1, #reply, 2 do paired[#paired + 1] = {reply[i], reply[i + 1]} end
  reply = paired
end
local limit = tonumber(ARGV[4])
for _, stream in ipairs(reply) do
  for _, entry in ipairs(stream[2]) do
    local fields = entry[2]
    if fields then
      local size = 0
      for i = 1, #fields do size = size + #fields[i] end
      if size > limit then entry[2] = {size} end
    end
  end
end
return reply
"""
"""``XREADGROUP GROUP g c COUNT n STREAMS keys… starts…`` whose entries above ``ARGV[4]``
bytes (names and values) come back as ``{size}`` instead of their fields. The entry was
delivered to the group like any other (it is pending for us until acknowledged)."""


def entry_limit(max_data_bytes: int) -> int:
    """The largest entry a consumer with this ``max_data_bytes`` reads (see
    :data:`ENTRY_HEADROOM_BYTES`)."""
    return max_data_bytes + ENTRY_HEADROOM_BYTES


class OversizedFields(dict[bytes, bytes]):
    """The fields of an entry refused from its size: empty (it was never read), with its
    ``size`` in bytes as Redis's script counted it and the ``limit`` it exceeded."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__()
        self.size = size
        self.limit = limit


class Entry(NamedTuple):
    """One stream entry as read, with how many times the group has delivered it."""

    key: str
    entry_id: str
    fields: RawFields | None  # None: the entry was deleted/trimmed while pending
    deliveries: int = 1


def ensure_groups(client: redis.Redis, stream_keys: list[str], group: str) -> None:
    """``XGROUP CREATE key group 0 MKSTREAM`` for each key, ignoring "already exists".

    Starting at ``0`` means a new group sees the stream from its beginning; ``MKSTREAM``
    lets consumers start before the relay has written anything, and recreates a group after
    Redis lost its data.
    """
    with translate_redis_errors():
        for key in stream_keys:
            try:
                client.xgroup_create(key, group, id="0", mkstream=True)
            except redis.ResponseError as err:
                if "BUSYGROUP" not in str(err):
                    raise


def read(
    client: redis.Redis,
    starts: dict[str, str],
    group: str,
    consumer: str,
    *,
    count: int,
    block_ms: int | None,
    max_entry_bytes: int | None = DEFAULT_MAX_ENTRY_BYTES,
    bell: Doorbell | None = None,
) -> list[Entry]:
    """``XREADGROUP`` from ``{key: start}``: ``">"`` for new entries, an id for our own
    pending entries after it (their delivery counters come from ``XPENDING``). An entry
    larger than ``max_entry_bytes`` comes back with :class:`OversizedFields`, unread.

    With ``block_ms``, waits up to that long for entries (polling, see the module's
    docstring; with ``bell``, listening to the streams' doorbell between two tries:
    :mod:`consumer.doorbell`). On Redis Cluster each partition stream lives in its own slot,
    and one script may not name two slots (``CROSSSLOT``): one call per stream there.

    ``max_entry_bytes=None`` (``OUTBOX_BOUNDED_READS=false``): a plain ``XREADGROUP``, which
    blocks inside Redis (an entry arriving is read at once, an idle consumer sends nothing)
    but returns every entry whole, whatever its size.
    """
    with translate_redis_errors():
        if max_entry_bytes is None:
            entries = _read_whole(client, starts, group, consumer, count, block_ms)
        else:
            entries = _poll_bounded(client, starts, group, consumer, count, block_ms,
                                    max_entry_bytes, bell)
    pending = any(start != ">" for start in starts.values())
    if pending and entries:
        return with_delivery_counts(client, group, consumer, entries)
    return entries


def _poll_bounded(
    client: redis.Redis, starts: dict[str, str], group: str, consumer: str, count: int,
    block_ms: int | None, limit: int, bell: Doorbell | None = None,
) -> list[Entry]:
    """:func:`_read_bounded` until it returns entries or ``block_ms`` passed (polling; with
    ``bell``, a ring ends a pause at once)."""
    deadline = time.monotonic() + (block_ms or 0) / 1000
    pause = POLL_FIRST_S
    while True:
        entries = _read_bounded(client, starts, group, consumer, count, limit)
        left = deadline - time.monotonic()
        if entries or left <= 0:
            return entries
        if bell is None:
            time.sleep(min(pause, left))
            pause = min(pause * 2, POLL_MAX_S)
        elif bell.wait(min(pause, left)):
            pause = POLL_FIRST_S
        else:
            pause = min(pause * 2, bell.max_pause_s(POLL_MAX_S))


def _read_whole(
    client: redis.Redis, starts: dict[str, str], group: str, consumer: str, count: int,
    block_ms: int | None,
) -> list[Entry]:
    """One blocking ``XREADGROUP`` (pipelined per stream on a cluster: :func:`_read_each`)."""
    if is_cluster(client) and len(starts) > 1:
        reply: Any = _read_each(client, starts, group, consumer, count, block_ms)
    else:
        reply = client.xreadgroup(
            group, consumer, starts, count=count, block=block_ms  # type: ignore[arg-type]
        )
    return [
        Entry(text(key), text(entry_id), fields or None)
        for key, items in (reply or [])
        for entry_id, fields in items
    ]


CLUSTER_BLOCK_MS = 50
"""On a cluster, the longest a plain read blocks on one partition stream while the others may
get entries: the extra latency an entry can see when its stream was not the one blocked on."""


def _read_each(
    client: redis.Redis, starts: dict[str, str], group: str, consumer: str, count: int,
    block_ms: int | None,
) -> list[Any]:
    """One ``XREADGROUP`` per partition stream, pipelined (the cluster client sends each to
    the master of its slot); ``count`` applies per stream. When nothing came and the caller
    would block, block on one stream, chosen at random, for at most :data:`CLUSTER_BLOCK_MS`
    (a blocking read can wait on one slot only), so an entry on any stream is seen within
    that time and one on the chosen stream at once."""
    pipe = client.pipeline(transaction=False)
    for key, start in starts.items():
        pipe.xreadgroup(group, consumer, {key: start}, count=count)
    replies: list[Any] = [item for reply in pipe.execute() for item in (reply or [])]
    if replies or not block_ms:
        return replies
    key = random.choice(list(starts))
    reply: Any = client.xreadgroup(group, consumer, {key: starts[key]}, count=count,
                                   block=min(block_ms, CLUSTER_BLOCK_MS))
    return list(reply or [])


def _read_bounded(
    client: redis.Redis, starts: dict[str, str], group: str, consumer: str, count: int,
    limit: int,
) -> list[Entry]:
    """One :data:`READ_BOUNDED` call (one per stream on a cluster), never blocking."""
    script = client.register_script(READ_BOUNDED)
    if is_cluster(client) and len(starts) > 1:
        reply: list[Any] = [
            item for key, start in starts.items()
            for item in (script(keys=[key], args=[group, consumer, count, limit, start]) or [])
        ]
    else:
        reply = script(keys=list(starts), args=[group, consumer, count, limit,
                                                *starts.values()]) or []
    return [
        Entry(text(key), text(entry_id), _fields(raw, limit))
        for key, items in reply
        for entry_id, raw in items
    ]


def _fields(raw: list[Any] | None, limit: int) -> RawFields | None:
    """An entry's fields from the script's flat ``[name, value, …]``; ``None`` for an entry
    deleted while pending; :class:`OversizedFields` for ``[size]`` (a real entry always has
    an even number of items, each a string)."""
    if not raw:
        return None
    if len(raw) == 1 and isinstance(raw[0], int):
        return OversizedFields(raw[0], limit)
    return dict(zip(raw[::2], raw[1::2], strict=True))


def with_delivery_counts(
    client: redis.Redis, group: str, consumer: str, entries: list[Entry]
) -> list[Entry]:
    """Fill in each entry's delivery counter from ``XPENDING`` (one call per stream)."""
    counts: dict[tuple[str, str], int] = {}
    with translate_redis_errors():
        by_key: dict[str, list[Entry]] = {}
        for e in entries:
            by_key.setdefault(e.key, []).append(e)
        for key, items in by_key.items():
            ids = sorted((e.entry_id for e in items), key=id_tuple)
            rows: Any = client.xpending_range(
                key, group, min=ids[0], max=ids[-1], count=len(ids) * 2 + 10,
                consumername=consumer,
            )
            for row in rows:
                counts[(key, text(row["message_id"]))] = int(row["times_delivered"])
    return [
        Entry(e.key, e.entry_id, e.fields, counts.get((e.key, e.entry_id), e.deliveries))
        for e in entries
    ]


def ack(client: redis.Redis, group: str, entries: list[Entry]) -> None:
    """``XACK`` the entries, one command per stream, pipelined."""
    if not entries:
        return
    by_key: dict[str, list[str]] = {}
    for e in entries:
        by_key.setdefault(e.key, []).append(e.entry_id)
    with translate_redis_errors():
        pipe = client.pipeline(transaction=False)
        for key, ids in by_key.items():
            pipe.xack(key, group, *ids)
        pipe.execute()


def dead_letter(
    client: redis.Redis,
    prefix: str,
    items: list[tuple[Entry, str, str]],
    group: str,
    consumer: str,
) -> None:
    """Copy each ``(entry, reason code, message)`` with its original fields to the dead-letter
    stream of its partition. Written before the entry is acknowledged, so a crash in between
    leaves a second copy, never none."""
    if not items:
        return
    with translate_redis_errors():
        pipe = client.pipeline(transaction=False)
        for entry, reason, message in items:
            parsed = keys.parse_stream_key(prefix, entry.key)
            dlq = keys.dead_letter_key(prefix, *parsed) if parsed else f"{entry.key}:dead"
            fields: dict[Any, Any] = dict(entry.fields or {})
            if isinstance(entry.fields, OversizedFields):  # no fields: only its size
                fields["dlq.size"] = str(entry.fields.size)
            fields.update(
                {
                    "dlq.reason": reason,
                    "dlq.message": message,
                    "dlq.stream": entry.key,
                    "dlq.entry_id": entry.entry_id,
                    "dlq.group": group,
                    "dlq.consumer": consumer,
                    "dlq.deliveries": str(entry.deliveries),
                    "dlq.time_ms": str(int(time.time() * 1000)),
                }
            )
            pipe.xadd(dlq, fields)
        pipe.execute()


def partition_keys(prefix: str, streams: list[str], partitions: int) -> list[str]:
    """Every partition stream key of the given logical streams."""
    return [keys.stream_key(prefix, s, p) for s in streams for p in range(partitions)]


def text(value: bytes | str) -> str:
    """A Redis reply value (bytes: responses are not decoded, see shared/redis_conn.py) as
    text; our own keys, ids and group names are ASCII."""
    return value.decode() if isinstance(value, bytes) else value


def id_tuple(entry_id: str) -> tuple[int, int]:
    """An entry id as ``(ms, seq)``, the order of ids."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def restore_delivery_count(
    client: redis.Redis, group: str, consumer: str, entries: list[Entry]
) -> None:
    """Put back the delivery counter of entries that only waited (an earlier event of their
    aggregate was failing or waiting): ``XCLAIM key group me 0 id RETRYCOUNT <deliveries-1>
    JUSTID``, pipelined. So waiting never counts as an attempt toward ``max_deliveries``.

    The entries stay pending for ``consumer`` (they are already ours: the claim only rewrites
    their counter and resets their idle time).
    """
    if not entries:
        return
    with translate_redis_errors():
        pipe = client.pipeline(transaction=False)
        for e in entries:
            pipe.xclaim(e.key, group, consumer, 0, [e.entry_id],
                        retrycount=max(e.deliveries - 1, 0), justid=True)
        pipe.execute()


def take_over(
    client: redis.Redis, key: str, group: str, consumer: str, *, count: int
) -> tuple[int, list[Entry]]:
    """Move every pending entry of ``group`` on ``key`` to ``consumer``, whatever its idle time:
    the new owner of a partition stream takes over the previous owner's entries.

    ``XPENDING`` pages through the group's pending list (in id order); the entries of other
    consumers are moved with ``XCLAIM … 0 … JUSTID``, which leaves their delivery counters
    alone (the owner's re-read counts the delivery). ``XAUTOCLAIM … JUSTID`` would do the same,
    but redis-py drops its cursor. Returns how many entries moved, and the entries Redis
    dropped from the pending list because the stream no longer holds them (as entries
    without fields: the caller letters them, never loses them silently).
    """
    moved, trimmed = 0, []
    start = "-"
    with translate_redis_errors():
        while True:
            rows: Any = client.xpending_range(key, group, min=start, max="+", count=count)
            if not rows:
                break
            ids: list[Any] = [
                text(r["message_id"]) for r in rows if text(r["consumer"]) != consumer
            ]
            if ids:
                got: Any = client.xclaim(key, group, consumer, 0, ids, justid=True)
                claimed = {text(i) for i in got}
                moved += len(claimed)
                counts = {text(r["message_id"]): int(r["times_delivered"]) for r in rows}
                trimmed += [Entry(key, i, None, counts[i]) for i in ids if i not in claimed]
            if len(rows) < count:
                break
            start = "(" + text(rows[-1]["message_id"])
    if trimmed:
        log.warning("%d pending entries of %s were trimmed away", len(trimmed), key)
    return moved, trimmed


DROP_IDLE = """
local reply = redis.pcall('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
if type(reply) == 'table' and reply.err then
  local err = reply.err
  if string.find(err, 'NOGROUP', 1, true) == 1 or string.find(err, 'no such key', 1, true) then
    return {}
  end
  return reply
end
local limit = tonumber(ARGV[2])
local removed = {}
for _, consumer in ipairs(reply) do
  local info = {}
  for i = 1, #consumer, 2 do
    info[consumer[i]] = consumer[i + 1]
  end
  if info['name'] ~= ARGV[3] and info['pending'] == 0 and info['idle'] > limit then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], info['name'])
    removed[#removed + 1] = info['name']
  end
end
return removed
"""
"""KEYS[1] a partition stream; ARGV: group, idle limit (ms), the caller's consumer name.
Returns the names removed. A missing stream or group has no consumers to remove; any other
error (an ACL refusal) is returned as the error it is."""


def drop_idle_consumers(
    client: redis.Redis, stream_keys: list[str], group: str, idle_ms: int, me: str
) -> list[str]:
    """Remove, on each key, the consumers of ``group`` idle more than ``idle_ms`` with nothing
    pending, never ``me`` (:data:`DROP_IDLE`, one script per key: the check and the
    ``XGROUP DELCONSUMER`` run alone in Redis); the names removed."""
    script = client.register_script(DROP_IDLE)
    removed: list[str] = []
    with translate_redis_errors(), _refusals_in_scripts():
        for key in stream_keys:
            names: Any = script(keys=[key], args=[group, idle_ms, me])
            removed += [n.decode() if isinstance(n, bytes) else str(n) for n in names]
    return removed


@contextlib.contextmanager
def _refusals_in_scripts() -> Iterator[None]:
    """An ACL refusal of a command inside a script comes back without the ``NOPERM`` code
    (``The user executing the script can't run this command…``): report it as one, so the
    periodic task logs it and retries instead of stopping the consumer."""
    try:
        yield
    except redis.ResponseError as err:
        if "can't run this command" in str(err):
            raise UnavailableError("Redis refused the command for our user (ACL)") from err
        raise
