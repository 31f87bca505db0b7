"""The run store on both databases: compare-and-set races, answers, leases and the sweep."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import Engine, func, select

from outbox_relay.cli import demo_app as jobs
from outbox_relay.runs import pipeline as rs
from outbox_relay.runs.snapshot import Question
from outbox_relay.runs.store import AnswerResult, RunRow, RunStore, fingerprint
from outbox_relay.runs.sweeper import sweep
from outbox_relay.shared.errors import ConflictError, LeaseLostError, OutboxError
from outbox_relay.shared.schema import outbox

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("runs_tables")]
STORE = RunStore(pipeline=jobs.PIPELINE)
TTL = 60_000


def events(engine: Engine, kind: str | None = None) -> int:
    query = select(func.count()).select_from(outbox)
    if kind is not None:
        query = query.where(outbox.c.type == kind)
    with engine.connect() as conn:
        return int(conn.execute(query).scalar_one())


def create(engine: Engine, run_id: str = "r1") -> RunRow:
    with engine.begin() as conn:
        return STORE.create(conn, run_id, {"request": {"ask": True}})


def get(engine: Engine, run_id: str = "r1") -> RunRow:
    with engine.connect() as conn:
        return STORE.get(conn, run_id)


def claim(engine: Engine, row: RunRow, token: str, *, now: int | None = None) -> RunRow | None:
    with engine.begin() as conn:
        return STORE.lease_for_event(conn, row.id, row.revision, token, ttl_ms=TTL, now=now).row


def waiting_for_answer(engine: Engine) -> RunRow:
    """A run stopped at needs_input with question ``q1`` (asked by normalizing_candidate)."""
    row = claim(engine, create(engine), "w1")
    assert row is not None
    with engine.begin() as conn:
        row = STORE.checkpoint(conn, row, "w1", {"a": 1}, ttl_ms=TTL)
        return STORE.checkpoint(conn, row, "w1", {"b": 2}, ttl_ms=TTL,
                                questions=[Question(interaction_id="q1", prompt="ok?")])


def answer(engine: Engine, value: str, key: str, interaction: str = "q1") -> AnswerResult:
    with engine.begin() as conn:
        return STORE.submit_answer(conn, "r1", interaction, value, key)


def test_concurrent_compare_and_set_one_wins(engine: Engine) -> None:
    row = create(engine)
    barrier = threading.Barrier(2)
    results: list[str] = []

    def write(name: str) -> None:
        barrier.wait()
        try:
            with engine.begin() as conn:
                STORE.compare_and_set(conn, "r1", row.revision, {**row.record, "by": name},
                                      status=jobs.INGESTING_INPUTS)
            results.append("won")
        except ConflictError:
            results.append("conflict")

    threads = [threading.Thread(target=write, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["conflict", "won"]
    assert get(engine).revision == row.revision + 1


def test_answer_is_idempotent_per_key(engine: Engine) -> None:
    waiting = waiting_for_answer(engine)
    assert waiting.status == rs.NEEDS_INPUT and events(engine, "run.needs_input") == 1
    first = answer(engine, "yes", "key-1")
    after_first = get(engine)
    count = events(engine)
    assert after_first.status == jobs.ANALYZING_JD  # the stage after the one that asked
    assert after_first.record["receipts"]["key-1"]["fingerprint"] == fingerprint("q1", "yes")

    again = answer(engine, "yes", "key-1")
    assert again.replayed is True and first.replayed is False
    assert get(engine) == after_first and events(engine) == count  # nothing written

    with pytest.raises(OutboxError) as conflict:
        answer(engine, "no", "key-1")
    assert conflict.value.code == "idempotency_conflict"
    with pytest.raises(OutboxError) as twice:
        answer(engine, "no", "key-2")
    assert twice.value.code == "already_answered"
    with pytest.raises(OutboxError) as unknown:
        answer(engine, "yes", "key-3", interaction="q-never-asked")
    assert unknown.value.code == "unknown_interaction"
    assert get(engine) == after_first and events(engine, "run.answered") == 1


def test_expired_lease_is_taken_over_and_the_old_owner_cannot_write(engine: Engine) -> None:
    row = claim(engine, create(engine), "old", now=1_000)
    assert row is not None and row.lease_expires_at_ms == 1_000 + TTL
    stats = sweep(engine, STORE, max_attempts=3, now=1_000 + TTL + 1)
    assert (stats.resumed, stats.failed) == (1, 0)
    resumed = get(engine)
    assert resumed.attempts == 1 and resumed.lease_owner is None
    assert resumed.status == jobs.INGESTING_INPUTS and events(engine, "run.resume") == 1

    taken = claim(engine, resumed, "new")  # the run.resume event's revision is current
    assert taken is not None and taken.lease_owner == "new"
    with pytest.raises(LeaseLostError), engine.begin() as conn:
        STORE.checkpoint(conn, row, "old", {"late": True}, ttl_ms=TTL)
    with engine.begin() as conn:
        assert STORE.heartbeat(conn, ["old", "new"], ttl_ms=TTL) == {"new"}
        done = STORE.checkpoint(conn, taken, "new", {"ok": 1}, ttl_ms=TTL)
    assert done.status == jobs.NORMALIZING_CANDIDATE and done.record["checkpoint"] == {
        jobs.INGESTING_INPUTS: {"ok": 1}}


def test_live_lease_is_not_swept_and_stale_leases_are_skipped(engine: Engine) -> None:
    created = create(engine)
    row = claim(engine, created, "w", now=1_000)
    assert row is not None
    assert sweep(engine, STORE, max_attempts=3, now=1_000 + TTL - 1).resumed == 0
    with engine.begin() as conn:
        assert STORE.lease_for_event(conn, "r1", created.revision, "x",
                                     ttl_ms=TTL).skipped == "stale"
        assert STORE.lease_for_event(conn, "r1", row.revision, "x", ttl_ms=TTL,
                                     now=1_001).skipped == "leased"


def test_attempts_exhausted_fails_the_run(engine: Engine) -> None:
    row = create(engine)
    for attempt in range(3):
        leased = claim(engine, row, f"w{attempt}", now=1_000)
        assert leased is not None
        sweep(engine, STORE, max_attempts=2, now=10**12)
        row = get(engine)
    assert row.status == rs.FAILED and row.record["error"] == "attempts_exhausted"
    assert STORE.snapshot(row).error == "attempts_exhausted"
    assert events(engine, "run.resume") == 2 and events(engine, "run.failed") == 1


def test_a_new_run_cannot_set_what_the_store_keeps(engine: Engine) -> None:
    """A creator that passes a status, a resume_at or an answer would start the run elsewhere
    than at the beginning: refused, nothing written."""
    for field in ("status", "resume_at", "answers", "checkpoint"):
        with pytest.raises(OutboxError) as info, engine.begin() as conn:
            RunStore().create(conn, f"r-{field}", {"request": {}, field: "completed"})
        assert info.value.code == "invalid_request" and field in info.value.message
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(outbox)).scalar() == 0


def test_workers_and_sweepers_on_hosts_an_hour_apart_judge_leases_by_the_database_clock(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker on a host an hour behind leases and heartbeats a run; a sweeper on a host an
    hour ahead must not see that live lease as expired (by host clocks it would resume a run
    whose worker is alive, two hours "late"), and a sweep after the lease really lapsed (by the
    database's clock) still resumes it."""
    real_time, real_ns = time.time, time.time_ns

    def on_host(skew_s: float) -> None:
        monkeypatch.setattr(time, "time", lambda: real_time() + skew_s)
        monkeypatch.setattr(time, "time_ns", lambda: real_ns() + int(skew_s * 1e9))

    on_host(-3600)
    row = claim(engine, create(engine), "w")
    assert row is not None
    with engine.begin() as conn:
        assert STORE.heartbeat(conn, ["w"], ttl_ms=TTL) == {"w"}
    on_host(+3600)
    assert sweep(engine, STORE, max_attempts=3).resumed == 0
    assert get(engine).lease_owner == "w"
    with engine.begin() as conn:
        STORE.release(conn, ["w"])  # the worker stops: its lease lapses now
    assert sweep(engine, STORE, max_attempts=3).resumed == 1
