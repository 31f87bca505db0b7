"""``outbox serve`` as a real process on both databases: the runs API end to end."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine

from outbox_relay.cli import demo_app as jobs
from outbox_relay.runs.snapshot import Question
from outbox_relay.runs.store import RunStore
from tests.helpers import free_port

pytestmark = pytest.mark.acceptance


@dataclass
class Server:
    url: str
    log: Path


@pytest.fixture
def server(runs_tables: Engine, database_url: str, key_prefix: str,
           tmp_path: Path) -> Iterator[Server]:
    port = free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "OUTBOX_DATABASE_URL": database_url, "OUTBOX_KEY_PREFIX": key_prefix,
           "OUTBOX_MAX_BODY_BYTES": "2048"}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "outbox_relay", "serve", "--port",
                                 str(port)],
                                env=env, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "server did not start"
        try:
            httpx.get(f"{url}/openapi.json", timeout=1)
            break
        except httpx.TransportError:
            time.sleep(0.05)
    yield Server(url, log)
    proc.terminate()
    assert proc.wait(timeout=15) == 0
    assert "Traceback" not in log.read_text()


def error_of(response: httpx.Response) -> str:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}
    assert "Traceback" not in response.text and "sqlalchemy" not in response.text.lower()
    return str(body["error"]["code"])


def ask(engine: Engine, run_id: str) -> None:
    """Drive a run to needs_input the way a worker would."""
    store = RunStore(pipeline=jobs.PIPELINE)
    with engine.begin() as conn:
        row = store.get(conn, run_id)
        leased = store.lease_for_event(conn, run_id, row.revision, "w", ttl_ms=60_000).row
        assert leased is not None
        row = store.checkpoint(conn, leased, "w", {}, ttl_ms=60_000)
        store.checkpoint(conn, row, "w", {}, ttl_ms=60_000,
                         questions=[Question(interaction_id="q1", prompt="Dates right?")])


def check_create_get_and_not_found(server: Server) -> None:
    created = httpx.post(f"{server.url}/runs", json={"request": {"ask": True}})
    assert created.status_code == 201
    snap = created.json()
    assert snap["status"] == "queued" and snap["questions"] == []
    assert set(snap) == {"id", "status", "stage", "created_at", "updated_at", "questions",
                         "result", "error"}  # no revision, request, checkpoint or receipts
    got = httpx.get(f"{server.url}/runs/{snap['id']}")
    assert got.status_code == 200 and got.json() == snap
    missing = httpx.get(f"{server.url}/runs/nope")
    assert missing.status_code == 404 and error_of(missing) == "not_found"
    assert error_of(httpx.get(f"{server.url}/nowhere")) == "not_found"
    again = httpx.post(f"{server.url}/runs", json={"run_id": snap["id"]})
    assert again.status_code == 409 and error_of(again) == "conflict"
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    assert {"/runs", "/runs/{run_id}", "/runs/{run_id}/answers"} <= set(paths)


def check_invalid_input_and_size_limit(server: Server) -> None:
    for body in ({"request": "not an object"}, {"unknown": 1}, {"run_id": "bad id!"}):
        bad = httpx.post(f"{server.url}/runs", json=body)
        assert bad.status_code == 422 and error_of(bad) == "invalid_request"
    broken = httpx.post(f"{server.url}/runs", content=b"{not json",
                        headers={"content-type": "application/json"})
    assert broken.status_code == 422 and error_of(broken) == "invalid_request"
    big = httpx.post(f"{server.url}/runs", json={"request": {"cv": "x" * 5000}})
    assert big.status_code == 413 and error_of(big) == "payload_too_large"


def check_answers_with_idempotency_key(server: Server, engine: Engine) -> None:
    run_id = httpx.post(f"{server.url}/runs", json={}).json()["id"]
    answers = f"{server.url}/runs/{run_id}/answers"
    early = httpx.post(answers, json={"interaction_id": "q1", "value": "yes"},
                       headers={"Idempotency-Key": "k0"})
    assert early.status_code == 404 and error_of(early) == "unknown_interaction"
    ask(engine, run_id)
    waiting = httpx.get(f"{server.url}/runs/{run_id}").json()
    assert waiting["status"] == "needs_input" and waiting["questions"][0]["interaction_id"] == "q1"

    no_key = httpx.post(answers, json={"interaction_id": "q1", "value": "yes"})
    assert no_key.status_code == 422 and error_of(no_key) == "invalid_request"
    first = httpx.post(answers, json={"interaction_id": "q1", "value": "yes"},
                       headers={"Idempotency-Key": "k1"})
    assert first.status_code == 200 and first.json()["status"] == "analyzing_jd"
    replay = httpx.post(answers, json={"interaction_id": "q1", "value": "yes"},
                        headers={"Idempotency-Key": "k1"})
    assert replay.status_code == 200 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.json() == first.json()
    other = httpx.post(answers, json={"interaction_id": "q1", "value": "no"},
                       headers={"Idempotency-Key": "k1"})
    assert other.status_code == 409 and error_of(other) == "idempotency_conflict"
    twice = httpx.post(answers, json={"interaction_id": "q1", "value": "no"},
                       headers={"Idempotency-Key": "k2"})
    assert twice.status_code == 409 and error_of(twice) == "already_answered"
    nobody = httpx.post(f"{server.url}/runs/nope/answers", json={"interaction_id": "q1",
                        "value": "x"}, headers={"Idempotency-Key": "k3"})
    assert nobody.status_code == 404 and error_of(nobody) == "not_found"


def test_runs_api(server: Server, engine: Engine) -> None:
    """One server per database (starting one is the slow part), three groups of checks."""
    check_create_get_and_not_found(server)
    check_invalid_input_and_size_limit(server)
    check_answers_with_idempotency_key(server, engine)
