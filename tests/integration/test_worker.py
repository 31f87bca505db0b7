"""The run worker through the real pipeline: outbox → relay → Redis Streams → consumer → worker.

Both databases, the real Redis. The demo agent writes a journal line per stage execution and per
question, which is how "each stage ran once" is counted.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from sqlalchemy import Engine, func, select

from outbox_relay.cli import demo_app as jobs
from outbox_relay.cli.demo_app import DemoAgent
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.relay.daemon import Relay
from outbox_relay.runs import pipeline as rs
from outbox_relay.runs.settings import RunSettings
from outbox_relay.runs.store import RunRow, RunStore, store_for
from outbox_relay.runs.sweeper import sweep
from outbox_relay.runs.worker import RunWorker
from outbox_relay.shared import keys
from outbox_relay.shared.schema import outbox
from outbox_relay.shared.settings import ConsumerSettings, RelaySettings

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("runs_tables")]


@dataclass
class Stack:
    engine: Engine
    store: RunStore
    relay: Relay
    consumer: Consumer
    worker: RunWorker
    journal: Path
    client: redis.Redis
    key_prefix: str

    def pump_until(self, done: Callable[[], bool], *, each: Callable[[], None] | None = None,
                   timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, "condition not reached in time"
            self.relay.run_once()
            self.consumer.run_once(block_ms=20)
            if each is not None:
                each()

    def row(self, run_id: str) -> RunRow:
        with self.engine.connect() as conn:
            return self.store.get(conn, run_id)

    def status(self, run_id: str) -> str:
        return self.row(run_id).status

    def create(self, run_id: str, *, ask: bool = False) -> None:
        with self.engine.begin() as conn:
            self.store.create(conn, run_id, {"request": {"ask": ask}})

    def lines(self) -> Counter[str]:
        text = self.journal.read_text() if self.journal.exists() else ""
        return Counter(text.splitlines())

    def events(self, kind: str) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).where(outbox.c.type == kind))
                       .scalar_one())


def make_stack(engine: Engine, database_url: str, client: redis.Redis, key_prefix: str,
                  tmp_path: Path, **overrides: object) -> Stack:
    common = {"database_url": database_url, "key_prefix": key_prefix, "partitions": 2}
    run_settings = RunSettings(**common, run_lease_ttl_ms=overrides.pop("ttl", 30_000),
                                  run_heartbeat_ms=overrides.pop("heartbeat", 10_000))
    journal = tmp_path / "journal.txt"
    agent = DemoAgent(journal=journal, **overrides)  # type: ignore[arg-type]
    store = store_for(run_settings, pipeline=jobs.PIPELINE)
    registry = Handlers()
    worker = RunWorker(engine, store, agent, run_settings, owner="c1")
    worker.register(registry)
    worker.start()
    relay = Relay(RelaySettings(**common, node_id="r1"), engine, client)  # type: ignore[arg-type]
    consumer = Consumer(ConsumerSettings(**common, group="g", consumer="c1",  # type: ignore[arg-type]
                                         streams="runs"),
                        engine, client, registry)
    return Stack(engine, store, relay, consumer, worker, journal, client, key_prefix)


@pytest.fixture
def pipeline(engine: Engine, database_url: str, redis_client: redis.Redis, key_prefix: str,
             tmp_path: Path) -> Iterator[Stack]:
    p = make_stack(engine, database_url, redis_client, key_prefix, tmp_path)
    yield p
    p.worker.close()


def stage_lines(run_id: str) -> list[str]:
    return [f"{run_id} stage {stage}" for stage in jobs.PIPELINE.stages]


def test_question_is_asked_once_and_each_stage_runs_once(pipeline: Stack) -> None:
    pipeline.create("r1", ask=True)
    pipeline.pump_until(lambda: pipeline.status("r1") == rs.NEEDS_INPUT)
    with pipeline.engine.begin() as conn:
        pipeline.store.submit_answer(conn, "r1", "confirm-dates", "yes", "k1")
    pipeline.pump_until(lambda: pipeline.status("r1") == rs.COMPLETED)
    lines = pipeline.lines()
    assert all(lines[line] == 1 for line in stage_lines("r1")), lines
    assert lines["r1 ask confirm-dates"] == 1 and sum(lines.values()) == 8
    assert pipeline.events("run.needs_input") == 1 and pipeline.events("run.completed") == 1
    result = pipeline.store.snapshot(pipeline.row("r1")).result
    assert result["document"] == "run r1: 1 answer(s) used"


def test_replayed_events_of_a_completed_run_do_not_call_the_agent(pipeline: Stack) -> None:
    pipeline.create("r1")
    pipeline.pump_until(lambda: pipeline.status("r1") == rs.COMPLETED)
    before = pipeline.lines()
    done = pipeline.row("r1")
    # 1. the same entry delivered again (a copy under a new stream id): the inbox finds it
    key = keys.stream_key(pipeline.key_prefix, "runs", keys.partition_for("r1", 2))
    first = pipeline.client.xrange(key, count=1)[0][1]
    pipeline.client.xadd(key, first)  # type: ignore[arg-type]
    # 2. a new event for the run's current revision: the worker finds the run terminal
    with pipeline.engine.begin() as conn:
        pipeline.store.producer.enqueue(conn, type="run.resume", stream="runs",
                                        aggregate_type="run", aggregate_id="r1",
                                        revision=done.revision, event_id="r1:replay")
    # found terminal twice: for run.completed, then for r1:replay (its revision equals the
    # applied head, so it is applied, no longer skipped as ``stale``)
    pipeline.pump_until(lambda: pipeline.worker.stats.skipped.get("terminal", 0) == 2
                        and pipeline.consumer.stats.duplicates == 1)
    assert pipeline.lines() == before and pipeline.row("r1") == done


def test_heartbeat_keeps_a_stage_longer_than_the_lease_alive(
    engine: Engine, database_url: str, redis_client: redis.Redis, key_prefix: str,
    tmp_path: Path,
) -> None:
    # A lease of 1 s: a new run's lease also bounds how long its first pickup may take, and
    # on a loaded 2-core machine the first round (connections, group creation) took 0.4 s.
    p = make_stack(engine, database_url, redis_client, key_prefix, tmp_path, ttl=1_000,
                   heartbeat=100, durations_ms={jobs.DRAFTING: 2_500})
    swept: list[int] = []
    try:
        p.create("r1")
        p.pump_until(lambda: p.status("r1") == rs.COMPLETED,
                     each=lambda: swept.append(sweep(engine, p.store, max_attempts=5).resumed))
    finally:
        p.worker.close()
    assert sum(swept) == 0 and len(swept) > 5  # swept all along, never found it expired
    assert p.row("r1").attempts == 0 and p.events("run.resume") == 0
    assert all(p.lines()[line] == 1 for line in stage_lines("r1"))
