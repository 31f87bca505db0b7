"""Stateful property: no sequence of events, writes or answers moves a run backward.

Hypothesis drives the real :class:`RunStore` on a SQLite file with every kind of write a run
can see — arbitrary status writes with current or stale revisions, by a store with the pipeline
(a worker) and by one without (the HTTP API, the sweeper), leases for current and old event
revisions, checkpoints with and without questions, answers (repeated, conflicting, unknown),
sweeps — and after every step checks that the stored run's position on the forward-only scale,
its revision, and terminal-ness never went back.
"""

from __future__ import annotations

import shutil
import tempfile

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from outbox_relay.cli.demo_app import PIPELINE
from outbox_relay.runs import pipeline as rs
from outbox_relay.runs.schema import metadata as runs_metadata
from outbox_relay.runs.snapshot import Question
from outbox_relay.runs.store import RunRow, RunStore
from outbox_relay.shared import db
from outbox_relay.shared.errors import OutboxError
from outbox_relay.shared.schema import metadata

RUN = "run-1"
STATUSES = sorted(PIPELINE.statuses)


class RunLifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="runstate-")
        self.engine = db.make_engine(f"sqlite:///{self.dir}/m.db")
        metadata.create_all(self.engine)
        runs_metadata.create_all(self.engine)
        self.store = RunStore(pipeline=PIPELINE)  # a worker's
        self.generic = RunStore()  # the HTTP API's, the sweeper's
        with self.engine.begin() as conn:
            self.generic.create(conn, RUN, {"request": {"ask": True}})
        self.token: str | None = None
        self.high = (0, 1, False)  # position, revision, terminal

    def teardown(self) -> None:
        self.engine.dispose()
        shutil.rmtree(self.dir, ignore_errors=True)

    def row(self) -> RunRow:
        with self.engine.connect() as conn:
            return self.store.get(conn, RUN)

    def attempt(self, write: object) -> None:
        try:
            with self.engine.begin() as conn:
                write(conn)  # type: ignore[operator]
        except OutboxError:
            pass  # refused writes are the point; the invariant checks what did happen

    @rule(status=st.sampled_from(STATUSES), lag=st.integers(0, 2),
          asked_by=st.sampled_from([None, *sorted(PIPELINE.asking)]),
          resume_at=st.sampled_from([None, *STATUSES]), worker=st.booleans())
    def write(self, status: str, lag: int, asked_by: str | None, resume_at: str | None,
              worker: bool) -> None:
        row = self.row()
        record = {**row.record, "asked_by": asked_by, "resume_at": resume_at}
        store = self.store if worker else self.generic
        self.attempt(lambda c: store.compare_and_set(
            c, RUN, row.revision - lag, record, status=status))

    @rule(lag=st.integers(0, 2))
    def lease(self, lag: int) -> None:
        row = self.row()
        token = f"t{row.revision}"

        def go(conn: object) -> None:
            if self.store.lease_for_event(conn, RUN, row.revision - lag,  # type: ignore[arg-type]
                                          token, ttl_ms=60_000).row is not None:
                self.token = token
        self.attempt(go)

    @precondition(lambda self: self.token is not None)
    @rule(ask=st.booleans(), stale=st.booleans())
    def checkpoint(self, ask: bool, stale: bool) -> None:
        row = self.row()
        if stale:
            row = RunRow(row.id, row.revision - 1, row.status, row.record)
        questions = [Question(interaction_id="q1", prompt="?")] if ask else None
        self.attempt(lambda c: self.store.checkpoint(c, row, str(self.token), {"ok": 1},
                                                     questions=questions, ttl_ms=60_000))

    @rule(key=st.sampled_from(["k1", "k2"]), value=st.sampled_from(["yes", "no"]),
          interaction=st.sampled_from(["q1", "q9"]))
    def answer(self, key: str, value: str, interaction: str) -> None:
        self.attempt(lambda c: self.generic.submit_answer(c, RUN, interaction, value, key))

    @rule(max_attempts=st.integers(0, 2))
    def sweep(self, max_attempts: int) -> None:
        row = self.row()
        self.attempt(lambda c: self.generic.resume(c, RUN, row.revision,
                                                   max_attempts=max_attempts, now=2**62))

    @invariant()
    def never_backward(self) -> None:
        row = self.row()
        point = (PIPELINE.rank(row.status, row.record.get("asked_by")), row.revision,
                 row.status in rs.TERMINAL)
        position, revision, terminal = self.high
        assert point[0] >= position, f"moved back to {row.status}"
        assert point[1] >= revision
        assert point[2] or not terminal, "a finished run was reopened"
        if terminal:
            assert point[1] == revision, "a finished run was written"
        self.high = point


RunLifecycle.TestCase.settings = settings(max_examples=40, stateful_step_count=25,
                                          deadline=None)
TestRunLifecycle = RunLifecycle.TestCase
