"""Batch handlers (``Handlers.on_batch``): one call per claim for a type's events, the inbox
still records each event, and a raising batch falls back to one call per event so the failing
event is isolated (consumer/handlers.py, consumer/ordering.py). Both databases."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
from sqlalchemy import Connection, Engine, insert

from outbox_relay.consumer import inbox
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.consumer.retry import PermanentError, Retry
from outbox_relay.shared.envelope import Event
from tests.helpers import (
    consumer_settings,
    create_effects,
    deliveries,
    effect_counts,
    effects,
    event,
    pending_total,
    receipt_outcomes,
    record_effect,
    wait_until,
    xadd_event,
)

pytestmark = pytest.mark.integration




class BatchRecorder:
    """A batch handler writing every event with ONE multi-row insert; ``fails(event)`` makes
    a call holding that event raise (the failing event, whatever the batch around it)."""

    def __init__(self, fails: Callable[[Event], BaseException | None] = lambda _e: None) -> None:
        self.calls: list[list[str]] = []
        self.fails = fails

    def __call__(self, conn: Connection, events: list[Event]) -> None:
        self.calls.append([ev.id for ev in events])
        conn.execute(insert(effects), [{"event_id": ev.id, "note": "batch"} for ev in events])
        for ev in events:
            err = self.fails(ev)
            if err is not None:
                raise err


def test_a_batch_handler_gets_the_claims_events_in_one_call(engine: Engine) -> None:
    create_effects(engine)
    recorder = BatchRecorder()
    handlers = Handlers()
    handlers.register_batch("thing.happened", recorder)
    events = [event(f"a{i % 3}", i // 3 + 1) for i in range(9)]  # 3 aggregates, revisions 1..3
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [o.outcome for o in outcomes] == [inbox.APPLIED] * 9
    assert recorder.calls == [[ev.id for ev in events]]  # one call, in stream order
    assert effect_counts(engine) == {ev.id: 1 for ev in events}
    assert receipt_outcomes(engine) == {ev.id: inbox.APPLIED for ev in events}


def test_a_raising_batch_falls_back_to_one_call_per_event(engine: Engine) -> None:
    create_effects(engine)
    events = [event(f"b{i}", 1) for i in range(4)]
    bad = events[2].id
    recorder = BatchRecorder(lambda ev: RuntimeError("down") if ev.id == bad else None)
    handlers = Handlers()
    handlers.register_batch("thing.happened", recorder)
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [o.outcome for o in outcomes] == [inbox.APPLIED, inbox.APPLIED, inbox.FAILED,
                                             inbox.APPLIED]
    # The whole batch first, then one call per event: the failing one is isolated.
    assert recorder.calls == [[ev.id for ev in events]] + [[ev.id] for ev in events]
    assert effect_counts(engine) == {ev.id: 1 for ev in events if ev.id != bad}
    assert bad not in receipt_outcomes(engine)  # no receipt: it is retried


def test_a_failing_event_holds_back_its_aggregates_later_events_only(engine: Engine) -> None:
    create_effects(engine)
    events = [event("c1", 1), event("c2", 1), event("c1", 2), event("c2", 2)]
    recorder = BatchRecorder(lambda ev: RuntimeError("x") if ev.id == events[0].id else None)
    handlers = Handlers()
    handlers.register_batch("thing.happened", recorder)  # strict by default
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [o.outcome for o in outcomes] == [inbox.FAILED, inbox.APPLIED, inbox.WAITING,
                                             inbox.APPLIED]
    assert effect_counts(engine) == {events[1].id: 1, events[3].id: 1}


def test_a_permanent_error_in_a_batch_dead_letters_that_event_alone(engine: Engine) -> None:
    create_effects(engine)
    events = [event(f"d{i}", 1) for i in range(3)]
    bad = events[1].id
    recorder = BatchRecorder(lambda ev: PermanentError("refused") if ev.id == bad else None)
    handlers = Handlers()
    handlers.register_batch("thing.happened", recorder)
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers, retry=Retry())
    assert [(o.outcome, o.error) for o in outcomes] == [
        (inbox.APPLIED, None), (inbox.DEAD, "rejected"), (inbox.APPLIED, None)]
    assert effect_counts(engine) == {events[0].id: 1, events[2].id: 1}


def test_duplicates_and_stale_events_never_reach_the_batch(engine: Engine) -> None:
    create_effects(engine)
    recorder = BatchRecorder()
    handlers = Handlers()
    handlers.register_batch("thing.happened", recorder)
    first = [event("e1", 2), event("e2", 1)]
    inbox.claim(engine, "g", deliveries(first), handlers)
    again = [event("e1", 2), event("e1", 1), event("e2", 2)]  # duplicate, out of order, new
    outcomes = inbox.claim(engine, "g", deliveries(again), handlers)
    assert [(o.outcome, o.error) for o in outcomes] == [
        (inbox.DUPLICATE, None), (inbox.DEAD, inbox.OUT_OF_ORDER), (inbox.APPLIED, None)]
    assert recorder.calls[-1] == [again[2].id]


def test_an_aggregates_writes_keep_revision_order_across_handlers(engine: Engine) -> None:
    """A per-event handler of another type for an aggregate with events waiting in a batch
    call runs after that call: the aggregate's writes stay in revision order."""
    create_effects(engine)
    written: list[str] = []
    handlers = Handlers()

    @handlers.on_batch("thing.happened")
    def batch(conn: Connection, events: list[Event]) -> None:
        written.extend(ev.id for ev in events)
        for ev in events:
            record_effect(conn, ev)

    @handlers.on("thing.changed")
    def single(conn: Connection, ev: Event) -> None:
        written.append(ev.id)
        record_effect(conn, ev)

    events = [event("f1", 1), event("f2", 1), event("f1", 2, type="thing.changed"),
              event("f1", 3), event("f3", 1, type="thing.changed")]
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [o.outcome for o in outcomes] == [inbox.APPLIED] * 5
    order = [ev.id for ev in events if ev.aggregateid == "f1"]
    assert [i for i in written if i.startswith("f1:")] == order
    assert effect_counts(engine) == {ev.id: 1 for ev in events}


def test_the_consumer_daemon_applies_a_stream_with_a_batch_handler(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """End to end through the daemon: every event applied once, one receipt each, a
    transient failure retried alone (first call of one event fails, then succeeds)."""
    create_effects(engine)
    failed_once: set[str] = set()
    events = [event(f"g{i % 5}", i // 5 + 1) for i in range(40)]
    flaky = events[7].id

    def fails(ev: Event) -> BaseException | None:
        if ev.id == flaky and flaky not in failed_once:
            failed_once.add(flaky)
            return RuntimeError("downstream blinked")
        return None

    recorder = BatchRecorder(fails)
    handlers = Handlers()
    handlers.register_batch("thing.happened", recorder)
    settings = consumer_settings(key_prefix, retry_first_delay_s=0.05, retry_max_delay_s=0.05,
                                 retry_jitter=0.0)
    consumer = Consumer(settings, engine, redis_client, handlers)
    for ev in events:
        xadd_event(redis_client, key_prefix, ev)
    wait_until(lambda: consumer.run_once() >= 0 and len(receipt_outcomes(engine)) == len(events),
               what="every event applied")
    assert effect_counts(engine) == {ev.id: 1 for ev in events}
    assert set(receipt_outcomes(engine).values()) == {inbox.APPLIED}
    assert any(len(call) > 1 for call in recorder.calls)  # batches, not single calls
    wait_until(lambda: consumer.run_once() >= 0
               and pending_total(redis_client, key_prefix) == 0, what="all acknowledged")
