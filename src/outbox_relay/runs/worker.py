"""The run worker: a consumer handler for ``run.*`` events that executes runs durably.

Flow of one event (design.md flow 4):

1. **Lease**, inside the consumer's receipt transaction (the handler gets its connection): the
   event's revision must equal the run's (older → ``stale``, acknowledged and skipped); a
   terminal run, a run waiting for answers, or one leased to a live worker is skipped without
   calling the agent. Otherwise the run is leased to a fresh token (owner, expiry) by
   compare-and-set in that same transaction, and the execution is scheduled with
   ``Handlers.after_commit``: it starts only after the lease committed and the entry was
   acknowledged, so a message is never held during the work.
2. **Execute**, on one of ``run_concurrency`` threads, outside any transaction: each stage runs,
   then its output and the next status are saved by compare-and-set, fenced by the lease token.
   One heartbeat thread extends the leases of every run this worker holds. A failed
   compare-and-set (lease lost to the sweeper, run changed) stops the execution without writing.
3. **Recover**: the sweeper (:mod:`runs.sweeper`) gives runs whose lease expired a
   ``run.resume`` event; the next lease continues from the checkpoint, so only the interrupted
   stage runs again.

The stages are the application's (:class:`~outbox_relay.runs.pipeline.Pipeline`), run by its
agent; a stage that is not an asking one and returns questions fails the run
(``unexpected_questions``): asking from there would break the forward-only order.

Startup order (:func:`start_worker`): open the store and check the schema → recover (one sweep)
→ consume. Checking first means recovery never writes to a database this code does not
understand; recovering before consuming means runs orphaned by a crash get their ``run.resume``
before new work competes with them, instead of waiting one sweep interval, and a run that was
leased by the previous incarnation of this very process is not left stranded.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import Connection, Engine

from outbox_relay.consumer.handlers import Handlers
from outbox_relay.runs import pipeline as rs
from outbox_relay.runs.agent import Agent, AgentError, StageContext
from outbox_relay.runs.groupcommit import GroupCommit
from outbox_relay.runs.pipeline import Pipeline
from outbox_relay.runs.schema import check_schema
from outbox_relay.runs.settings import RunSettings
from outbox_relay.runs.store import RunRow, RunStore, store_for
from outbox_relay.runs.sweeper import Sweeper
from outbox_relay.shared import faults
from outbox_relay.shared.db import make_engine
from outbox_relay.shared.db_errors import translate_errors
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.errors import ConflictError, LeaseLostError, NotFoundError, OutboxError

log = logging.getLogger(__name__)

RUN_EVENTS = ("run.created", "run.resume", "run.answered", "run.needs_input",
              "run.completed", "run.failed")


def start_worker(settings: RunSettings, pipeline: Pipeline, agent: Agent, registry: Handlers, *,
                 owner: str, engine: Engine | None = None) -> tuple[RunWorker, Sweeper]:
    """Open the store and check the schema → recover (one sweep) → register and start.

    The caller consumes afterwards; see the module docstring for why in this order.
    """
    engine = make_engine(settings.database_url) if engine is None else engine
    check_schema(engine)
    store = store_for(settings, source="outbox-worker", pipeline=pipeline)
    # The sweeper needs no pipeline (it only resumes or fails runs), and must not have one: a
    # run in a stage this pipeline lacks must still get its run.resume.
    sweeper = Sweeper(engine, store_for(settings, source="outbox-worker"), settings)
    recovered = sweeper.sweep_once()
    if recovered.resumed or recovered.failed:
        log.info("recovered %d run(s), failed %d", recovered.resumed, recovered.failed)
    worker = RunWorker(engine, store, agent, settings, owner=owner)
    worker.register(registry)
    worker.start()
    sweeper.start()
    return worker, sweeper


@dataclass
class WorkerStats:
    """Counters since start (read by tests and the demo)."""

    leased: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    stages: int = 0
    completed: int = 0
    asked: int = 0
    failed: int = 0
    lost: int = 0
    errors: int = 0


@dataclass(frozen=True)
class Lease:
    """A leased run and the token that fences every write of this execution."""

    row: RunRow
    token: str


class RunWorker:
    """Leases runs from events and executes their stages with an agent."""

    def __init__(self, engine: Engine, store: RunStore, agent: Agent, settings: RunSettings,
                 *, owner: str = "worker") -> None:
        if store.pipeline is None:
            raise ValueError("a run worker needs a run store with the application's pipeline")
        self.engine, self.store, self.agent, self.settings = engine, store, agent, settings
        self.pipeline: Pipeline = store.pipeline
        self.owner = owner
        self.stats = WorkerStats()
        self._registry: Handlers | None = None
        self._held: dict[str, str] = {}  # token -> run id, leased and not finished
        self._lost: set[str] = set()
        self._lock = threading.Lock()
        self._jobs: queue.Queue[Lease] = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._writer: GroupCommit[RunRow] = GroupCommit(engine)

    # -- lease (consumer thread, inside the receipt transaction) -------------------------------

    def register(self, registry: Handlers) -> None:
        """Handle every ``run.*`` event type in ``registry``, ordered ``latest``.

        A run event carries no change, it only says "this run changed, re-read it": one older
        than the revision the group applied is ``superseded`` (acknowledged, counted), and the
        lease below re-reads the run anyway.
        """
        self._registry = registry
        for kind in RUN_EVENTS:
            registry.register(kind, self.handle, ordering="latest")
        registry.pause_when(self.saturated)

    def saturated(self) -> bool:
        """Holding twice as many runs as threads execute: read no more until some finish."""
        with self._lock:
            return len(self._held) >= 2 * self.settings.run_concurrency

    def handle(self, conn: Connection, event: Event, /) -> None:
        """The handler: lease the run on ``conn`` and schedule its execution after commit."""
        lease = self.lease_run(conn, event)
        if lease is not None and self._registry is not None:
            self._registry.after_commit(event.id, lambda: self.submit(lease))

    def lease_run(self, conn: Connection, event: Event) -> Lease | None:
        """Lease the event's run in ``conn``'s transaction; None when it must be skipped."""
        if event.aggregateid is None:
            self._skip("no_aggregate")
            return None
        token = f"{self.owner}:{uuid.uuid4().hex[:12]}"
        outcome = self.store.lease_for_event(conn, event.aggregateid, event.revision, token,
                                             ttl_ms=self.settings.run_lease_ttl_ms)
        if outcome.row is None:
            self._skip(outcome.skipped or "skipped")
            if outcome.skipped == "unknown_stage":  # left for a worker that has the stage
                log.warning("run %s is in a stage this worker's pipeline lacks; left as it is",
                            event.aggregateid)
            return None
        self.stats.leased += 1
        return Lease(outcome.row, token)

    def _skip(self, reason: str) -> None:
        self.stats.skipped[reason] = self.stats.skipped.get(reason, 0) + 1
        log.debug("run event skipped: %s", reason)

    # -- execution (pool threads, no transaction open) ----------------------------------------

    def submit(self, lease: Lease) -> None:
        """Queue a leased run for execution; from now on the heartbeat extends its lease.

        Never blocks: every run of a committed batch must be under the heartbeat at once, or
        the last ones' leases could expire while earlier ones wait. The backlog is bounded by
        :meth:`saturated`: the consumer stops reading while this worker holds too many runs.
        """
        with self._lock:
            self._held[lease.token] = lease.row.id
        self._jobs.put_nowait(lease)

    def execute(self, lease: Lease) -> RunRow | None:
        """Run stages until the run waits, ends, or the lease is lost; return the last row."""
        row: RunRow | None = lease.row
        while row is not None and rs.in_stage(row.status) and not self._stop.is_set():
            row = self._run_stage(row, lease.token)
            if row is not None:  # a checkpoint was saved (None: nothing was written)
                faults.point("worker.after_checkpoint")
        with self._lock:
            self._lost.discard(lease.token)
            if row is None or not rs.in_stage(row.status):  # else stopping: close() releases
                self._held.pop(lease.token, None)
        return row

    def _run_stage(self, row: RunRow, token: str) -> RunRow | None:
        record = row.record
        context = StageContext(row.id, record.get("request", {}), record.get("checkpoint", {}),
                               record.get("answers", {}))
        try:
            result = self.agent.run_stage(row.status, context)
            self.stats.stages += 1
            faults.point("worker.mid_stage")  # stage done, checkpoint not saved
        except AgentError as err:
            code = err.code
            return self._write(token, lambda c: self.store.fail(c, row, code, lease_token=token))
        except Exception as err:  # unknown failure: leave the run to the sweeper
            self.stats.errors += 1
            log.warning("stage %s of run %s raised %s; the lease will expire", row.status,
                        row.id, type(err).__name__)
            return None
        if result.questions and row.status not in self.pipeline.asking:
            log.warning("stage %s of run %s asked questions but is not an asking stage",
                        row.status, row.id)
            return self._write(token, lambda c: self.store.fail(c, row, "unexpected_questions",
                                                                lease_token=token))
        new = self._write(token, lambda c: self.store.checkpoint(
            c, row, token, result.output, questions=result.questions,
            ttl_ms=self.settings.run_lease_ttl_ms))
        if new is not None and new.status == rs.NEEDS_INPUT:
            self.stats.asked += len(result.questions)
        elif new is not None and new.status == rs.COMPLETED:
            self.stats.completed += 1
        return new

    def _write(self, token: str, write: Callable[[Connection], RunRow]) -> RunRow | None:
        """One compare-and-set, committed (grouped with others' writes) before it returns;
        None (stop) if the run moved."""
        if token in self._lost:
            self.stats.lost += 1
            return None
        try:
            row = self._writer.write(write)
        except (LeaseLostError, ConflictError, NotFoundError) as err:
            self.stats.lost += 1
            log.info("run lease lost (%s); stopping without writing", err.code)
            return None
        except OutboxError as err:
            self.stats.errors += 1
            log.warning("could not save a checkpoint: %s", err)
            return None
        if row.status == rs.FAILED:
            self.stats.failed += 1
        return row

    # -- threads ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the execution threads, the group-commit writer and the heartbeat."""
        self._writer.start()
        for i in range(self.settings.run_concurrency):
            self._spawn(self._work_loop, f"run-worker-{i}")
        self._spawn(self._heartbeat_loop, "run-heartbeat")

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _work_loop(self) -> None:
        while not self._stop.is_set():
            try:
                lease = self._jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self.execute(lease)
            except Exception:  # keep the thread alive whatever a run does
                self.stats.errors += 1
                log.exception("run execution failed")

    def heartbeat(self) -> set[str]:
        """Extend every held lease once; remember and return the tokens found lost."""
        with self._lock:
            tokens = list(self._held)
        if not tokens:
            return set()
        with translate_errors(), self.engine.begin() as conn:
            alive = self.store.heartbeat(conn, tokens, ttl_ms=self.settings.run_lease_ttl_ms)
        lost = set(tokens) - alive
        with self._lock:
            self._lost |= lost & set(self._held)
        return lost

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.settings.run_heartbeat_ms / 1000):
            try:
                self.heartbeat()
            except OutboxError as err:
                log.warning("heartbeat failed: %s", err.code)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop after the running stages' checkpoints (waiting ``timeout_s`` in all); let
        unfinished leases expire now. A second call does nothing."""
        if self._stop.is_set():
            return
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        self._writer.stop()
        with self._lock:
            tokens = list(self._held)
        try:
            with translate_errors(), self.engine.begin() as conn:
                self.store.release(conn, tokens)
        except OutboxError as err:
            log.warning("could not release leases (%s); they expire by themselves", err.code)
