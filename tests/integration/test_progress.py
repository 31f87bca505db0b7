"""The daemons' periodic progress line (issue 26, finding 4; shared/progress.py): what was
done since the previous line, the total, and what still waits. Both databases, real Redis."""

from __future__ import annotations

import logging
from functools import partial

import pytest
import redis
from sqlalchemy import Connection, Engine

from outbox_relay.cli import options
from outbox_relay.cli.main import build_parser
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.relay.daemon import Relay
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.progress import Progress, age_text
from outbox_relay.shared.settings import RelaySettings
from tests.conftest import REDIS_URL
from tests.helpers import (
    consumer_settings,
    create_effects,
    enqueue_numbered,
    event,
    record_effect,
    xadd_event,
)

pytestmark = pytest.mark.integration


# thing.done events over aggregates a0 … a4 (tests.helpers.enqueue_numbered)
_enqueue = partial(enqueue_numbered, source="progress-test", partitions=2, aggregates=5)


def test_the_relay_line_counts_deliveries_since_the_last_line_and_the_backlog(
    engine: Engine, redis_client: redis.Redis, key_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = RelaySettings(database_url=engine.url.render_as_string(hide_password=False),
                             redis_url=REDIS_URL, key_prefix=key_prefix, partitions=2,
                             node_id="progress-relay")
    relay = Relay(settings, engine, redis_client)
    assert [t.name for t in relay.periodic if t.name == "progress"] == ["progress"]
    _enqueue(engine, key_prefix, 0, 30)
    relay.run(until_idle=True)
    with caplog.at_level(logging.INFO, logger="outbox_relay.relay.daemon"):
        line = relay.log_progress()
    assert "relay progress-relay: delivered 30 events" in line
    assert "30 since start" in line and "backlog 0 rows, oldest waiting -" in line
    assert line in caplog.text

    _enqueue(engine, key_prefix, 30, 7)  # committed, not relayed yet: the backlog says so
    line = relay.log_progress()
    assert "delivered 0 events" in line and "30 since start" in line
    assert "backlog 7 rows" in line and "oldest waiting -" not in line


def test_the_consumer_line_counts_applied_events_pending_and_unread(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    create_effects(engine)

    def handler(conn: Connection, ev: Event) -> None:
        record_effect(conn, ev)

    handlers = Handlers()
    handlers.register("thing.happened", handler)
    consumer = Consumer(consumer_settings(key_prefix, block_ms=100), engine, redis_client,
                        handlers)
    for i in range(6):
        xadd_event(redis_client, key_prefix, event(f"p{i % 2}", i // 2 + 1))
    consumer.run(until_idle=True)
    line = consumer.log_progress()
    assert "applied 6 events" in line and "6 since start" in line
    assert "0 pending, 0 unread" in line

    for i in range(2):
        xadd_event(redis_client, key_prefix, event("p9", i + 1))
    line = consumer.log_progress()
    assert "applied 0 events" in line and "0 pending, 2 unread" in line


@pytest.mark.parametrize("command", ["relay", "consume"])
def test_quiet_turns_the_line_off_and_the_interval_is_a_setting(command: str) -> None:
    parser = build_parser()
    quiet = parser.parse_args([command, "--quiet"])
    assert options.load_settings(RelaySettings, quiet).progress_interval_s == 0
    custom = parser.parse_args([command, "--progress-interval-s", "5m"])
    assert options.load_settings(RelaySettings, custom).progress_interval_s == 300
    default = parser.parse_args([command])
    assert options.load_settings(RelaySettings, default).progress_interval_s == 60
    relay = RelaySettings(progress_interval_s="off")
    assert relay.progress_interval_s == 0


def test_progress_rates_and_ages_read_as_an_operator_expects() -> None:
    progress = Progress(last_total=10, last_at=100.0)
    assert progress.since_last(70, now=130.0) == (60, 2.0)
    assert progress.since_last(70, now=140.0) == (0, 0.0)
    assert [age_text(s) for s in (None, 0.44, 12.4, 210, 9000)] == [
        "-", "0.4 s", "12 s", "3.5 min", "2.5 h"]
