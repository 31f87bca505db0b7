"""Every Redis command of the relay: pipelined ``XADD`` with explicit ids and its verdicts.

``append`` sends one partition's batch as a non-transactional pipeline and sorts each row into
``delivered`` (Redis holds it under its id), ``gaps`` (its id fell behind the stream's top and
the entry is not there: it must be republished at the top) or ``failed`` (an error to retry).
A connection error or timeout raises :class:`UnavailableError`: the outcome is unknown, nothing
may be marked, and the retry with the same ids is what tells the cases apart.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import redis

from relay import entry_ids
from relay.store import OutboxRow
from shared import keys
from shared.envelope import JSON_CONTENT_TYPE, SPECVERSION
from shared.redis_conn import translate_redis_errors

log = logging.getLogger(__name__)

TOO_SMALL = "equal or smaller than the target stream top item"


@dataclass
class Verdicts:
    """What Redis said about each row of a batch."""

    delivered: list[tuple[int, str]] = field(default_factory=list)
    already: int = 0
    gaps: list[int] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)
    stream_top: str | None = None  # highest last-generated id seen behind a gap


def to_fields(row: OutboxRow) -> dict[str, str]:
    """The CloudEvents fields of a row: the same map as ``shared.envelope.Event.to_fields``.

    Built directly from the row instead of through the pydantic model, which cost more than
    the ``XADD`` itself. The payload is stored as compact JSON text by the producer and goes
    out as it is (the model would parse and re-serialize it to the same text); a row that is
    not valid JSON reaches consumers, which dead-letter it with ``bad_json``.
    """
    created = datetime.fromtimestamp(row.created_at_ms / 1000, tz=UTC)
    fields = {
        "specversion": SPECVERSION,
        "id": row.event_id,
        "source": row.source,
        "type": row.type,
        "time": created.isoformat().replace("+00:00", "Z"),
        "datacontenttype": JSON_CONTENT_TYPE,
        "data": row.payload,
    }
    if row.aggregate_id is not None:
        fields["subject"] = row.aggregate_id
    if row.aggregate_type is not None:
        fields["aggregatetype"] = row.aggregate_type
    if row.aggregate_id is not None:
        fields["aggregateid"] = row.aggregate_id
    if row.revision is not None:
        fields["revision"] = str(row.revision)
    if row.headers and row.headers != "{}":
        traceparent = json.loads(row.headers).get("traceparent")
        if traceparent is not None:
            fields["traceparent"] = traceparent
    return fields


def append(
    client: redis.Redis, prefix: str, rows: list[OutboxRow], maxlen: int = 0
) -> Verdicts:
    """``XADD key <entry id> fields…`` for each row, pipelined; classify every answer."""
    verdicts = Verdicts()
    if not rows:
        return verdicts
    with translate_redis_errors():
        pipe = client.pipeline(transaction=False)
        for row in rows:
            key = keys.stream_key(prefix, row.stream, row.partition)
            pipe.xadd(
                key,
                to_fields(row),  # type: ignore[arg-type]
                id=row.entry_id,
                maxlen=maxlen or None,
                approximate=True,
            )
        answers = pipe.execute(raise_on_error=False)
        for row, answer in zip(rows, answers, strict=True):
            _classify(client, prefix, row, answer, verdicts)
    return verdicts


def _classify(
    client: redis.Redis, prefix: str, row: OutboxRow, answer: object, verdicts: Verdicts
) -> None:
    if not isinstance(answer, Exception):
        verdicts.delivered.append((row.seq, row.entry_id))
        return
    if isinstance(answer, redis.ResponseError) and TOO_SMALL in str(answer):
        if already_there(client, prefix, row):
            verdicts.delivered.append((row.seq, row.entry_id))
            verdicts.already += 1
        else:
            log.warning("ordering gap: event %s republished at the stream top", row.event_id)
            verdicts.gaps.append(row.seq)
            top = last_generated_id(client, keys.stream_key(prefix, row.stream, row.partition))
            if top and (verdicts.stream_top is None or entry_ids.greater(top, verdicts.stream_top)):
                verdicts.stream_top = top
        return
    if isinstance(answer, redis.ConnectionError | redis.TimeoutError):
        raise answer
    code = _error_code(answer)
    log.warning("append of event %s failed: %s", row.event_id, code)
    verdicts.failed.append((row.seq, code))


def last_generated_id(client: redis.Redis, key: str) -> str | None:
    """The id Redis compares explicit ids against (it survives ``XDEL`` of the top entry)."""
    info: Any = client.xinfo_stream(key)
    value = info.get("last-generated-id") or info.get(b"last-generated-id")
    return value.decode() if isinstance(value, bytes) else value


def already_there(client: redis.Redis, prefix: str, row: OutboxRow) -> bool:
    """``XRANGE key id id``: is this exact event already stored under its entry id?"""
    key = keys.stream_key(prefix, row.stream, row.partition)
    found = client.xrange(key, row.entry_id, row.entry_id)
    if not found:
        return False
    _id, fields = found[0]
    return bool(fields and fields.get(b"id") == row.event_id.encode("utf-8"))


def _error_code(answer: object) -> str:
    if isinstance(answer, redis.exceptions.NoPermissionError):  # redis-py strips "NOPERM"
        return "redis_acl"
    text = str(answer)
    if text.startswith("OOM"):
        return "redis_oom"
    if text.startswith(("NOPERM", "NOAUTH")):
        return "redis_acl"
    if text.startswith("WRONGTYPE"):
        return "redis_wrongtype"
    if text.startswith(("READONLY", "MASTERDOWN", "LOADING")):
        return "redis_not_ready"
    return "redis_error"


def durability_barrier(
    client: redis.Redis, replicas: int, timeout_ms: int, aof: bool
) -> bool:
    """``WAIT`` / ``WAITAOF`` before marking; False when fewer copies than asked confirmed."""
    with translate_redis_errors():
        if replicas > 0 and int(client.wait(replicas, timeout_ms)) < replicas:
            return False
        if aof:
            reply = client.execute_command("WAITAOF", 1, replicas, timeout_ms)  # type: ignore[no-untyped-call]
            local = reply[0]
            if int(local) < 1:
                return False
    return True
