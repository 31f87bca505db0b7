"""A downstream outage, compressed (issue 22, finding 1): a handler raises while the service
it calls is down; with the retry policy (short delays here, a horizon of an hour) the consumer
waits it out and then applies everything exactly once, in revision order per aggregate, with
no dead letter, while the retrying entries are visible in the database meanwhile. On today's
code (5 deliveries, then ``max_deliveries``) a long enough outage dead-lettered a fifth of
the traffic."""

from __future__ import annotations

from collections import defaultdict

import pytest
import redis
from sqlalchemy import Connection, Engine, func, select

from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.relay.daemon import Relay
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.schema import consumer_retries
from tests.helpers import (
    PARTITIONS,
    consumer_settings,
    dead_letters,
    enqueue_events,
    pending_total,
    relay_settings,
    wait_until,
)

pytestmark = pytest.mark.integration

EVENTS, AGGREGATES = 90, 30


def retrying(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(consumer_retries)).scalar_one())


def test_an_outage_is_waited_out_with_nothing_dead_and_order_kept(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    down = True
    applied: dict[str, list[int]] = defaultdict(list)
    calls = 0

    def handle(_conn: Connection, ev: Event) -> None:
        nonlocal calls
        calls += 1
        if down:
            raise ConnectionError("the downstream service is down")
        assert ev.aggregateid is not None and ev.revision is not None
        applied[ev.aggregateid].append(ev.revision)

    handlers = Handlers()
    handlers.register("thing.happened", handle)
    # the defaults of the group: max_deliveries off, a generous horizon; short delays here
    settings = consumer_settings(key_prefix, max_deliveries=0, retry_first_delay_s=0.02,
                                 retry_max_delay_s=0.1, retry_horizon=3600,
                                 claim_interval_ms=100)
    consumer = Consumer(settings, engine, redis_client, handlers)
    enqueue_events(engine, EVENTS, aggregates=AGGREGATES)
    Relay(relay_settings(key_prefix), engine, redis_client).run(until_idle=True)

    def step() -> bool:
        consumer.run_once(block_ms=1)
        return True

    # the outage: every aggregate's first event fails again and again (many more attempts
    # than the old max_deliveries of 5), the later ones wait behind it
    wait_until(lambda: step() and consumer.stats.retried >= 8 * AGGREGATES,
               timeout=60, what="the outage's retries")
    assert retrying(engine) == AGGREGATES  # one retry row per blocked aggregate's first event
    assert not applied and consumer.stats.dead == 0
    down = False
    wait_until(lambda: step() and sum(map(len, applied.values())) == EVENTS
               and pending_total(redis_client, key_prefix) == 0, timeout=60,
               what="everything applied after the outage")
    assert all(revs == sorted(revs) == list(range(1, len(revs) + 1))
               for revs in applied.values()), applied
    assert consumer.stats.dead == 0 and retrying(engine) == 0
    assert all(dead_letters(redis_client, key_prefix, p) == [] for p in range(PARTITIONS))
