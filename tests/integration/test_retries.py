"""Retries at the claim (consumer/retry.py): exponential backoff with a durable next attempt
time, a horizon, permanent errors, and strict order held while an event retries. The claim's
clock is given (``now=``), so time is advanced by the test, never slept."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
from sqlalchemy import Connection, Engine, func, select

from outbox_relay.consumer import PermanentError, Retry, inbox
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.schema import consumer_retries
from tests.helpers import create_effects, effect_counts, event, receipts, record_effect

pytestmark = pytest.mark.integration

T0 = 1_800_000_000_000  # the claims' clock, epoch ms
POLICY = Retry(first_delay_s=1, factor=2, cap_s=10, jitter=0, horizon_s=60)


class Downstream:
    """A handler calling a service that is down while ``down`` is set."""

    def __init__(self, engine: Engine) -> None:
        create_effects(engine)
        self.down = True
        self.calls: Counter[str] = Counter()
        self.handlers = Handlers()
        self.handlers.register("thing.happened", self.handle)

    def handle(self, conn: Connection, ev: Event) -> None:
        self.calls[ev.id] += 1
        if self.down:
            raise ConnectionError("the downstream service is down")
        record_effect(conn, ev)


def claim(engine: Engine, events: list[Event], handlers: Handlers, now: int,
          blocked: set[tuple[str, str]] | None = None) -> list[inbox.Outcome]:
    batch = [inbox.Delivery("k:0", f"1-{i}", ev, 1) for i, ev in enumerate(events)]
    return inbox.claim(engine, "g", batch, handlers, retry=POLICY, now=now,
                       blocked=set() if blocked is None else blocked)


def retry_rows(engine: Engine) -> dict[str, tuple[int, int, int, str | None]]:
    r = consumer_retries.c
    with engine.connect() as conn:
        rows = conn.execute(select(r.event_id, r.attempts, r.first_failed_at_ms,
                                   r.next_attempt_at_ms, r.last_error))
        return {i: (n, first, nxt, err) for i, n, first, nxt, err in rows}


def test_a_failure_backs_off_exponentially_and_a_not_due_retry_does_not_run(
    engine: Engine,
) -> None:
    app = Downstream(engine)
    ev = event("a", 1)
    (o,) = claim(engine, [ev], app.handlers, T0)
    assert (o.outcome, o.error, o.attempts, o.retry_at_ms) == (
        inbox.FAILED, "ConnectionError", 1, T0 + 1_000)
    assert retry_rows(engine) == {ev.id: (1, T0, T0 + 1_000, "ConnectionError")}
    # before it is due: waiting, the handler does not run
    (o,) = claim(engine, [ev], app.handlers, T0 + 999)
    assert (o.outcome, o.retry_at_ms) == (inbox.WAITING, T0 + 1_000)
    assert app.calls[ev.id] == 1
    # due: runs, fails again, waits twice as long (then 4 s, 8 s, capped at 10 s)
    waits = []
    now = T0 + 1_000
    for _ in range(5):
        (o,) = claim(engine, [ev], app.handlers, now)
        assert o.outcome == inbox.FAILED and o.retry_at_ms is not None
        waits.append(o.retry_at_ms - now)
        now = o.retry_at_ms
    assert waits == [2_000, 4_000, 8_000, 10_000, 10_000]
    assert retry_rows(engine)[ev.id][:2] == (6, T0)  # attempts; first failure kept
    assert inbox.next_attempt_ms([o]) == now
    app.down = False
    (o,) = claim(engine, [ev], app.handlers, now)
    assert o.outcome == inbox.APPLIED and effect_counts(engine) == {ev.id: 1}
    assert retry_rows(engine) == {}  # settled: the row is gone
    assert receipts(engine, group=None) == {ev.id: ("applied", None)}


def test_the_next_attempt_time_is_durable_across_a_restart(engine: Engine) -> None:
    """A new consumer (a restart, or another owner after a takeover) reads the durable time
    from the database: it does not retry early, and does not reset the attempts."""
    ev = event("a", 1)
    first = Downstream(engine)
    claim(engine, [ev], first.handlers, T0)
    claim(engine, [ev], first.handlers, T0 + 1_000)  # attempt 2: next at T0 + 3 s
    restarted = Downstream.__new__(Downstream)  # a fresh process: nothing in memory
    restarted.down, restarted.calls, restarted.handlers = True, Counter(), Handlers()
    restarted.handlers.register("thing.happened", restarted.handle)
    (o,) = claim(engine, [ev], restarted.handlers, T0 + 2_000)
    assert (o.outcome, o.retry_at_ms, restarted.calls[ev.id]) == (inbox.WAITING, T0 + 3_000, 0)
    (o,) = claim(engine, [ev], restarted.handlers, T0 + 3_000)
    assert (o.outcome, o.attempts, restarted.calls[ev.id]) == (inbox.FAILED, 3, 1)


def test_past_the_horizon_it_is_dead_lettered(engine: Engine) -> None:
    app = Downstream(engine)
    ev = event("a", 1)
    now = T0
    while True:
        (o,) = claim(engine, [ev], app.handlers, now)
        if o.outcome != inbox.FAILED:
            break
        assert o.retry_at_ms is not None
        now = o.retry_at_ms
    assert (o.outcome, o.error) == (inbox.DEAD, inbox.RETRY_HORIZON)
    assert now - T0 >= 60_000 and now - T0 < 70_000  # the first failure 60 s old, not more
    assert receipts(engine, group=None) == {ev.id: ("dead", "retry_horizon")}
    assert retry_rows(engine) == {}


def test_a_permanent_error_dead_letters_at_once(engine: Engine) -> None:
    create_effects(engine)

    def refuse(_conn: Connection, ev: Event) -> None:
        raise PermanentError(f"order {ev.aggregateid} has no customer")

    def bad_value(_conn: Connection, _ev: Event) -> None:
        raise ValueError("not a number")

    handlers = Handlers()
    handlers.register("thing.happened", refuse)
    handlers.register("other.thing", bad_value, retry=Retry(
        permanent=lambda err: isinstance(err, ValueError)))
    a, b = event("a", 1), event("b", 1, type="other.thing")
    outcomes = claim(engine, [a, b], handlers, T0)
    assert [(o.outcome, o.error) for o in outcomes] == [
        (inbox.DEAD, inbox.REJECTED), (inbox.DEAD, inbox.REJECTED)]
    assert outcomes[0].detail == "PermanentError: order a has no customer"
    assert outcomes[1].detail == "ValueError"  # a predicate's error: its name only
    assert receipts(engine, group=None) == {a.id: ("dead", "rejected"), b.id: ("dead", "rejected")}
    assert retry_rows(engine) == {}


def test_a_permanent_error_is_logged_with_its_reason_and_without_a_traceback(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """A PermanentError is the handler's decision (bad input refused on purpose): one WARNING
    line with its reason, no traceback to chase; an unexpected exception keeps its traceback."""
    create_effects(engine)

    def refuse(_conn: Connection, ev: Event) -> None:
        raise PermanentError(f"order {ev.aggregateid} has no customer")

    def crash(_conn: Connection, _ev: Event) -> None:
        raise ZeroDivisionError("division by zero")

    handlers = Handlers()
    handlers.register("thing.happened", refuse)
    handlers.register("other.thing", crash, retry=Retry(
        permanent=lambda err: isinstance(err, ZeroDivisionError)))
    with caplog.at_level(logging.WARNING, logger="outbox_relay.consumer"):
        claim(engine, [event("a", 1), event("b", 1, type="other.thing")], handlers, T0)
    [refused] = [r for r in caplog.records if "thing.happened" in r.getMessage()]
    [crashed] = [r for r in caplog.records if "other.thing" in r.getMessage()]
    assert "PermanentError: order a has no customer; dead-lettered (rejected)" in (
        refused.getMessage())
    assert refused.exc_info is None and refused.levelno == logging.WARNING
    assert crashed.exc_info is not None and crashed.exc_info[0] is ZeroDivisionError


def test_a_handler_policy_overrides_the_group_default(engine: Engine) -> None:
    app = Downstream(engine)
    quick = Retry(first_delay_s=0.05, cap_s=0.05, jitter=0, horizon_s=3600)
    app.handlers.register("other.thing", app.handle, retry=quick)
    a, b = event("a", 1), event("b", 1, type="other.thing")
    outcomes = claim(engine, [a, b], app.handlers, T0)
    assert [o.retry_at_ms for o in outcomes] == [T0 + 1_000, T0 + 50]
    assert inbox.next_attempt_ms(outcomes) == T0 + 50


def test_while_a_strict_event_retries_its_aggregate_waits_and_others_flow(
    engine: Engine,
) -> None:
    app = Downstream(engine)
    app.down = False
    bad1, bad2, other = event("bad", 1), event("bad", 2), event("ok", 1)
    fail_only = {bad1.id}
    original = app.handle

    def handle(conn: Connection, ev: Event) -> None:
        app.down = ev.id in fail_only
        original(conn, ev)

    handlers = Handlers()
    handlers.register("thing.happened", handle)
    blocked: set[tuple[str, str]] = set()
    outcomes = claim(engine, [bad1, bad2, other], handlers, T0, blocked)
    assert [o.outcome for o in outcomes] == [inbox.FAILED, inbox.WAITING, inbox.APPLIED]
    assert blocked == {("thing", "bad")}
    # the next pass, not due yet: the failing one waits without running, rev 2 behind it
    blocked = set()
    outcomes = claim(engine, [bad1, bad2], handlers, T0 + 500, blocked)
    assert [o.outcome for o in outcomes] == [inbox.WAITING, inbox.WAITING]
    assert blocked == {("thing", "bad")} and app.calls[bad1.id] == 1 and app.calls[bad2.id] == 0
    fail_only.clear()
    outcomes = claim(engine, [bad1, bad2], handlers, T0 + 1_000, set())
    assert [o.outcome for o in outcomes] == [inbox.APPLIED, inbox.APPLIED]
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(consumer_retries)).scalar() == 0


def test_without_a_policy_a_failure_has_no_durable_time(engine: Engine) -> None:
    """Dead-letter replay claims without a group policy: a failing handler leaves no retry
    row (the letter stays the record)."""
    app = Downstream(engine)
    (o,) = inbox.claim(engine, "g", [inbox.Delivery("k:0", "1-0", event("a", 1), 1)],
                       app.handlers, now=T0)
    assert (o.outcome, o.retry_at_ms) == (inbox.FAILED, None) and retry_rows(engine) == {}
