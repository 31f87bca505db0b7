"""``enqueue``: add an event to the outbox inside the caller's transaction.

The row commits or rolls back with the caller's business writes: that is the whole point. The
insert is ``INSERT … ON CONFLICT (event_id) DO NOTHING RETURNING seq`` so a duplicate event id is
reported as :class:`DuplicateEventError` without aborting the caller's PostgreSQL transaction;
on PostgreSQL the same statement calls ``pg_notify`` (delivered only on commit) to wake relays.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Dialect
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from outbox_relay.producer import statements
from outbox_relay.shared import faults, keys, partition_counts, tracing
from outbox_relay.shared.db import now_ms
from outbox_relay.shared.envelope import DEFAULT_MAX_DATA_BYTES, MAX_ID_LENGTH, MAX_REVISION
from outbox_relay.shared.errors import DuplicateEventError, InvalidEventError

_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
_TRACESTATE = re.compile(r"^[\x20-\x7e]{1,512}$")
_TYPE = re.compile(r"^[A-Za-z0-9_.:\-/]{1,256}$")
_STREAM = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def event_id_for(aggregate_id: str, kind: str, revision: int) -> str:
    """The deterministic id of the event of one mutation: ``{aggregate_id}:{kind}:{revision}``.

    Enqueuing the same mutation twice hits the unique key instead of adding a second event.
    """
    return f"{aggregate_id}:{kind}:{revision}"


@dataclass(frozen=True)
class Producer:
    """Enqueues events; holds what every event of this service shares.

    ``partitions`` must equal the relays' and consumers' ``OUTBOX_PARTITIONS``.

    ``notify`` (PostgreSQL; SQLite has no notifications): each insert also calls ``pg_notify``,
    so relays wake up as soon as the transaction commits (a few ms end to end). The price is
    paid at commit: PostgreSQL serializes the commits of transactions that notified (they take
    one global lock and hold it through the commit's WAL flush). How much that costs depends
    on the machine (bench/PERFORMANCE.md: at 16 threads nothing measurable on an idle 2-core
    machine, half the rate when other load stretched the WAL flushes). With ``notify=False``
    the insert is the same one
    round trip without ``pg_notify``, commits run in parallel, and relays find the rows by
    polling: the latency becomes up to the relay's current poll interval (``poll_min_ms``
    while rows keep coming, doubling while none do, at most ``poll_max_ms``). Use it for many
    concurrent writers; keep the default for latency at modest commit rates.
    """

    source: str = "outbox-relay"
    partitions: int = 4
    key_prefix: str = keys.DEFAULT_PREFIX
    max_data_bytes: int = DEFAULT_MAX_DATA_BYTES
    notify: bool = True

    def enqueue(self, conn: Connection | Session, **event: Any) -> str:
        """Insert one event in ``conn``'s open transaction and return its id.

        Keyword arguments are those of :meth:`build`. Raises :class:`DuplicateEventError`
        if the id exists, :class:`InvalidEventError` for a malformed event, and ``ConfigError``
        (``invalid_config``) if the stream was first written with another partition count
        (:mod:`shared.partition_counts`; checked once per stream and process).
        """
        connection = conn.connection() if isinstance(conn, Session) else conn
        event_id, params = self._params(connection.dialect, event)
        partition_counts.record_or_check(connection, params["stream"], self.partitions)
        sql, args = statements.one_event(connection.dialect, params, self.notify)
        return _inserted(event_id, connection.exec_driver_sql(sql, args).first())

    async def enqueue_async(self, conn: AsyncConnection | AsyncSession, **event: Any) -> str:
        """The same as :meth:`enqueue` for an ``AsyncConnection`` or ``AsyncSession`` (one
        implementation: only the two driver calls are awaited)."""
        connection = await conn.connection() if isinstance(conn, AsyncSession) else conn
        event_id, params = self._params(connection.dialect, event)
        await connection.run_sync(partition_counts.record_or_check, params["stream"],
                                  self.partitions)
        sql, args = statements.one_event(connection.dialect, params, self.notify)
        return _inserted(event_id, (await connection.exec_driver_sql(sql, args)).first())

    def enqueue_many(
        self, conn: Connection | Session, events: Iterable[Mapping[str, Any]]
    ) -> list[str]:
        """Insert a list of events in ``conn``'s open transaction, in one statement (a
        multi-row insert, :data:`statements.ROWS_PER_STATEMENT` rows a statement), and return
        their ids in list order. Each event is a mapping of :meth:`build`'s keyword arguments.

        All or nothing: every event is validated before anything is sent; an id twice in the
        list, or already in the table, raises :class:`DuplicateEventError` naming it, and then
        the transaction holds no outbox row of this call (those inserted before the duplicate
        was seen are deleted again; a stream's first partition count may stay recorded) and
        stays usable: the caller may commit its other writes or roll back. On PostgreSQL with
        ``notify``, one ``pg_notify`` per distinct partition (after a duplicate, one may still
        go out at commit: a relay round that finds nothing). Partition counts are checked as
        by :meth:`enqueue`.
        """
        connection = conn.connection() if isinstance(conn, Session) else conn
        ids, rows = self._rows(events)
        if not rows:
            return []
        for stream in dict.fromkeys(row["stream"] for row in rows):
            partition_counts.record_or_check(connection, stream, self.partitions)
        inserted: list[str] = []
        for sql, args in self._many_calls(connection.dialect, rows):
            inserted += [r[0] for r in connection.exec_driver_sql(sql, args)]
        if len(inserted) < len(ids):
            connection.execute(statements.forget(inserted))
        return _all_inserted(ids, inserted)

    async def enqueue_many_async(
        self, conn: AsyncConnection | AsyncSession, events: Iterable[Mapping[str, Any]]
    ) -> list[str]:
        """The same as :meth:`enqueue_many` for an ``AsyncConnection`` or ``AsyncSession``
        (one implementation: only the driver calls are awaited)."""
        connection = await conn.connection() if isinstance(conn, AsyncSession) else conn
        ids, rows = self._rows(events)
        if not rows:
            return []
        for stream in dict.fromkeys(row["stream"] for row in rows):
            await connection.run_sync(partition_counts.record_or_check, stream,
                                      self.partitions)
        inserted: list[str] = []
        for sql, args in self._many_calls(connection.dialect, rows):
            inserted += [r[0] for r in await connection.exec_driver_sql(sql, args)]
        if len(inserted) < len(ids):
            await connection.execute(statements.forget(inserted))
        return _all_inserted(ids, inserted)

    def _params(self, dialect: Dialect, event: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        # `postgres` adds the notification's parameters: only when the statement notifies.
        return self.build(postgres=dialect.name == "postgresql" and self.notify, **event)

    def _rows(self, events: Iterable[Mapping[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
        """Validate every event of an :meth:`enqueue_many` call: their ids and rows, or
        :class:`DuplicateEventError` for an id twice in the list (nothing sent yet)."""
        ids: list[str] = []
        rows: list[dict[str, Any]] = []
        for event in events:
            event_id, row = self.build(postgres=False, **event)
            ids.append(event_id)
            rows.append(row)
        seen: set[str] = set()
        for event_id in ids:
            if event_id in seen:
                raise DuplicateEventError(f"event {event_id!r} is twice in the list")
            seen.add(event_id)
        return ids, rows

    def _many_calls(self, dialect: Dialect, rows: list[dict[str, Any]]) -> list[tuple[str, Any]]:
        return statements.many_events(dialect, rows, self.notify,
                                      keys.notify_channel(self.key_prefix))

    def build(
        self,
        *,
        postgres: bool,
        type: str,
        stream: str,
        data: Any = None,
        aggregate_type: str | None = None,
        aggregate_id: str | None = None,
        revision: int | None = None,
        event_id: str | None = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
        delay_ms: int = 0,
    ) -> tuple[str, dict[str, Any]]:
        """Validate an event and return its id and the parameters of the insert statement.

        The id is ``event_id`` if given, else deterministic when aggregate id and revision are
        given, else a random UUID (then only the caller can deduplicate). The statement itself
        is compiled once per driver (:mod:`producer.statements`): only the parameters change.
        ``postgres`` adds the parameters of the statement's ``pg_notify``.

        ``traceparent``/``tracestate``: the W3C trace context the event carries to its
        consumers; when the caller passes neither, the current OpenTelemetry span's context is
        used, if there is one (:func:`shared.tracing.carrier`; nothing without the ``otel``
        extra).
        """
        if traceparent is None and tracestate is None:
            current = tracing.carrier()
            if current:
                traceparent = current.get("traceparent")
                tracestate = current.get("tracestate")
                if tracestate is not None and not _valid_tracestate(tracestate):
                    tracestate = None  # ours to drop: tracing must never fail an enqueue
        row = self._row(
            type=type,
            stream=stream,
            data=data,
            aggregate_type=aggregate_type,
            aggregate_id=aggregate_id,
            revision=revision,
            event_id=event_id,
            traceparent=traceparent,
            tracestate=tracestate,
            delay_ms=delay_ms,
        )
        if postgres:
            row["notify_channel"] = keys.notify_channel(self.key_prefix)
            row["notify_payload"] = str(row["partition"])
        return row["event_id"], row

    def _row(
        self,
        *,
        type: str,
        stream: str,
        data: Any,
        aggregate_type: str | None,
        aggregate_id: str | None,
        revision: int | None,
        event_id: str | None,
        traceparent: str | None,
        delay_ms: int,
        tracestate: str | None = None,
    ) -> dict[str, Any]:
        _check_event(type, stream, aggregate_type, aggregate_id, revision, traceparent, delay_ms)
        if tracestate is not None and (traceparent is None or not _valid_tracestate(tracestate)):
            raise InvalidEventError(
                "tracestate must be W3C trace state text (at most 512 characters) and come "
                "with a traceparent", code="bad_field",
            )
        payload = self._payload(data)
        if event_id is None:
            if aggregate_id is not None and revision is not None:
                event_id = event_id_for(aggregate_id, type, revision)
            else:
                event_id = str(uuid.uuid4())
        _check_text("event id", event_id, MAX_ID_LENGTH)
        part_key = aggregate_id if aggregate_id is not None else event_id
        return {
            "event_id": event_id,
            "stream": stream,
            "partition": keys.partition_for(part_key, self.partitions),
            "aggregate_type": aggregate_type,
            "aggregate_id": aggregate_id,
            "revision": revision,
            "type": type,
            "source": self.source,
            "payload": payload,
            "headers": _headers(traceparent, tracestate),
            "created_at_ms": now_ms(),  # the CloudEvents `time`: this host's clock
            "delay_ms": delay_ms,  # available_at_ms = the database's clock + delay_ms
        }

    def _payload(self, data: Any) -> str:
        try:
            payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            raise InvalidEventError("data must be JSON-serializable", code="bad_json") from None
        try:
            size = len(payload.encode("utf-8"))
        except UnicodeEncodeError:
            raise InvalidEventError("data is not valid Unicode text", code="bad_encoding") from None
        if size > self.max_data_bytes:
            raise InvalidEventError(
                f"data is larger than {self.max_data_bytes} bytes", code="data_too_large"
            )
        return payload


def _inserted(event_id: str, returned: object) -> str:
    """After the insert (sync or async): no returned row means the id existed; then the
    ``producer.before_commit`` fault point (a crash before the caller commits)."""
    if returned is None:
        raise DuplicateEventError(f"event {event_id!r} was already enqueued")
    faults.point("producer.before_commit")
    return event_id


def _all_inserted(ids: list[str], inserted: list[str]) -> list[str]:
    """After :meth:`Producer.enqueue_many`'s inserts: the ids, or :class:`DuplicateEventError`
    naming the first one that was not inserted (the caller deleted the others); then the
    ``producer.before_commit`` fault point."""
    if len(inserted) < len(ids):
        done = set(inserted)
        first = next(i for i in ids if i not in done)
        raise DuplicateEventError(f"event {first!r} was already enqueued")
    faults.point("producer.before_commit")
    return ids


def _check_event(
    type: str,
    stream: str,
    aggregate_type: str | None,
    aggregate_id: str | None,
    revision: int | None,
    traceparent: str | None,
    delay_ms: int,
) -> None:
    """Refuse, with a reason code, anything a consumer would reject or a column cannot hold:
    the producer is the cheapest place to find out."""
    if not isinstance(type, str) or not _TYPE.match(type):
        raise InvalidEventError(
            "type must be 1-256 characters of [A-Za-z0-9_.:-/]", code="bad_type"
        )
    if not isinstance(stream, str) or not _STREAM.match(stream):
        raise InvalidEventError(
            "stream must be 1-64 characters of [A-Za-z0-9_.-]", code="bad_stream"
        )
    if aggregate_type is not None:
        _check_text("aggregate_type", aggregate_type, 128)
    if aggregate_id is not None:
        _check_text("aggregate_id", aggregate_id, 256)
    if revision is not None and (
        isinstance(revision, bool) or not isinstance(revision, int)
        or not 0 <= revision <= MAX_REVISION
    ):
        raise InvalidEventError(
            f"revision must be an integer from 0 to {MAX_REVISION}", code="bad_revision"
        )
    if traceparent is not None and not _TRACEPARENT.match(traceparent):
        raise InvalidEventError("traceparent is not a W3C trace context", code="bad_field")
    if delay_ms < 0:
        raise InvalidEventError("delay_ms must not be negative", code="bad_field")


def _headers(traceparent: str | None, tracestate: str | None) -> str:
    """The row's ``headers`` JSON: the trace context the relay puts on the stream entry."""
    if not traceparent:
        return "{}"
    if not tracestate:
        return json.dumps({"traceparent": traceparent})
    return json.dumps({"traceparent": traceparent, "tracestate": tracestate})


def _valid_tracestate(value: str) -> bool:
    """W3C ``tracestate``: printable ASCII list members, at most 512 characters here."""
    return isinstance(value, str) and _TRACESTATE.match(value) is not None


def _check_text(name: str, value: str, limit: int) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= limit or "\x00" in value:
        raise InvalidEventError(
            f"{name} must be 1-{limit} characters without NUL", code="bad_field"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidEventError(f"{name} is not valid Unicode text", code="bad_encoding") from None
