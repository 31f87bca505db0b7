"""From ``make demo`` to a replayed dead letter in the console, by the demo's printed words alone
(issue 26): the demo leaves its deliberate letters (billing rejected invoices of a customer it
did not know yet), says how to serve the console on its database, Redis and key prefix, and the
commands it prints, run as printed, list the letters and replay them; each event is then
applied exactly once, and replaying again changes nothing and says so.

Real Redis (the shared one, under the demo's own key prefix, deleted afterwards; or a
redis-server the demo starts itself) and both databases (the demo's SQLite file in a tmp dir, a
PostgreSQL schema of the test's own).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
from sqlalchemy import Connection, func, select

from outbox_relay.cli import demo_app, demo_billing
from outbox_relay.consumer import dead_letters
from outbox_relay.shared import db
from outbox_relay.shared.schema import inbox
from tests.conftest import REDIS_URL
from tests.helpers import OUTBOX, free_port

pytestmark = pytest.mark.acceptance

LATE = 3  # --dead-letters


@dataclass(frozen=True)
class Walkthrough:
    """What the demo printed after "Dead letters on purpose": the lines to run, as printed."""

    prefix: str
    serve: str
    url: str
    token: str
    list_letters: str
    replay: str
    stop_redis: str | None  # `kill PID` when the demo kept its own redis-server


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without any ``OUTBOX_*``: the printed commands must carry theirs."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}, **extra}


def run_demo(cwd: Path, database_url: str, redis_url: str, *extra: str,
             **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(OUTBOX), "demo", "--runs", "5", "--dead-letters", str(LATE), "--timeout", "120",
         *extra],
        env=clean_env(OUTBOX_DATABASE_URL=database_url, OUTBOX_REDIS_URL=redis_url, **env),
        cwd=cwd, capture_output=True, text=True, timeout=200, check=False)


def printed_prefix(stdout: str) -> str | None:
    for line in stdout.splitlines():
        if "OUTBOX_KEY_PREFIX=" in line:
            return line.split("OUTBOX_KEY_PREFIX=")[1].split()[0]
    return None


def walkthrough(stdout: str) -> Walkthrough:
    """The console part of the summary: found by what each line does, never rebuilt here."""
    lines = [line.strip() for line in stdout.splitlines()]
    tail = lines[next(i for i, line in enumerate(lines)
                      if line.startswith("Dead letters on purpose")):]
    serve = next(line for line in tail if line.endswith(" serve --console"))
    opened = next(line for line in tail if line.startswith("then open "))
    url = opened.split()[2].rstrip(",")
    token = opened.split("paste the token ")[1].split()[0]
    curls = [line for line in tail if line.startswith("curl ")]
    stop = next((line.split("`")[1] for line in tail if "`kill " in line), None)
    prefix = serve.split("OUTBOX_KEY_PREFIX=")[1].split()[0]
    return Walkthrough(prefix, serve, url, token, curls[0], curls[1], stop)


@pytest.fixture
def cleanup() -> Iterator[list[str]]:
    """Key prefixes the demo left on the shared Redis: deleted afterwards (never a flush)."""
    prefixes: list[str] = []
    yield prefixes
    client = redis.Redis.from_url(REDIS_URL)
    for prefix in prefixes:
        for key in client.scan_iter(match=f"{prefix}:*", count=1000):
            client.delete(key)
    client.close()


@pytest.fixture
def servers() -> Iterator[list[subprocess.Popen[bytes]]]:
    """The console servers a test started: stopped and waited for, whatever happened."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        # its whole session: a server outliving a shell that died must not stay behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def serve_as_printed(w: Walkthrough, cwd: Path,
                     servers: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    """Start the printed ``serve --console`` line in a shell, and wait until the console answers
    with the printed token (or the server exits: then its log says why)."""
    log = (cwd / "serve.log").open("wb")
    # `exec env`: the same line (assignments, then the command), but the shell becomes the
    # server, so the SIGTERM below reaches the server itself, as a supervisor's would
    proc = subprocess.Popen(f"exec env {w.serve}", shell=True, cwd=cwd, env=clean_env(), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    servers.append(proc)
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, (cwd / "serve.log").read_text()
        assert time.monotonic() < deadline, "the console never answered"
        try:
            who = httpx.get(f"{w.url}api/whoami",
                            headers={"authorization": f"Bearer {w.token}"}, timeout=2)
            if who.status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)  # poll: the condition is the console answering, checked above
    assert who.json() == {"caller": "demo", "can_mutate": True,
                          "replay_groups": [demo_app.BILLING_GROUP]}
    return proc


def run_printed(command: str, cwd: Path) -> dict[str, object]:
    ran = subprocess.run(command, shell=True, cwd=cwd, env=clean_env(), capture_output=True,
                         text=True, timeout=60, check=False)
    assert ran.returncode == 0, f"{command}\n{ran.stderr}"
    answer: dict[str, object] = json.loads(ran.stdout)
    return answer


def follow(w: Walkthrough, cwd: Path, database_url: str, redis_url: str,
           servers: list[subprocess.Popen[bytes]]) -> None:
    """Everything after the demo: the letters are there with their reason, the printed
    commands serve the console, list and replay them; each invoice is applied once.

    On a database an earlier demo used, that demo's unreplayed letters may be back too (see
    ``cli.demo_billing.split_letters``): listed and replayed with this demo's, never counted
    as its."""
    client = redis.Redis.from_url(redis_url)
    engine = db.make_engine(database_url, create=False)
    try:
        everything = dead_letters.list_letters(client, w.prefix, stream=demo_app.INVOICES)
        assert {(x.group, x.reason) for x in everything} == {
            (demo_app.BILLING_GROUP, "rejected")}
        letters = [x for x in everything if x.fields[b"id"].startswith(f"{w.prefix}-".encode())]
        assert len(letters) == LATE
        assert all("unknown customer" in x.meta["message"] for x in letters)
        event_ids = {x.fields[b"id"].decode() for x in letters}
        late_customer = f"{w.prefix}-initech"
        with engine.connect() as conn:  # dead, not applied; their customer has arrived since
            assert rows_of(conn, late_customer) == []
            assert conn.execute(select(demo_app.customers.c.id).where(
                demo_app.customers.c.id == late_customer)).scalar_one() == late_customer

        server = serve_as_printed(w, cwd, servers)
        listed = run_printed(w.list_letters, cwd)["letters"]
        assert isinstance(listed, list)
        assert sorted(x["id"] for x in listed) == sorted(x.letter_id for x in everything)
        assert {(x["reason"], x["type"]) for x in listed} == {
            ("rejected", demo_app.INVOICE_ISSUED)}

        replayed = run_printed(w.replay, cwd)
        assert replayed["matched"] == replayed["changed"] == len(everything)
        results = replayed["results"]
        assert isinstance(results, list)
        assert {r["outcome"] for r in results} == {"applied"}
        with engine.connect() as conn:
            assert sorted(rows_of(conn, late_customer)) == sorted(event_ids)  # once each
            outcomes = conn.execute(select(inbox.c.outcome, func.count()).where(
                inbox.c.group_name == demo_app.BILLING_GROUP,
                inbox.c.event_id.in_(event_ids)).group_by(inbox.c.outcome)).all()
            assert {outcome: n for outcome, n in outcomes} == {"applied": LATE}
        assert dead_letters.list_letters(client, w.prefix, stream=demo_app.INVOICES) == []

        # Again: by letter (already_replayed, naming the action), by the printed filter (0).
        for letter in letters:
            again = httpx.post(f"{w.url}api/letters/{letter.letter_id}/replay",
                               headers={"authorization": f"Bearer {w.token}"}, timeout=30)
            assert again.status_code == 200, again.text
            (result,) = again.json()["results"]
            assert result["outcome"] == "already_replayed" and not result["changed"]
            assert f"action {replayed['seq']} of demo" in result["detail"]
        assert run_printed(w.replay, cwd)["matched"] == 0
        with engine.connect() as conn:
            assert sorted(rows_of(conn, late_customer)) == sorted(event_ids)

        server.send_signal(signal.SIGTERM)  # Ctrl-C / SIGTERM: a clean stop
        assert server.wait(timeout=30) == 0
    finally:
        engine.dispose()
        client.close()


def rows_of(conn: Connection, customer: str) -> list[str]:
    """The event ids of the invoice rows of ``customer`` (one row per application)."""
    invoices = demo_app.invoices
    return list(conn.execute(select(invoices.c.event_id).where(
        invoices.c.customer_id == customer)).scalars())


def test_demo_letters_are_replayed_from_the_console_as_printed(
        tmp_path: Path, database_url: str, cleanup: list[str],
        servers: list[subprocess.Popen[bytes]]) -> None:
    demo = run_demo(tmp_path, database_url, REDIS_URL)
    prefix = printed_prefix(demo.stdout)
    if prefix:
        cleanup.append(prefix)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    lines = demo.stdout.splitlines()
    counts = [line.split("(")[0].split() for line in lines if line.startswith("dead ")]
    counted = {" ".join(words[:-1]): words[-1] for words in counts}  # "dead on purpose  3  (…)"
    assert counted == {"dead": "0", "dead on purpose": str(LATE)}
    assert f"({demo_app_known()} of {demo_app_known() + LATE} invoices applied" in demo.stdout
    w = walkthrough(demo.stdout)
    assert w.prefix == prefix and w.stop_redis is None
    assert f"OUTBOX_REDIS_URL={REDIS_URL}" in w.serve
    assert "OUTBOX_CONSOLE_APPS=billing=outbox_relay.cli.demo_app:billing" in w.serve
    assert lines[-1].strip() == w.replay  # the summary ends with the walkthrough
    follow(w, tmp_path, database_url, REDIS_URL, servers)


def demo_app_known() -> int:
    return demo_billing.INVOICES_FOR_KNOWN


def answers(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=1)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


@pytest.mark.skipif(not Path("/usr/bin/redis-server").exists()
                    and not any(Path(p, "redis-server").exists()
                                for p in os.environ.get("PATH", "").split(os.pathsep) if p),
                    reason="needs a redis-server binary for the demo to start")
def test_with_its_own_redis_the_demo_says_the_letters_went_and_keeps_it_when_asked(
        tmp_path: Path, servers: list[subprocess.Popen[bytes]]) -> None:
    """No Redis at the URL: the demo starts its own. Without ``--keep-redis`` it stops with
    the demo and takes the letters along, and the summary says so and how to keep it; with
    ``--keep-redis`` it stays, the walkthrough names it and works, and the printed ``kill``
    stops it. Both demos use one database file, as a user's ``OUTBOX_DATABASE_URL`` would: the
    second one meets the first one's letters again (refilled from the outbox) and still
    succeeds, for they were made on purpose too."""
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    database_url = f"sqlite:///{tmp_path}/demo.db"
    temp = tmp_path / "temp"  # where the demo's redis-server gets its working directory
    temp.mkdir()
    gone = run_demo(tmp_path, database_url, nowhere, TMPDIR=str(temp))
    assert gone.returncode == 0, gone.stdout + gone.stderr
    own = gone.stdout.split("redis-cli -u ")[1].split()[0]
    assert not answers(own)  # stopped with the demo
    assert list(temp.iterdir()) == []  # and its working directory went with it
    assert "serve --console" not in gone.stdout
    assert "stopped with it" in gone.stdout
    assert gone.stdout.rstrip().endswith(" demo --keep-redis")

    kept = run_demo(tmp_path, database_url, nowhere, "--keep-redis", TMPDIR=str(temp))
    w = walkthrough(kept.stdout) if "serve --console" in kept.stdout else None
    own = kept.stdout.split("redis-cli -u ")[1].split()[0] if "redis-cli -u " in kept.stdout \
        else ""
    try:
        assert kept.returncode == 0, kept.stdout + kept.stderr
        assert w is not None and w.stop_redis is not None and answers(own)
        assert f"OUTBOX_REDIS_URL={own}" in w.serve
        assert kept.stdout.rstrip().endswith(f"`{w.stop_redis}`.)")
        follow(w, tmp_path, database_url, own, servers)
    finally:
        if w is not None and w.stop_redis is not None and own and answers(own):
            stopped = subprocess.run(w.stop_redis, shell=True, env=clean_env(), check=False)
            assert stopped.returncode == 0  # the printed way to stop it works
    deadline = time.monotonic() + 30
    while own and answers(own):
        assert time.monotonic() < deadline, "the kept redis-server did not stop"
        time.sleep(0.1)  # poll: the condition is the server refusing connections
