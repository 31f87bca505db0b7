"""``outbox consume --until-idle`` (``Consumer.run(until_idle=True)``): the consumer stops
once its group has nothing pending (entries waiting for a retry included) and nothing unread,
never before (issue 26, finding 4). Both databases, real Redis."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis
from sqlalchemy import Connection, Engine, text

from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.shared.envelope import Event
from tests.conftest import REDIS_URL
from tests.helpers import (
    OUTBOX,
    consumer_settings,
    create_effects,
    effect_counts,
    event,
    pending_total,
    receipt_outcomes,
    record_effect,
    xadd_event,
)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_until_idle_waits_for_retries_then_stops_with_everything_applied(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    create_effects(engine)
    events = [event(f"u{i % 3}", i // 3 + 1) for i in range(9)]
    flaky = events[1].id
    calls: dict[str, int] = {}

    def handler(conn: Connection, ev: Event) -> None:
        calls[ev.id] = calls.get(ev.id, 0) + 1
        if ev.id == flaky and calls[ev.id] == 1:
            raise RuntimeError("the downstream blinked")
        record_effect(conn, ev)

    handlers = Handlers()
    handlers.register("thing.happened", handler)
    settings = consumer_settings(key_prefix, retry_first_delay_s=0.3, retry_max_delay_s=0.3,
                                 retry_jitter=0.0, block_ms=100)
    consumer = Consumer(settings, engine, redis_client, handlers, ownership=True)
    assert consumer.idle()  # nothing yet: the group has nothing to do
    for ev in events:
        xadd_event(redis_client, key_prefix, ev)
    assert not consumer.idle()  # unread entries
    consumer.run(until_idle=True)  # returns only when done: no timer in this test
    assert effect_counts(engine) == {ev.id: 1 for ev in events}
    assert set(receipt_outcomes(engine).values()) == {"applied"}
    assert calls[flaky] == 2 and pending_total(redis_client, key_prefix) == 0
    assert consumer.idle()


def test_outbox_consume_until_idle_from_the_cli(database_url: str) -> None:
    """The README's orders example without Ctrl-C: relay and consume both exit by themselves."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")
           and k != "PYTHONPATH"}
    env |= {"OUTBOX_DATABASE_URL": database_url, "OUTBOX_REDIS_URL": REDIS_URL,
            "OUTBOX_KEY_PREFIX": f"t-idle-{uuid.uuid4().hex[:8]}"}

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=120, check=False)

    for order, total in (("o-1", "42"), ("o-2", "7")):
        placed = run(sys.executable, "-m", "examples.orders", "place", order, total)
        assert placed.returncode == 0, placed.stderr
    assert run(str(OUTBOX), "relay", "--until-idle").returncode == 0
    consumed = run(str(OUTBOX), "consume", "--streams", "orders", "--group", "billing",
                   "--app", "examples.orders:handlers", "--until-idle")
    assert consumed.returncode == 0, consumed.stderr
    assert "nothing pending or unread" in consumed.stderr
    from outbox_relay.shared import db

    engine = db.make_engine(database_url)
    try:
        with engine.connect() as conn:
            invoices = sorted(tuple(r) for r in conn.execute(
                text("SELECT order_id, total FROM invoices")))
    finally:
        engine.dispose()
    assert invoices == [("o-1", 42), ("o-2", 7)]
