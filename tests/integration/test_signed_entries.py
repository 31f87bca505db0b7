"""Authenticated entries (shared/signing.py) on the real Redis and both databases: with a
signing key, the relay signs every entry (appends and repairs) and a consumer dead-letters an
unsigned or forged one as ``bad_signature`` without a receipt, so the real event under the
forged id still applies (issue 22, finding 2)."""

from __future__ import annotations

import pytest
import redis
from sqlalchemy import Connection, Engine, select

from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.producer import Producer
from outbox_relay.relay.daemon import Relay
from outbox_relay.shared import keys
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.schema import inbox as inbox_table
from outbox_relay.shared.signing import Signer
from tests.helpers import (
    PARTITIONS,
    STREAM,
    consumer_settings,
    dead_letters,
    partition_of,
    pending_total,
    relay_settings,
    wait_until,
)

pytestmark = pytest.mark.integration

KEY = "signing-key-of-the-test-0001"


def place(engine: Engine, aggregate: str, total: int) -> str:
    producer = Producer(source="shop", partitions=PARTITIONS)
    with engine.begin() as conn:
        return producer.enqueue(conn, type="order.placed", stream=STREAM, data={"total": total},
                                aggregate_type="order", aggregate_id=aggregate, revision=1)


def deliver(engine: Engine, client: redis.Redis, prefix: str) -> None:
    Relay(relay_settings(prefix, signing_key=KEY), engine, client).run(until_idle=True)


def test_a_forged_entry_is_dead_lettered_and_the_real_event_applies(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    totals: dict[str, int] = {}

    def invoice(_conn: Connection, ev: Event) -> None:
        totals[ev.id] = ev.data["total"]

    handlers = Handlers()
    handlers.register("order.placed", invoice)
    consumer = Consumer(consumer_settings(key_prefix, signing_key=KEY), engine, redis_client,
                        handlers)
    place(engine, "o-1", 10)
    deliver(engine, redis_client, key_prefix)
    # A client that may XADD to the partition stream adds an entry under an id the producer
    # has not used yet: unsigned, and once more signed with a key the consumer does not have.
    forged = {"specversion": "1.0", "id": "o-3:order.placed:1", "source": "evil",
              "type": "order.placed", "time": "2026-01-01T00:00:00Z",
              "datacontenttype": "application/json", "data": '{"total":333}',
              "aggregatetype": "order", "aggregateid": "o-3", "revision": "1"}
    other_key = Signer.from_setting("not-the-relay-key-000")
    assert other_key is not None
    stream = keys.stream_key(key_prefix, STREAM, partition_of("o-3"))
    redis_client.xadd(stream, forged)  # type: ignore[arg-type]
    redis_client.xadd(stream, other_key.signed(forged))  # type: ignore[arg-type]
    wait_until(lambda: consumer.run_once() >= 0 and consumer.stats.invalid == 2
               and totals, what="the forged entries dead-lettered")
    assert totals == {"o-1:order.placed:1": 10}

    real = place(engine, "o-3", 30)
    assert real == forged["id"]
    deliver(engine, redis_client, key_prefix)
    wait_until(lambda: consumer.run_once() >= 0 and real in totals, what="the real event")
    assert totals[real] == 30
    assert pending_total(redis_client, key_prefix) == 0
    reasons = [f[b"dlq.reason"] for f in dead_letters(redis_client, key_prefix,
                                                       partition_of("o-3"))]
    assert reasons == [b"bad_signature", b"bad_signature"]
    with engine.connect() as conn:
        rows = conn.execute(select(inbox_table.c.event_id, inbox_table.c.outcome)).all()
    assert sorted(rows) == [("o-1:order.placed:1", "applied"), (real, "applied")]


def test_relay_signs_appends_and_repairs(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    signer = Signer.from_setting(KEY)
    assert signer is not None
    place(engine, "a", 1)
    deliver(engine, redis_client, key_prefix)
    stream = keys.stream_key(key_prefix, STREAM, partition_of("a"))
    ((_id, fields),) = redis_client.xrange(stream)
    assert b"signature" in fields and signer.verify(fields)
    redis_client.delete(stream)  # Redis "loses" the stream: the relay's repair refills it
    deliver(engine, redis_client, key_prefix)
    ((_id, refilled),) = redis_client.xrange(stream)
    assert refilled == fields and signer.verify(refilled)
