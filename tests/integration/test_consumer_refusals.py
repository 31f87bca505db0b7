"""A consumer waits out a Redis that refuses commands for now (``OOM`` at ``maxmemory``) like
an outage, instead of exiting: found by the torture's refused-append fault, where consumers and
run workers restarted during the fault exited 1 on ``XGROUP CREATE``. Own Redis (never the
shared one), both databases."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import redis
from sqlalchemy import Connection, Engine

from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.redis_conn import connect_redis, refused_for_now
from tests.helpers import (
    consumer_settings,
    create_effects,
    effect_counts,
    event,
    private_redis,
    record_effect,
    wait_until,
    xadd_event,
)

pytestmark = pytest.mark.integration


def _oom_errors(client: redis.Redis) -> int:
    entry = client.info("errorstats").get("errorstat_OOM") or {}
    return int(entry.get("count", 0)) if isinstance(entry, dict) else 0


def test_a_consumer_started_while_redis_is_out_of_memory_waits_then_applies_everything(
    engine: Engine, key_prefix: str, tmp_path: Path
) -> None:
    create_effects(engine)

    def handler(conn: Connection, ev: Event) -> None:
        record_effect(conn, ev)

    handlers = Handlers()
    handlers.register("thing.happened", handler)
    with private_redis(tmp_path / "redis") as url:
        client = connect_redis(url)
        events = [event(f"m{i % 2}", i // 2 + 1) for i in range(6)]
        for ev in events:
            xadd_event(client, key_prefix, ev)  # the streams exist; the group does not yet
        client.config_set("maxmemory", 1)  # noeviction: XGROUP CREATE is refused with OOM
        consumer = Consumer(consumer_settings(key_prefix, redis_url=url, block_ms=100),
                            engine, connect_redis(url), handlers)
        failed: list[BaseException] = []

        def run() -> None:
            try:
                consumer.run(until_idle=True)
            except BaseException as err:
                failed.append(err)

        worker = threading.Thread(target=run)
        before = _oom_errors(client)
        worker.start()
        wait_until(lambda: _oom_errors(client) > before or failed, timeout=15,
                   what="Redis refusing the consumer with OOM")
        assert not failed and worker.is_alive()  # it waits, it does not exit
        client.config_set("maxmemory", 0)
        worker.join(timeout=60)
        assert not worker.is_alive() and not failed, failed
        assert effect_counts(engine) == {ev.id: 1 for ev in events}
        client.close()


def test_only_refusals_for_now_are_waited_out() -> None:
    oom = refused_for_now(redis.ResponseError("OOM command not allowed when used memory > "
                                              "'maxmemory'."))
    assert oom is not None and "(OOM)" in oom.message
    assert refused_for_now(redis.ResponseError("READONLY You can't write against a read "
                                               "only replica.")) is not None
    assert refused_for_now(redis.exceptions.OutOfMemoryError("command not allowed when used "
                                                             "memory > 'maxmemory'.")) is not None
    assert refused_for_now(redis.ResponseError("WRONGTYPE Operation against a key")) is None
    assert refused_for_now(redis.ResponseError("NOPERM this user has no permissions")) is None
    assert refused_for_now(ValueError("OOM")) is None
