"""A worker process killed with SIGKILL in the middle of a stage loses nothing.

Real processes (``outbox relay``, ``outbox consume``, ``outbox sweep``), the real Redis, both
databases. The run asks a question (answered), then its worker is killed while ``drafting``
runs; once the lease expired, ``outbox sweep`` emits ``run.resume`` and a restarted worker
finishes the run from its checkpoint: every stage ran once except the interrupted one (twice),
and the question was asked once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, select

from outbox_relay.cli import demo_app as jobs
from outbox_relay.runs import pipeline as rs
from outbox_relay.runs.store import RunRow, store_for
from outbox_relay.shared.schema import outbox
from outbox_relay.shared.settings import CommonSettings
from tests.conftest import REDIS_URL
from tests.helpers import wait_until

DEMO_APP = "outbox_relay.cli.demo_app:handlers"

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("runs_tables")]
CLI = [sys.executable, "-m", "outbox_relay"]


class Processes:
    def __init__(self, logs: Path) -> None:
        self.logs, self.procs = logs, []  # type: ignore[var-annotated]

    def start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with (self.logs / f"{name}.log").open("ab") as out:
            proc = subprocess.Popen([*CLI, *args], env=env, stdout=out, stderr=out)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    yield procs
    procs.stop_all()


@pytest.mark.slow  # a worker killed, its lease waited out: about 15 s
def test_sigkill_mid_stage_resumes_from_the_checkpoint(
    engine: Engine, database_url: str, key_prefix: str, redis_client: object, tmp_path: Path,
    processes: Processes,
) -> None:
    journal = tmp_path / "journal.txt"
    env = {
        **os.environ, "OUTBOX_DATABASE_URL": database_url, "OUTBOX_REDIS_URL": REDIS_URL,
        "OUTBOX_KEY_PREFIX": key_prefix, "OUTBOX_PARTITIONS": "2", "OUTBOX_GROUP": "g",
        "OUTBOX_BLOCK_MS": "100", "OUTBOX_POLL_MAX_MS": "50", "OUTBOX_LOG_LEVEL": "INFO",
        "OUTBOX_RUN_LEASE_TTL_MS": "1000", "OUTBOX_RUN_HEARTBEAT_MS": "200",
        "OUTBOX_SWEEP_INTERVAL_MS": "600000", "OUTBOX_DEMO_JOURNAL": str(journal),
        "OUTBOX_DEMO_STAGE_MS": "20",
    }
    store = store_for(CommonSettings(database_url=database_url, key_prefix=key_prefix,
                                     partitions=2))

    def row() -> RunRow:
        with engine.connect() as conn:
            return store.get(conn, "r1")

    def lines() -> Counter[str]:
        return Counter(journal.read_text().splitlines() if journal.exists() else [])

    with engine.begin() as conn:
        store.create(conn, "r1", {"request": {"ask": True}})
    processes.start("relay", ["relay"], env)
    slow = {**env, "OUTBOX_DEMO_DURATIONS_MS": json.dumps({jobs.DRAFTING: 120_000})}
    first = processes.start("consumer-1", ["consume", "--app", DEMO_APP], slow)
    wait_until(lambda: row().status == rs.NEEDS_INPUT, timeout=60, what="the question")
    with engine.begin() as conn:
        store.submit_answer(conn, "r1", "confirm-dates", "yes", "answer-1")
    wait_until(lambda: lines()["r1 stage drafting"] == 1, timeout=60, what="drafting to start")

    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    assert row().status == jobs.DRAFTING and row().lease_owner

    def swept() -> bool:
        out = subprocess.run([*CLI, "sweep", "--json"], env=env, capture_output=True,
                             check=True, timeout=60)
        return bool(json.loads(out.stdout)["resumed"] == 1)

    wait_until(swept, timeout=60, what="the sweep")
    processes.start("consumer-2", ["consume", "--app", DEMO_APP], env)
    wait_until(lambda: row().status == rs.COMPLETED, timeout=60, what="completion")

    stages = {stage: lines()[f"r1 stage {stage}"] for stage in jobs.PIPELINE.stages}
    assert stages == {**dict.fromkeys(jobs.PIPELINE.stages, 1), jobs.DRAFTING: 2}
    assert lines()["r1 ask confirm-dates"] == 1
    with engine.connect() as conn:
        kinds = dict(conn.execute(select(outbox.c.type, func.count())  # type: ignore[arg-type]
                                  .group_by(outbox.c.type)).all())
    assert kinds == {"run.created": 1, "run.needs_input": 1, "run.answered": 1,
                     "run.resume": 1, "run.completed": 1}
    assert row().attempts == 1
