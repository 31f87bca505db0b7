"""The run store: runs and their events, written together in one transaction.

A run row carries its ``revision`` twice: in its own column, so a compare-and-set is one
``UPDATE … WHERE id = ? AND revision = ?``, and inside the JSON ``record``, so a record copied or
edited by hand that disagrees with its row is caught (``corrupt_record``) instead of trusted.
Every write returns the new record; every event id is ``{run_id}:{kind}:{revision}``. Every write
goes through :meth:`RunStore.compare_and_set`, which also enforces the forward-only state machine
of :mod:`runs.pipeline`: no write, however late, moves a run backward. A store without a
pipeline (the HTTP API, the sweeper) makes only the writes that need none (create, answer,
resume, fail); leasing a queued run and saving a checkpoint need the application's pipeline.

The record holds, besides the public fields: ``request`` (the original input), ``checkpoint``
(``{stage: output}`` of finished stages), ``questions`` (pending), ``answers``, ``receipts``
(``{idempotency_key: {fingerprint, interaction_id}}``), ``asked_by``, ``resume_at`` (where an
answered run goes on), ``stage``, ``result``, ``error`` and ``created_by`` (the API caller
that created the run, which alone may read and answer it; absent when authentication was off
or the run was created from code). The execution lease lives in columns
(``lease_owner`` is a per-lease token) so that a heartbeat extends it without a new revision.
It is one row's compare-and-set lease, not a share of keys among live nodes, so it does not use
:mod:`shared.leases`; it follows the same clock rule: lease expiries and ``updated_at_ms`` are
written and compared with the database's clock (:func:`shared.leases.db_now`), never a worker's
or sweeper's host clock, so a sweeper on a host ahead does not resume runs whose workers live.
All methods run in the caller's transaction.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, exists, insert, or_, select, update
from sqlalchemy.exc import IntegrityError

from outbox_relay.producer.enqueue import Producer
from outbox_relay.runs import pipeline as rs
from outbox_relay.runs.errors import IdempotencyConflictError, InvalidTransitionError
from outbox_relay.runs.pipeline import Pipeline
from outbox_relay.runs.schema import runs
from outbox_relay.runs.snapshot import Question, RunSnapshot, snapshot
from outbox_relay.shared.db import db_now_ms, is_postgres
from outbox_relay.shared.errors import (
    ConflictError,
    CorruptRecordError,
    InvalidRequestError,
    LeaseLostError,
    NotFoundError,
)
from outbox_relay.shared.leases import db_now
from outbox_relay.shared.schema import outbox
from outbox_relay.shared.settings import CommonSettings

RUNS_STREAM = "runs"
STORE_FIELDS = frozenset({"revision", "status", "stage", "checkpoint", "questions", "asked",
                          "asked_by", "resume_at", "answers", "receipts", "result", "error",
                          "created_by"})
"""Record fields only the store writes: a creator passing one is refused (``invalid_request``)."""
AGGREGATE = "run"
MAX_KEY_LENGTH = 128


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

    @property
    def created_by(self) -> str | None:
        """The API caller that created the run (``None``: no authenticated caller)."""
        value = self.record.get("created_by")
        return value if isinstance(value, str) else None


@dataclass(frozen=True)
class LeaseOutcome:
    """What :meth:`RunStore.lease_for_event` decided: the leased run, or why the event is
    skipped."""

    row: RunRow | None
    skipped: str | None = None  # stale | terminal | waiting | leased | not_found | unknown_stage


@dataclass(frozen=True)
class AnswerResult:
    """The run after an answer; ``replayed`` when the key was seen with the same answer."""

    row: RunRow
    replayed: bool


def fingerprint(interaction_id: str, value: str) -> str:
    """``sha256`` of the JSON array ``[interaction_id, value]``: what an answer receipt pins."""
    text = json.dumps([interaction_id, value], separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class RunStore:
    """Create, read and compare-and-set runs; each write enqueues its event atomically."""

    producer: Producer = field(default_factory=Producer)
    stream: str = RUNS_STREAM
    pipeline: Pipeline | None = None

    def create(self, conn: Connection, run_id: str, record: dict[str, Any], *,
               created_by: str | None = None) -> RunRow:
        """Insert revision 1, ``queued``, and its ``run.created`` event; ``conflict`` if the id
        exists. The fields the store keeps (:data:`STORE_FIELDS`: status, stage, questions,
        ``resume_at`` …) are refused with ``invalid_request``: a run starts from the beginning.
        ``created_by`` records the API caller that creates it."""
        status = rs.QUEUED
        if reserved := sorted(STORE_FIELDS & set(record)):
            raise InvalidRequestError(f"a new run's record cannot set {', '.join(reserved)}")
        now = db_now(conn)
        stored = {**record, "revision": 1, "status": status}
        if created_by is not None:
            stored["created_by"] = created_by
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

    def snapshot(self, row: RunRow) -> RunSnapshot:
        """The public view of a stored run."""
        return snapshot(row.id, row.status, row.record, row.created_at_ms, row.updated_at_ms)

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
        lease_token: str | None = None,
    ) -> RunRow:
        """Write revision ``expected_revision + 1`` if the run is still at ``expected_revision``.

        Exactly one row changes or :class:`ConflictError` (another writer won) /
        :class:`NotFoundError` / :class:`InvalidTransitionError` (the move is not allowed or
        backward) is raised. With ``lease_token`` the run must also still be leased to that
        token, else :class:`LeaseLostError`. With ``event``, the ``{run_id}:{event}:{revision}``
        outbox row is written in the same transaction.
        """
        current = self.get(conn, run_id)
        if lease_token is not None and current.lease_owner != lease_token:
            raise LeaseLostError(f"run {run_id!r} is no longer leased to this worker")
        if current.revision != expected_revision:
            raise ConflictError(
                f"run {run_id!r} is at revision {current.revision}, not {expected_revision}"
            )
        rs.check_transition(self.pipeline, current.status, status, current.record, record)
        revision = expected_revision + 1
        stored = {**record, "revision": revision, "status": status}
        now = db_now(conn)
        values: dict[str, Any] = {
            "revision": revision, "status": status, "record": _dump(stored),
            "lease_owner": lease_owner, "lease_expires_at_ms": lease_expires_at_ms,
            "updated_at_ms": now,
        }
        if attempts is not None:
            values["attempts"] = attempts
        condition = [runs.c.id == run_id, runs.c.revision == expected_revision]
        if lease_token is not None:
            condition.append(runs.c.lease_owner == lease_token)
        if conn.execute(update(runs).where(*condition).values(**values)).rowcount != 1:
            raise ConflictError(f"run {run_id!r} changed under us at revision {expected_revision}")
        if event is not None:
            self._event(conn, run_id, event, revision)
        return RunRow(
            run_id, revision, status, stored, lease_owner, lease_expires_at_ms,
            current.attempts if attempts is None else attempts, current.created_at_ms, now,
        )

    # -- worker side -------------------------------------------------------------------------

    def lease_for_event(
        self, conn: Connection, run_id: str, revision: int | None, token: str, *,
        ttl_ms: int, now: int | None = None,
    ) -> LeaseOutcome:
        """Lease the run to ``token`` for the event at ``revision``, or say why not.

        The event must be for the run's current revision (older: ``stale``); terminal runs,
        runs waiting for answers and runs leased to someone else are skipped. A queued run
        moves to the pipeline's first stage. A run in a stage the pipeline does not have is left
        as it is (``unknown_stage``): during a rolling deploy a newer worker has that stage, and
        failing the run would throw its work away; the worker logs it, and ``outbox reconcile``
        lists and resumes such runs. Runs in the caller's (the consumer's receipt) transaction.
        """
        pipeline = self._pipeline("lease a run")
        now = db_now(conn) if now is None else now
        try:
            row = self.get(conn, run_id, for_update=True)
        except NotFoundError:
            return LeaseOutcome(None, "not_found")
        skipped = _lease_skip(row, revision, now)
        if skipped is not None:
            return LeaseOutcome(None, skipped)
        if row.status != rs.QUEUED and row.status not in pipeline.stages:
            return LeaseOutcome(None, "unknown_stage")
        status = pipeline.first if row.status == rs.QUEUED else row.status
        leased = self.compare_and_set(
            conn, run_id, row.revision, {**row.record, "stage": status}, status=status,
            lease_owner=token, lease_expires_at_ms=now + ttl_ms,
        )
        return LeaseOutcome(leased)

    def checkpoint(
        self, conn: Connection, row: RunRow, token: str, output: Any, *,
        questions: list[Question] | None = None, ttl_ms: int,
    ) -> RunRow:
        """Save the finished stage ``row.status``'s output and move to what comes next.

        Next is ``needs_input`` (with ``questions``, event ``run.needs_input``, lease released),
        ``completed`` after the last stage (event ``run.completed``) or the next stage (lease
        extended). :class:`LeaseLostError`/:class:`ConflictError` if the run changed.
        """
        pipeline = self._pipeline("save a checkpoint")
        stage = row.status
        if stage not in pipeline.stages:
            raise InvalidTransitionError(f"a {stage} run has no stage to checkpoint")
        record = {**row.record, "checkpoint": {**row.record.get("checkpoint", {}), stage: output}}
        if questions:
            record.update(questions=[q.model_dump() for q in questions], asked_by=stage,
                          resume_at=pipeline.next_stage(stage),
                          asked=[*row.record.get("asked", []),
                                 *(q.interaction_id for q in questions)])
            return self.compare_and_set(conn, row.id, row.revision, record,
                                        status=rs.NEEDS_INPUT, event="run.needs_input",
                                        lease_token=token)
        status = pipeline.next_stage(stage)
        if status == rs.COMPLETED:
            return self.compare_and_set(conn, row.id, row.revision, {**record, "result": output},
                                        status=status, event="run.completed", lease_token=token)
        return self.compare_and_set(
            conn, row.id, row.revision, {**record, "stage": status}, status=status,
            lease_owner=token, lease_expires_at_ms=db_now(conn) + ttl_ms, lease_token=token,
        )

    def fail(self, conn: Connection, row: RunRow, reason: str, *,
             lease_token: str | None = None) -> RunRow:
        """Move the run to ``failed`` with ``reason`` and a ``run.failed`` event."""
        return self.compare_and_set(conn, row.id, row.revision, {**row.record, "error": reason},
                                    status=rs.FAILED, event="run.failed", lease_token=lease_token,
                                    attempts=row.attempts)

    def heartbeat(self, conn: Connection, tokens: list[str], *, ttl_ms: int) -> set[str]:
        """Extend the leases still held by ``tokens``; return those tokens (the rest are lost).

        Only the lease columns change, never the revision: a heartbeat cannot conflict with
        the stage's own compare-and-set, and it cannot revive a run swept by someone else
        (the sweep clears ``lease_owner``). On PostgreSQL rows locked by another transaction
        are skipped (``SKIP LOCKED``) rather than waited for: the heartbeat then never joins
        a deadlock, and a locked row is being written by a lease or checkpoint right now
        (still ours if its owner still is: the next beat extends it).
        """
        if not tokens:
            return set()
        held = runs.c.lease_owner.in_(tokens)
        free = select(runs.c.id).where(held).with_for_update(skip_locked=True)
        conn.execute(update(runs).where(runs.c.id.in_(free.scalar_subquery()))
                     .values(lease_expires_at_ms=db_now_ms(is_postgres(conn)) + ttl_ms))
        return set(conn.execute(select(runs.c.lease_owner).where(held)).scalars())

    def release(self, conn: Connection, tokens: list[str]) -> None:
        """Let held leases expire now, so that the next sweep resumes those runs at once."""
        if tokens:
            conn.execute(update(runs).where(runs.c.lease_owner.in_(tokens))
                         .values(lease_expires_at_ms=0))

    # -- recovery -----------------------------------------------------------------------------

    def expired(self, conn: Connection, *, now: int, limit: int) -> list[tuple[str, int]]:
        """``(id, revision)`` of active runs whose execution lease expired before ``now``."""
        rows = conn.execute(
            select(runs.c.id, runs.c.revision)
            .where(runs.c.lease_expires_at_ms < now, runs.c.status.not_in(sorted(rs.GENERIC)))
            .order_by(runs.c.lease_expires_at_ms).limit(limit)
        )
        return [(r[0], r[1]) for r in rows]

    def stuck(
        self, conn: Connection, *, now: int, stuck_after_ms: int, limit: int
    ) -> list[tuple[str, int, str]]:
        """``(id, revision, status)`` of active runs nothing will wake: no live lease, no
        undelivered event, unchanged for ``stuck_after_ms`` (``outbox reconcile`` resumes them)."""
        undelivered = exists().where(
            outbox.c.aggregate_type == AGGREGATE, outbox.c.aggregate_id == runs.c.id,
            outbox.c.delivered_at_ms.is_(None),
        )
        rows = conn.execute(
            select(runs.c.id, runs.c.revision, runs.c.status)
            .where(
                runs.c.status.not_in(sorted({rs.NEEDS_INPUT, *rs.TERMINAL})),
                or_(runs.c.lease_expires_at_ms.is_(None), runs.c.lease_expires_at_ms < now),
                runs.c.updated_at_ms < now - stuck_after_ms,
                ~undelivered,
            )
            .order_by(runs.c.updated_at_ms)
            .limit(limit)
        )
        return [(r.id, r.revision, r.status) for r in rows]

    def resume(self, conn: Connection, run_id: str, revision: int, *, max_attempts: int,
               now: int | None = None) -> RunRow:
        """Give a run whose lease expired a ``run.resume`` event (attempts + 1), by CAS.

        Past ``max_attempts`` the run fails with ``attempts_exhausted`` instead. A run that
        moved on or was re-leased meanwhile raises :class:`ConflictError`.
        """
        now = db_now(conn) if now is None else now
        row = self.get(conn, run_id, for_update=True)
        if row.revision != revision or (row.lease_expires_at_ms or 0) >= now:
            raise ConflictError(f"run {run_id!r} changed since the sweep read it")
        if row.attempts >= max_attempts:
            return self.fail(conn, row, "attempts_exhausted")
        return self.compare_and_set(conn, run_id, revision, row.record, status=row.status,
                                    event="run.resume", attempts=row.attempts + 1)

    # -- answers ------------------------------------------------------------------------------

    def submit_answer(
        self, conn: Connection, run_id: str, interaction_id: str, value: str,
        idempotency_key: str,
    ) -> AnswerResult:
        """Store an answer, its receipt and a ``run.answered`` event in one transaction.

        Same key and same answer: the current run again, nothing written (``replayed``). Same
        key, other answer: ``idempotency_conflict``. A question never asked (or not pending)
        is ``unknown_interaction`` (not found); one answered before is ``already_answered``
        (conflict). The last answer moves the run on to the stage after the one that asked.
        """
        if not 0 < len(idempotency_key) <= MAX_KEY_LENGTH or not idempotency_key.isprintable():
            raise InvalidRequestError("the idempotency key must be 1-128 printable characters")
        row = self.get(conn, run_id, for_update=True)
        record = row.record
        digest = fingerprint(interaction_id, value)
        receipt = record.get("receipts", {}).get(idempotency_key)
        if receipt is not None:
            if receipt["fingerprint"] != digest:
                raise IdempotencyConflictError(
                    "this idempotency key was used with a different answer")
            return AnswerResult(row, replayed=True)
        if interaction_id in record.get("answers", {}):
            raise ConflictError("this question was answered already", code="already_answered")
        pending = [q for q in record.get("questions", []) if q["interaction_id"] != interaction_id]
        if len(pending) == len(record.get("questions", [])):
            raise NotFoundError("the run has no pending question with this id",
                                code="unknown_interaction")
        status = rs.NEEDS_INPUT if pending else self._resume_at(record)
        new = {
            **record,
            "questions": pending,
            "answers": {**record.get("answers", {}), interaction_id: value},
            "receipts": {**record.get("receipts", {}),
                         idempotency_key: {"fingerprint": digest,
                                           "interaction_id": interaction_id}},
        }
        if not pending:
            new["stage"] = status
        updated = self.compare_and_set(conn, run_id, row.revision, new, status=status,
                                       event="run.answered")
        return AnswerResult(updated, replayed=False)

    def _event(self, conn: Connection, run_id: str, kind: str, revision: int) -> None:
        # Run events carry no payload: a worker re-reads the run, the source of truth.
        self.producer.enqueue(
            conn, type=kind, stream=self.stream, aggregate_type=AGGREGATE,
            aggregate_id=run_id, revision=revision, data=None,
        )

    def _pipeline(self, what: str) -> Pipeline:
        if self.pipeline is None:
            raise InvalidTransitionError(f"this run store has no pipeline: it cannot {what}")
        return self.pipeline

    @staticmethod
    def _resume_at(record: dict[str, Any]) -> str:
        """Where an answered run goes on: recorded when it asked (the pipeline's next stage,
        checked then by :func:`runs.pipeline.check_transition`)."""
        if "resume_at" not in record:
            raise CorruptRecordError("a waiting run does not say where it resumes (resume_at)")
        return str(record["resume_at"])


def store_for(settings: CommonSettings, source: str = "outbox-relay",
              pipeline: Pipeline | None = None) -> RunStore:
    """A run store whose events use the deployment's partitions and key prefix."""
    return RunStore(Producer(source=source, partitions=settings.partitions,
                             key_prefix=settings.key_prefix), pipeline=pipeline)


def _lease_skip(row: RunRow, revision: int | None, now: int) -> str | None:
    if revision != row.revision:
        return "stale"
    if row.status in rs.TERMINAL:
        return "terminal"
    if not rs.is_runnable(row.status):
        return "waiting"
    if row.lease_owner is not None and (row.lease_expires_at_ms or 0) > now:
        return "leased"
    return None


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
