"""docs/runs.md as a newcomer follows it: the runs example (``examples/articles.py``, its own
stages and agent) through the real commands — ``db upgrade --runs``, ``serve``, ``relay``,
``consume --app examples.articles:runs`` — from the repository root, on both databases."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import REDIS_URL
from tests.helpers import OUTBOX, free_port

pytestmark = pytest.mark.acceptance

REPO = Path(__file__).resolve().parents[2]


class Daemons:
    def __init__(self, env: dict[str, str], folder: Path) -> None:
        self.env, self.folder = env, folder
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str) -> None:
        with (self.folder / f"{name}.log").open("wb") as out:
            self.procs[name] = subprocess.Popen([str(OUTBOX), *args], cwd=REPO, env=self.env,
                                                stdout=out, stderr=out)

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text()

    def alive(self) -> None:
        for name, proc in self.procs.items():
            assert proc.poll() is None, f"{name} exited: {self.log(name)[-2000:]}"

    def stop(self) -> dict[str, int]:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGTERM)
        return {name: proc.wait(timeout=30) for name, proc in self.procs.items()}


@pytest.fixture
def daemons(database_url: str, tmp_path: Path) -> Iterator[Daemons]:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("OUTBOX_") and k != "PYTHONPATH"}
    env = base | {"OUTBOX_DATABASE_URL": database_url, "OUTBOX_REDIS_URL": REDIS_URL,
                  "OUTBOX_KEY_PREFIX": f"t-articles-{uuid.uuid4().hex[:8]}",
                  "OUTBOX_BLOCK_MS": "100", "OUTBOX_POLL_MAX_MS": "50"}
    running = Daemons(env, tmp_path)
    yield running
    for proc in running.procs.values():
        if proc.poll() is None:
            proc.kill()


def _wait(what: str, check: Callable[[], Any], daemons: Daemons, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        daemons.alive()
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout_s} s"
        time.sleep(0.05)


def test_the_runs_example_from_upgrade_to_a_completed_run(daemons: Daemons) -> None:
    def outbox(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(OUTBOX), *args], cwd=REPO, env=daemons.env,
                              capture_output=True, text=True, timeout=60, check=False)

    assert outbox("db", "upgrade").returncode == 0  # the core tables only
    before = outbox("consume", "--app", "examples.articles:runs")
    assert before.returncode == 1
    assert before.stderr.startswith("error schema_not_ready: ")
    assert "outbox db upgrade --runs" in before.stderr and "Traceback" not in before.stderr
    upgraded = outbox("db", "upgrade", "--runs")
    assert upgraded.returncode == 0 and "has the runs tables at schema r0001" in upgraded.stdout
    assert outbox("db", "check", "--runs").returncode == 0

    port = free_port()
    daemons.start("serve", "serve", "--port", str(port))
    daemons.start("relay", "relay")
    daemons.start("consume", "consume", "--app", "examples.articles:runs")
    api = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{api}/openapi.json", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    _wait("serve up", up, daemons)
    created = httpx.post(f"{api}/runs", json={"request": {"url": "https://example.org/a"}})
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]
    refused = httpx.post(f"{api}/runs", json={"request": {"url": "ftp://example.org/b"}}).json()

    def status(rid: str) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(f"{api}/runs/{rid}").json()
        return body

    waiting = _wait("needs_input", lambda: (s := status(run_id))["status"] == "needs_input"
                    and s, daemons)
    assert waiting["stage"] == "summarize"
    assert [q["interaction_id"] for q in waiting["questions"]] == ["title"]
    answer = {"interaction_id": "title", "value": "Short"}
    answered = httpx.post(f"{api}/runs/{run_id}/answers", json=answer,
                          headers={"Idempotency-Key": "k1"})
    assert answered.status_code == 200, answered.text
    done = _wait("completed", lambda: (s := status(run_id))["status"] == "completed" and s,
                 daemons)
    assert done["result"] == {"title": "Short",
                              "summary": "a summary of the article at https://example.org/a"}
    failed = _wait("failed", lambda: (s := status(refused["id"]))["status"] == "failed" and s,
                   daemons)
    assert failed["error"] == "stage_failed"

    report = json.loads(outbox("reconcile", "--dry-run", "--json").stdout)
    assert report["stuck_runs"] == []
    assert daemons.stop() == {"serve": 0, "relay": 0, "consume": 0}
    for name in ("serve", "relay", "consume"):
        assert "Traceback" not in daemons.log(name)
