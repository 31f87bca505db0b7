"""An application's own runs: its pipeline and its agent, wired by :class:`Runs` into a consumer
with handlers of its own, through the real relay, Redis and both databases.

The run is created and answered by a store without the pipeline (what ``outbox serve`` uses);
only the worker knows the stages.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from sqlalchemy import Connection, Engine, update

from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.producer import Producer
from outbox_relay.relay.daemon import Relay
from outbox_relay.runs import Pipeline, Question, Runs, StageContext, StageResult
from outbox_relay.runs import pipeline as rs
from outbox_relay.runs.schema import runs
from outbox_relay.runs.store import RunRow, RunStore
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.errors import SchemaNotReadyError
from outbox_relay.shared.settings import ConsumerSettings, RelaySettings

pytestmark = pytest.mark.integration

PIPELINE = Pipeline(["fetch", "summarize", "publish"], asking=["summarize"])


class Agent:
    """Asks once in ``summarize``; ``publish`` returns everything it was given. A request
    ``{"ask_in": "publish"}`` makes ``publish`` ask too, which it may not."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def run_stage(self, stage: str, context: StageContext, /) -> StageResult:
        with self.lock:
            self.calls.append((context.run_id, stage))
        if stage == context.request.get("ask_in", "summarize") and not context.answers:
            return StageResult({"draft": 1}, [Question(interaction_id="ok", prompt="Fine?")])
        if stage == "publish":
            return StageResult({"inputs": sorted(context.checkpoint),
                                "answers": dict(context.answers)})
        return StageResult({"stage": stage})


class App:
    def __init__(self, engine: Engine, client: redis.Redis, key_prefix: str) -> None:
        common = {"database_url": str(engine.url.render_as_string(hide_password=False)),
                  "key_prefix": key_prefix, "partitions": 2}
        self.engine, self.agent, self.orders = engine, Agent(), list[str]()
        registry = Handlers()
        registry.register("order.placed", self.on_order)  # the application's own handler
        settings = ConsumerSettings(**common, group="app", consumer="c1",  # type: ignore[arg-type]
                                    streams="runs")
        self.handlers = Runs(PIPELINE, lambda: self.agent).handlers(settings, registry)
        self.relay = Relay(RelaySettings(**common, node_id="r1"), engine,  # type: ignore[arg-type]
                           client)
        self.consumer = Consumer(settings, engine, client, self.handlers)
        self.api = RunStore(Producer(partitions=2, key_prefix=key_prefix))  # no pipeline
        self.producer = Producer(partitions=2, key_prefix=key_prefix)

    def on_order(self, conn: Connection, event: Event, /) -> None:
        self.orders.append(str(event.aggregateid))

    def pump_until(self, done: Callable[[], bool], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, "condition not reached in time"
            self.relay.run_once()
            self.consumer.run_once(block_ms=20)

    def row(self, run_id: str) -> RunRow:
        with self.engine.connect() as conn:
            return self.api.get(conn, run_id)


@pytest.fixture
def app(runs_tables: Engine, redis_client: redis.Redis, key_prefix: str) -> Iterator[App]:
    application = App(runs_tables, redis_client, key_prefix)
    yield application
    application.handlers.stop()  # the worker and the sweeper, as the daemon does


def test_the_applications_stages_run_in_order_with_its_own_handlers_beside(app: App) -> None:
    with app.engine.begin() as conn:
        app.api.create(conn, "r1", {"request": {}})
        app.producer.enqueue(conn, type="order.placed", stream="runs", aggregate_type="order",
                             aggregate_id="o-1", revision=1, data={})
    app.pump_until(lambda: app.row("r1").status == rs.NEEDS_INPUT)
    waiting = app.row("r1")
    assert waiting.record["asked_by"] == "summarize" and waiting.record["resume_at"] == "publish"
    with app.engine.begin() as conn:  # as the HTTP API does: no pipeline needed
        app.api.submit_answer(conn, "r1", "ok", "yes", "key-1")
    app.pump_until(lambda: app.row("r1").status == rs.COMPLETED)
    done = app.row("r1")
    assert done.record["result"] == {"inputs": ["fetch", "summarize"], "answers": {"ok": "yes"}}
    assert [stage for run, stage in app.agent.calls if run == "r1"] == [
        "fetch", "summarize", "publish"]
    assert app.orders == ["o-1"]


def test_questions_from_a_stage_that_may_not_ask_fail_the_run(app: App) -> None:
    with app.engine.begin() as conn:
        app.api.create(conn, "r2", {"request": {"ask_in": "publish"}})
    app.pump_until(lambda: app.row("r2").status in rs.TERMINAL)
    row = app.row("r2")
    assert (row.status, row.record["error"]) == (rs.FAILED, "unexpected_questions")


def test_a_run_in_a_stage_this_worker_lacks_is_left_for_a_worker_that_has_it(
    runs_tables: Engine, redis_client: redis.Redis, key_prefix: str,
) -> None:
    """A rolling deploy: a run is in a stage only newer workers have, with the lease an old
    worker released at stop. The sweeper still resumes it (it needs no pipeline); this worker
    leaves it as it is (``unknown_stage``: counted and logged, never failed, never run), so a
    worker with the stage picks it up, and the run stays visible to ``outbox reconcile``."""
    api = RunStore(Producer(partitions=2, key_prefix=key_prefix))
    with runs_tables.begin() as conn:
        api.create(conn, "r3", {"request": {}})
        record = '{"request":{},"revision":1,"stage":"translating","status":"translating"}'
        conn.execute(update(runs).where(runs.c.id == "r3").values(
            status="translating", record=record, lease_owner="old:1", lease_expires_at_ms=0))
    app = App(runs_tables, redis_client, key_prefix)  # starts with one recovery sweep
    try:
        resumed = app.row("r3")
        assert (resumed.status, resumed.attempts, resumed.lease_owner) == ("translating", 1, None)
        stats = app.handlers.observed["run_worker"]
        app.pump_until(lambda: stats.skipped.get("unknown_stage", 0) >= 1)  # type: ignore[attr-defined]
        app.relay.run_once()
        app.consumer.run_once(block_ms=20)
        row = app.row("r3")
        assert (row.status, row.revision, row.lease_owner) == ("translating", 2, None)
        assert not [c for c in app.agent.calls if c[0] == "r3"]
    finally:
        app.handlers.stop()


def test_runs_refuse_to_start_where_the_runs_tables_were_never_created(
    engine: Engine, key_prefix: str,
) -> None:
    settings = ConsumerSettings(database_url=engine.url.render_as_string(hide_password=False),
                                key_prefix=key_prefix, partitions=2)
    with pytest.raises(SchemaNotReadyError) as info:
        Runs(PIPELINE, Agent).handlers(settings)
    assert "outbox db upgrade --runs" in info.value.message
