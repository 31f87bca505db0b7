"""Fault points: inert unless named; when named they SIGKILL the real daemon at that place, and a
restarted daemon finishes the job with nothing lost and nothing applied twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial

import pytest
import redis
from sqlalchemy import Engine, func, select

from outbox_relay.shared import faults, keys
from outbox_relay.shared.errors import ConfigError
from outbox_relay.shared.schema import inbox, outbox
from tests.conftest import REDIS_URL
from tests.helpers import ROOT, enqueue_numbered
from torture import app

PARTITIONS = 2
EVENTS = 12


def test_parse_reads_points_and_rates() -> None:
    assert faults.parse("relay.after_xadd:0.25, consumer.after_ack") == {
        "relay.after_xadd": 0.25, "consumer.after_ack": 1.0,
    }
    assert faults.parse("") == {}


@pytest.mark.parametrize(
    "spec", ["relay.after_xad:0.1", "relay.after_xadd:0", "relay.after_xadd:x"]
)
def test_parse_refuses_typos_and_bad_rates(spec: str) -> None:
    with pytest.raises(ConfigError):
        faults.parse(spec)


def test_an_unnamed_point_does_nothing() -> None:
    faults.configure("relay.after_mark:1")
    try:
        faults.point("relay.after_take")  # would kill this test process if it fired
    finally:
        faults.configure("")


def _env(database_url: str, prefix: str, spec: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update({
        "OUTBOX_DATABASE_URL": database_url, "OUTBOX_REDIS_URL": REDIS_URL,
        "OUTBOX_KEY_PREFIX": prefix, "OUTBOX_PARTITIONS": str(PARTITIONS),
        "OUTBOX_GROUP": "faults", "OUTBOX_STREAMS": "things", "OUTBOX_LOG_LEVEL": "WARNING",
        "OUTBOX_CLAIM_IDLE_MS": "500", "OUTBOX_CLAIM_INTERVAL_MS": "200",
        "OUTBOX_BLOCK_MS": "100", "OUTBOX_POLL_MAX_MS": "50",
        "OUTBOX_NODE_ID": "relay-a",  # a restarted relay finds its own leases
    })
    if spec:
        env[faults.ENV] = spec
    return env


def _outbox(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox_relay", *args], env=env, cwd=ROOT, capture_output=True,
        text=True, timeout=60, check=False,
    )


# EVENTS thing.done events f-000 … (tests.helpers.enqueue_numbered)
_enqueue = partial(enqueue_numbered, first=0, count=EVENTS, source="faults-test",
                   partitions=PARTITIONS, id_format="f-{n:03d}")


def _stream_ids(client: redis.Redis, prefix: str) -> list[str]:
    return [
        fields[b"id"].decode()
        for p in range(PARTITIONS)
        for _id, fields in client.xrange(keys.stream_key(prefix, "things", p))
    ]


@pytest.mark.integration
@pytest.mark.parametrize("point", ["relay.after_take", "relay.after_xadd", "relay.after_mark"])
def test_relay_killed_at_a_point_then_restarted_delivers_each_event_once(
    point: str, engine: Engine, database_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    _enqueue(engine, key_prefix)
    killed = _outbox("relay", "--until-idle", env=_env(database_url, key_prefix, point))
    assert killed.returncode == -signal.SIGKILL
    assert f"outbox-fault: {point}" in killed.stderr

    again = _outbox("relay", "--until-idle", env=_env(database_url, key_prefix))
    assert again.returncode == 0, again.stderr

    assert sorted(_stream_ids(redis_client, key_prefix)) == [f"f-{n:03d}" for n in range(EVENTS)]
    with engine.connect() as conn:
        undelivered = conn.execute(
            select(func.count()).where(outbox.c.delivered_at_ms.is_(None))
        ).scalar_one()
    assert undelivered == 0


@pytest.fixture
def effects_engine(engine: Engine) -> Iterator[Engine]:
    app.create_tables(engine)
    yield engine


def _wait_applied(engine: Engine, deadline_s: float = 30.0) -> int:
    deadline = time.monotonic() + deadline_s
    while True:
        with engine.connect() as conn:
            n = int(conn.execute(
                select(func.count()).where(inbox.c.group_name == "faults")
            ).scalar_one())
        if n >= EVENTS or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


@pytest.mark.integration
@pytest.mark.parametrize("point", ["consumer.after_commit", "consumer.after_ack"])
def test_consumer_killed_at_a_point_then_restarted_applies_each_event_once(
    point: str, effects_engine: Engine, database_url: str, redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    engine = effects_engine
    _enqueue(engine, key_prefix)
    assert _outbox("relay", "--until-idle", env=_env(database_url, key_prefix)).returncode == 0
    argv = ["consume", "--app", "torture.app:handlers", "--consumer", "c1"]
    killed = _outbox(*argv, env=_env(database_url, key_prefix, point))
    assert killed.returncode == -signal.SIGKILL
    assert f"outbox-fault: {point}" in killed.stderr

    proc = subprocess.Popen(
        [sys.executable, "-m", "outbox_relay", *argv], env=_env(database_url, key_prefix), cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        assert _wait_applied(engine) == EVENTS
        deadline = time.monotonic() + 30
        while _pending(redis_client, key_prefix) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert _pending(redis_client, key_prefix) == 0
    with engine.connect() as conn:
        per_event = conn.execute(
            select(app.effects.c.event_id, func.count()).group_by(app.effects.c.event_id)
        ).all()
    assert sorted(per_event) == [(f"f-{n:03d}", 1) for n in range(EVENTS)]


def _pending(client: redis.Redis, prefix: str) -> int:
    return sum(
        int(client.xpending(keys.stream_key(prefix, "things", p), "faults")["pending"])
        for p in range(PARTITIONS)
    )


PRODUCER = """
import sys
from sqlalchemy import text
from outbox_relay.producer import Producer
from outbox_relay.shared import db
engine = db.make_engine(sys.argv[1])
with engine.begin() as conn:
    Producer(partitions=2, key_prefix=sys.argv[2]).enqueue(
        conn, type="thing.done", stream="things", event_id="never-committed")
"""


@pytest.mark.integration
def test_producer_killed_before_commit_leaves_no_outbox_row(
    engine: Engine, database_url: str, key_prefix: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PRODUCER, database_url, key_prefix], cwd=ROOT, text=True,
        env=_env(database_url, key_prefix, "producer.before_commit"), capture_output=True,
        timeout=60, check=False,
    )
    assert proc.returncode == -signal.SIGKILL
    assert "outbox-fault: producer.before_commit" in proc.stderr
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(outbox)).scalar_one() == 0
