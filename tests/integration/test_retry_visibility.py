"""Retries are visible while they wait (issue 22; design invariant 9: "the lag and the retrying
entries are visible meanwhile"), on both databases and real Redis.

A handler fails while its downstream is down: ``outbox status`` (text and ``--json``) shows
per group how many entries wait for a retry, how old the oldest first failure is and when the
next attempt is due (overdue when no consumer runs); the consumer's registry counts the
retries by type and error and exports the retrying entries and the age of the oldest per
owned stream. Once the downstream is back and everything is applied, both say nothing waits.
"""

from __future__ import annotations

import json
import time

import pytest
import redis
from prometheus_client import CollectorRegistry
from sqlalchemy import Connection, Engine, insert, select, update

from outbox_relay.cli import main as cli
from outbox_relay.cli import status
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.consumer.metrics import ConsumerMetrics
from outbox_relay.relay.daemon import Relay
from outbox_relay.shared import db
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.schema import consumer_retries, inbox
from tests.conftest import REDIS_URL
from tests.helpers import (
    GROUP,
    PARTITIONS,
    consumer_settings,
    enqueue_events,
    free_port,
    pending_total,
    record_effect,
    relay_settings,
    wait_until,
)

pytestmark = pytest.mark.integration

EVENTS, AGGREGATES = 24, 6
TYPE = "thing.happened"


class Downstream:
    """What the handler calls: raises ``ConnectionError`` while down."""

    def __init__(self) -> None:
        self.down = True

    def handle(self, conn: Connection, ev: Event) -> None:
        if self.down:
            raise ConnectionError("the downstream service is down")
        record_effect(conn, ev)


def failing_consumer(
    engine: Engine, client: redis.Redis, prefix: str, downstream: Downstream
) -> Consumer:
    """A consumer whose first retry is 30 s away (so the rows stay put while we look)."""
    handlers = Handlers()
    handlers.register(TYPE, downstream.handle)
    settings = consumer_settings(prefix, max_deliveries=0, retry_first_delay_s=30,
                                 retry_max_delay_s=60, retry_horizon=3600)
    return Consumer(settings, engine, client, handlers)


def fail_every_aggregate(engine: Engine, client: redis.Redis, consumer: Consumer,
                         prefix: str) -> None:
    """Deliver the events and run the consumer until each aggregate's first event failed
    once (one retry row each; the later events wait behind it)."""
    enqueue_events(engine, EVENTS, aggregates=AGGREGATES)
    Relay(relay_settings(prefix), engine, client).run(until_idle=True)
    wait_until(lambda: consumer.run_once(block_ms=1) >= 0
               and consumer.stats.retried >= AGGREGATES, what="a failure per aggregate")
    assert consumer.stats.retried == AGGREGATES and consumer.stats.dead == 0


def heal(consumer: Consumer, downstream: Downstream, engine: Engine,
         client: redis.Redis, prefix: str) -> None:
    """The downstream is back and the retries are due: everything is applied."""
    downstream.down = False
    with engine.begin() as conn:
        conn.execute(update(consumer_retries).values(next_attempt_at_ms=0))
    wait_until(lambda: consumer.run_once(block_ms=1) >= 0
               and consumer.stats.applied == EVENTS and pending_total(client, prefix) == 0,
               what="everything applied")


def test_status_shows_the_entries_waiting_for_a_retry(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str, database_url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    engine, downstream = effects_engine, Downstream()
    consumer = failing_consumer(engine, redis_client, key_prefix, downstream)
    before = time.time()
    fail_every_aggregate(engine, redis_client, consumer, key_prefix)
    time.sleep(0.2)  # the oldest first failure is measurably old

    [group] = status.collect(engine, redis_client, key_prefix)["retries"]
    assert group["group"] == GROUP and group["entries"] == AGGREGATES
    assert group["errors"] == {"ConnectionError": AGGREGATES}
    assert group["max_attempts"] == 1
    assert 0.2 <= group["oldest_first_failure_age_s"] <= time.time() - before + 1
    assert 30 * 0.8 - 5 <= group["next_attempt_in_s"] <= 30 * 1.2  # the policy's jitter
    assert sum(group["streams"].values()) == AGGREGATES
    assert set(group["streams"]) <= {f"{key_prefix}:{{runs:{p}}}" for p in range(PARTITIONS)}

    flags = ["--database-url", database_url, "--redis-url", REDIS_URL,
             "--key-prefix", key_prefix]
    assert cli.main(["status", "--json", *flags]) == 0
    [shown] = json.loads(capsys.readouterr().out)["retries"]
    assert shown["entries"] == AGGREGATES and shown["next_attempt_in_s"] > 0
    assert cli.main(["status", *flags]) == 0
    text = capsys.readouterr().out
    assert f"  {GROUP}: {AGGREGATES} entries, oldest first failure " in text
    assert "next attempt in " in text and f"(ConnectionError {AGGREGATES})" in text

    # No consumer running past the due time: the next attempt is overdue, and says so.
    with engine.begin() as conn:
        conn.execute(update(consumer_retries).values(
            next_attempt_at_ms=int(time.time() * 1000) - 5_000))
    [late] = status.collect(engine, redis_client, key_prefix)["retries"]
    assert late["next_attempt_in_s"] <= -5
    assert "next attempt overdue by " in status.render(
        status.collect(engine, redis_client, key_prefix))

    heal(consumer, downstream, engine, redis_client, key_prefix)
    report = status.collect(engine, redis_client, key_prefix)
    assert report["retries"] == []
    assert "retrying: none" in status.render(report)


def samples(registry: CollectorRegistry, name: str) -> list[tuple[dict[str, str], float]]:
    return [(dict(s.labels), s.value) for family in registry.collect()
            for s in family.samples if s.name == name]


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return sum(v for lab, v in samples(registry, name)
               if all(lab.get(k) == want for k, want in labels.items()))


def test_metrics_count_retries_and_show_the_oldest_retrying_entry(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    engine, downstream = effects_engine, Downstream()
    consumer = failing_consumer(engine, redis_client, key_prefix, downstream)
    metrics = ConsumerMetrics(consumer)
    consumer.metrics = metrics
    reg = metrics.registry
    # Before anything failed: every owned stream reports 0 (the series exist for alerts).
    assert [v for _, v in samples(reg, "outbox_consumer_retrying_entries")] == [0] * PARTITIONS
    assert value(reg, "outbox_consumer_oldest_retry_age_seconds") == 0

    fail_every_aggregate(engine, redis_client, consumer, key_prefix)
    time.sleep(0.3)
    assert value(reg, "outbox_consumer_retries_total", group=GROUP, type=TYPE,
                 reason="ConnectionError") == AGGREGATES
    assert value(reg, "outbox_consumer_retrying_entries", group=GROUP) == AGGREGATES
    ages = [v for _, v in samples(reg, "outbox_consumer_oldest_retry_age_seconds")]
    assert max(ages) >= 0.3 and len(ages) == PARTITIONS
    assert {lab["partition"] for lab, _ in samples(reg, "outbox_consumer_retrying_entries")} \
        == {str(p) for p in range(PARTITIONS)}
    assert value(reg, "outbox_consumer_scrape_up", source="database") == 1
    assert value(reg, "outbox_consumer_scrape_up", source="redis") == 1
    # the plain stats counter is exported in its labelled form only
    assert samples(reg, "outbox_consumer_retried_total") == []

    heal(consumer, downstream, engine, redis_client, key_prefix)
    assert value(reg, "outbox_consumer_retries_total") == AGGREGATES  # no new failure
    assert value(reg, "outbox_consumer_retrying_entries") == 0
    assert value(reg, "outbox_consumer_oldest_retry_age_seconds") == 0


def test_retry_gauges_say_the_database_is_unreachable(
    sqlite_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A scrape whose retry query fails leaves those gauges out and says so
    (``scrape_up{source="database"} 0``); the Redis gauges are still there."""
    consumer = failing_consumer(sqlite_engine, redis_client, key_prefix, Downstream())
    reg = ConsumerMetrics(consumer).registry
    assert value(reg, "outbox_consumer_scrape_up", source="database") == 1
    consumer.engine = db.make_engine(  # nobody listens there: connection refused
        f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test")
    assert samples(reg, "outbox_consumer_retrying_entries") == []
    assert value(reg, "outbox_consumer_scrape_up", source="database") == 0
    assert value(reg, "outbox_consumer_scrape_up", source="redis") == 1


def test_a_retrying_entry_settled_outside_the_claim_is_not_shown(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """An entry that vanished from its stream while it was retrying gets a ``lost`` receipt
    (consumer/lost.py) and leaves its retry row behind: neither ``outbox status`` nor the
    gauges count it as retrying (it would look stuck, and alert, for ever)."""
    engine = effects_engine
    consumer = failing_consumer(engine, redis_client, key_prefix, Downstream())
    reg = ConsumerMetrics(consumer).registry
    fail_every_aggregate(engine, redis_client, consumer, key_prefix)
    with engine.begin() as conn:
        row = conn.execute(select(consumer_retries).limit(1)).one()
        conn.execute(insert(inbox).values(
            group_name=GROUP, event_id=row.event_id, stream_key=row.stream_key,
            entry_id=row.entry_id, outcome="lost", reason="vanished", created_at_ms=0))
    [group] = status.collect(engine, redis_client, key_prefix)["retries"]
    assert group["entries"] == AGGREGATES - 1
    assert value(reg, "outbox_consumer_retrying_entries") == AGGREGATES - 1
