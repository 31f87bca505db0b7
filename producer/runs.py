"""The run store: runs and their events, written together in one transaction.

A run row carries its ``revision`` twice: in its own column, so a compare-and-set is one
``UPDATE … WHERE id = ? AND revision = ?``, and inside the JSON ``record``, so a record copied or
edited by hand that disagrees with its row is caught (``corrupt_record``) instead of trusted.
Every write returns the new record; every event id is ``{run_id}:{kind}:{revision}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, insert, select, update
from sqlalchemy.exc import IntegrityError

from producer.enqueue import Producer
from shared.db import now_ms
from shared.errors import ConflictError, CorruptRecordError, NotFoundError
from shared.schema import runs

RUNS_STREAM = "runs"
AGGREGATE = "run"


@dataclass(frozen=True)
class RunRow:
    """A run as stored: columns plus the parsed record."""

    id: str
    revision: int
    status: str
    record: dict[str, Any]
    lease_owner: str | None = None
    lease_expires_at_ms: int | None = None
    attempts: int = 0
    created_at_ms: int = 0
    updated_at_ms: int = 0


@dataclass(frozen=True)
class RunStore:
    """Create, read and compare-and-set runs; each write enqueues its event atomically."""

    producer: Producer = Producer()
    stream: str = RUNS_STREAM

    def create(
        self, conn: Connection, run_id: str, record: dict[str, Any], *, status: str = "queued"
    ) -> RunRow:
        """Insert revision 1 and its ``run.created`` event; ``conflict`` if the id exists."""
        now = now_ms()
        stored = {**record, "revision": 1, "status": status}
        try:
            with conn.begin_nested():
                conn.execute(
                    insert(runs).values(
                        id=run_id, revision=1, status=status, record=_dump(stored),
                        attempts=0, created_at_ms=now, updated_at_ms=now,
                    )
                )
        except IntegrityError:
            raise ConflictError(f"run {run_id!r} already exists") from None
        self._event(conn, run_id, "run.created", 1)
        return RunRow(run_id, 1, status, stored, created_at_ms=now, updated_at_ms=now)

    def get(self, conn: Connection, run_id: str, *, for_update: bool = False) -> RunRow:
        """Read a run; ``not_found`` if absent, ``corrupt_record`` if its record disagrees."""
        query = select(runs).where(runs.c.id == run_id)
        if for_update and conn.dialect.name == "postgresql":
            query = query.with_for_update()
        row = conn.execute(query).first()
        if row is None:
            raise NotFoundError(f"run {run_id!r} does not exist")
        return _parse(row)

    def compare_and_set(
        self,
        conn: Connection,
        run_id: str,
        expected_revision: int,
        record: dict[str, Any],
        *,
        status: str,
        event: str | None = None,
        lease_owner: str | None = None,
        lease_expires_at_ms: int | None = None,
        attempts: int | None = None,
    ) -> RunRow:
        """Write revision ``expected_revision + 1`` if the run is still at ``expected_revision``.

        Exactly one row changes or :class:`ConflictError` (another writer won) /
        :class:`NotFoundError` is raised. With ``event``, the ``{run_id}:{event}:{revision}``
        outbox row is written in the same transaction.
        """
        revision = expected_revision + 1
        stored = {**record, "revision": revision, "status": status}
        values: dict[str, Any] = {
            "revision": revision, "status": status, "record": _dump(stored),
            "lease_owner": lease_owner, "lease_expires_at_ms": lease_expires_at_ms,
            "updated_at_ms": now_ms(),
        }
        if attempts is not None:
            values["attempts"] = attempts
        result = conn.execute(
            update(runs)
            .where(runs.c.id == run_id, runs.c.revision == expected_revision)
            .values(**values)
        )
        if result.rowcount != 1:
            exists = conn.execute(select(runs.c.revision).where(runs.c.id == run_id)).first()
            if exists is None:
                raise NotFoundError(f"run {run_id!r} does not exist")
            raise ConflictError(
                f"run {run_id!r} is at revision {exists[0]}, not {expected_revision}"
            )
        if event is not None:
            self._event(conn, run_id, event, revision)
        return self.get(conn, run_id)

    def _event(self, conn: Connection, run_id: str, kind: str, revision: int) -> None:
        # Run events carry no payload: a worker re-reads the run, the source of truth.
        self.producer.enqueue(
            conn, type=kind, stream=self.stream, aggregate_type=AGGREGATE,
            aggregate_id=run_id, revision=revision, data=None,
        )


def _dump(record: dict[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":"), sort_keys=True)


def _parse(row: Any) -> RunRow:
    try:
        record = json.loads(row.record)
    except ValueError:
        raise CorruptRecordError(f"run {row.id!r} has an unreadable record") from None
    if not isinstance(record, dict) or record.get("revision") != row.revision:
        raise CorruptRecordError(
            f"run {row.id!r}: record revision disagrees with the row's revision {row.revision}"
        )
    return RunRow(
        id=row.id, revision=row.revision, status=row.status, record=record,
        lease_owner=row.lease_owner, lease_expires_at_ms=row.lease_expires_at_ms,
        attempts=row.attempts, created_at_ms=row.created_at_ms, updated_at_ms=row.updated_at_ms,
    )
