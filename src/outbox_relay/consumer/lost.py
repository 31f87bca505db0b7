"""Entries that vanished while pending: a receipt ``lost`` and a dead letter, never a silent ACK.

An entry our group was delivered but had not acknowledged can disappear from the stream: an
operator's blind ``XTRIM``/``XDEL``, or ``OUTBOX_STREAM_MAXLEN_UNSAFE``. (Our own trimming,
relay/trim.py, never removes a pending entry.) Redis then still lists it as pending, and reading
it back gives an id without fields. Acknowledging it would drop the event silently, so before
the ``XACK`` :func:`record` writes, in one transaction:

* if the database holds the outbox row of that stream entry (the consumer shares the
  producer's database, as in the default setup), the event is known: its id, type, aggregate,
  revision and payload go into the letter, and a receipt the group already has for it means it
  *was* handled (applied, superseded, dead): the entry is just acknowledged;
* otherwise the receipt is keyed ``lost:<stream key>/<entry id>`` (a receipt of the group for
  that stream entry, if one exists, again means it was handled).

A new receipt has outcome ``lost`` and reason ``trimmed_while_pending``; the letter (reason
``lost``) is written after the commit and before the ``XACK``, so a crash in between re-reads
the entry, finds the ``lost`` receipt and writes the letter again (a second copy, never none).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Connection, Engine, delete, insert, select, tuple_

from outbox_relay.consumer.streams import Entry, RawFields
from outbox_relay.shared import keys
from outbox_relay.shared.db import now_ms
from outbox_relay.shared.db_errors import translate_errors
from outbox_relay.shared.envelope import JSON_CONTENT_TYPE, SPECVERSION
from outbox_relay.shared.schema import consumer_retries, inbox, outbox

LOST = "lost"
REASON = "trimmed_while_pending"


@dataclass(frozen=True)
class Lost:
    """What :func:`record` decided for one vanished entry."""

    entry: Entry  # with the fields the outbox still knows (None if nothing is known)
    letter: bool  # write a dead letter (a new or repeated ``lost`` receipt)
    event_id: str


def record(
    engine: Engine,
    prefix: str,
    group: str,
    entries: list[Entry],
    check: Callable[[Connection], None] | None = None,
) -> list[Lost]:
    """Record a ``lost`` receipt for each vanished entry the group has no receipt for; one
    transaction, first ``check(conn)`` (the ownership fence). Returns one decision per entry."""
    if not entries:
        return []
    with translate_errors(), engine.begin() as conn:
        if check is not None:
            check(conn)
        known = _outbox_fields(conn, prefix, entries)
        ids = {(e.key, e.entry_id): known[(e.key, e.entry_id)][0]
               if (e.key, e.entry_id) in known else f"lost:{e.key}/{e.entry_id}"
               for e in entries}
        receipts = _receipts(conn, group, entries, list(ids.values()))
        out: list[Lost] = []
        now = now_ms()
        for e in entries:
            event_id = ids[(e.key, e.entry_id)]
            fields = known.get((e.key, e.entry_id), (event_id, None))[1]
            entry = Entry(e.key, e.entry_id, fields, e.deliveries)
            outcome = receipts.get(event_id) or receipts.get(f"@{e.key}/{e.entry_id}")
            if outcome is not None and outcome != LOST:
                out.append(Lost(entry, False, event_id))  # it was handled before it vanished
                continue
            if outcome is None:
                conn.execute(insert(inbox).values(
                    group_name=group, event_id=event_id, stream_key=e.key,
                    entry_id=e.entry_id, outcome=LOST, reason=REASON, created_at_ms=now,
                    **_known_columns(fields),
                ))
                receipts[event_id] = LOST
            out.append(Lost(entry, True, event_id))
        # An entry that vanished while it waited for a retry is never claimed again: its
        # retry row goes with it (invariant 7), in the transaction that records it lost.
        r = consumer_retries.c
        conn.execute(delete(consumer_retries).where(
            r.group_name == group,
            tuple_(r.stream_key, r.entry_id).in_([(e.key, e.entry_id) for e in entries])))
    return out


def _outbox_fields(
    conn: Connection, prefix: str, entries: list[Entry]
) -> dict[tuple[str, str], tuple[str, RawFields]]:
    """The outbox rows behind the entries, as the fields a letter carries."""
    where = []
    for e in entries:
        parsed = keys.parse_stream_key(prefix, e.key)
        if parsed is not None:
            where.append((parsed[0], parsed[1], e.entry_id))
    if not where:
        return {}
    rows = conn.execute(
        select(outbox.c.stream, outbox.c.partition, outbox.c.entry_id, outbox.c.event_id,
               outbox.c.type, outbox.c.source, outbox.c.aggregate_type, outbox.c.aggregate_id,
               outbox.c.revision, outbox.c.payload, outbox.c.created_at_ms)
        .where(tuple_(outbox.c.stream, outbox.c.partition, outbox.c.entry_id).in_(where),
               outbox.c.entry_id.is_not(None))  # the stream-entry index's predicate (0009)
    ).all()
    found: dict[tuple[str, str], tuple[str, RawFields]] = {}
    for r in rows:
        time = datetime.fromtimestamp(r.created_at_ms / 1000, tz=UTC).isoformat()
        fields = {b"specversion": SPECVERSION, b"id": r.event_id, b"type": r.type,
                  b"source": r.source, b"time": time.replace("+00:00", "Z"),
                  b"datacontenttype": JSON_CONTENT_TYPE, b"data": r.payload,
                  b"aggregatetype": r.aggregate_type, b"aggregateid": r.aggregate_id,
                  b"revision": None if r.revision is None else str(r.revision)}
        found[(keys.stream_key(prefix, r.stream, r.partition), r.entry_id)] = (
            r.event_id, {k: v.encode() for k, v in fields.items() if v is not None})
    return found


def _receipts(
    conn: Connection, group: str, entries: list[Entry], event_ids: list[str]
) -> dict[str, str]:
    """The group's receipts for these events (by id), and for these stream entries (keyed
    ``@<key>/<entry id>``: a receipt written under the event's real id when the outbox row is
    gone or in another database)."""
    by_id = conn.execute(
        select(inbox.c.event_id, inbox.c.outcome)
        .where(inbox.c.group_name == group, inbox.c.event_id.in_(event_ids))
    ).all()
    by_entry = conn.execute(
        select(inbox.c.stream_key, inbox.c.entry_id, inbox.c.outcome).where(
            inbox.c.group_name == group,
            tuple_(inbox.c.stream_key, inbox.c.entry_id).in_(
                [(e.key, e.entry_id) for e in entries]),
        )
    ).all()
    found = {event_id: outcome for event_id, outcome in by_id}
    found.update({f"@{key}/{entry_id}": outcome for key, entry_id, outcome in by_entry})
    return found


def _known_columns(fields: RawFields | None) -> dict[str, object]:
    if not fields:
        return {}
    revision = fields.get(b"revision")
    return {
        "event_type": fields[b"type"].decode() if b"type" in fields else None,
        "aggregate_type": (fields[b"aggregatetype"].decode()
                           if b"aggregatetype" in fields else None),
        "aggregate_id": fields[b"aggregateid"].decode() if b"aggregateid" in fields else None,
        "revision": int(revision) if revision is not None else None,
    }
