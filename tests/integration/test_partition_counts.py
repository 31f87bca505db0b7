"""A component configured with another partition count than a stream's first writer is refused
(it would strand events in silence)."""

from __future__ import annotations

import pytest
import redis
from sqlalchemy import Engine, select

from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.producer import Producer
from outbox_relay.relay.daemon import Relay
from outbox_relay.shared.errors import ConfigError
from outbox_relay.shared.schema import outbox, streams
from outbox_relay.shared.settings import ConsumerSettings, RelaySettings
from tests.conftest import REDIS_URL

pytestmark = pytest.mark.integration


def enqueue_one(engine: Engine, producer: Producer, stream: str, n: int) -> None:
    with engine.begin() as conn:
        producer.enqueue(conn, type="thing.done", stream=stream, data={"n": n},
                         aggregate_type="thing", aggregate_id=f"a{n}", revision=1)


def test_the_first_write_records_the_count_and_a_mismatch_is_refused_everywhere(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    stream = f"pc{key_prefix[-6:]}"
    eight = Producer(source="t", partitions=8, key_prefix=key_prefix)
    enqueue_one(engine, eight, stream, 1)
    with engine.connect() as conn:
        assert conn.execute(select(streams.c.partitions)
                            .where(streams.c.stream == stream)).scalar_one() == 8

    four = Producer(source="t", partitions=4, key_prefix=key_prefix)
    with pytest.raises(ConfigError) as caught:
        enqueue_one(engine, four, stream, 2)
    assert caught.value.code == "invalid_config"
    assert f"OUTBOX_PARTITIONS=4, but the database records {stream} has 8" in caught.value.message
    with engine.connect() as conn:  # the refused event's transaction wrote nothing
        written = conn.execute(select(outbox.c.event_id)
                               .where(outbox.c.stream == stream)).scalars().all()
    assert written == ["a1:thing.done:1"]

    url = engine.url.render_as_string(hide_password=False)
    relay = Relay(RelaySettings(database_url=url, redis_url=REDIS_URL, key_prefix=key_prefix,
                                partitions=4, node_id="pc"), engine, redis_client)
    with pytest.raises(ConfigError, match="this relay is configured with OUTBOX_PARTITIONS=4"):
        relay.run(until_idle=True)
    consumer = Consumer(ConsumerSettings(database_url=url, redis_url=REDIS_URL,
                                         key_prefix=key_prefix, partitions=4, streams=stream,
                                         group="g", consumer="c"),
                        engine, redis_client, Handlers())
    with pytest.raises(ConfigError, match="this consumer is configured"):
        consumer.run_once()
    # The right count runs (and another stream, with its own count, does not disturb it).
    enqueue_one(engine, eight, stream, 3)
    Relay(RelaySettings(database_url=url, redis_url=REDIS_URL, key_prefix=key_prefix,
                        partitions=8, node_id="pc8"), engine, redis_client).run(until_idle=True)
