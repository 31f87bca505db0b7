"""``outbox demo``: the whole pipeline on this machine, end to end, in one command.

It migrates a database (a fresh SQLite file unless ``--database-url``/``OUTBOX_DATABASE_URL``
names one), starts relays and consumers (run workers with the demo agent) as child processes,
creates runs through the run store (each run and its ``run.created`` event in one transaction)
and shows a progress bar until every run completed. Every ``--ask-every``-th run stops at
``needs_input`` with a question; the demo answers it like a user would, and answers the first
one twice with the same idempotency key to show that the second call is a receipt replay that
writes nothing. The summary counts runs completed and questions asked and answered, then shows
the ``redis-cli`` commands to look at the streams. Every demo uses its own key prefix and group,
so repeated demos never mix. Exit status 0 when every run completed and nothing was dead.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import Engine, func, select

from outbox_relay.cli import apps, options
from outbox_relay.runs import pipeline as rs
from outbox_relay.runs import schema as runs_schema
from outbox_relay.runs.schema import runs
from outbox_relay.runs.store import RunStore, store_for
from outbox_relay.shared import db, keys
from outbox_relay.shared.errors import ConfigError, UnavailableError
from outbox_relay.shared.redaction import redact_url
from outbox_relay.shared.redis_conn import connect_redis, translate_redis_errors
from outbox_relay.shared.schema import inbox, outbox
from outbox_relay.shared.settings import CommonSettings

DEMO_DIR = Path(".outbox-demo")
CREATE_BATCH = 25


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's own flags (the settings flags are added by the caller)."""
    parser.add_argument("--runs", type=int, default=1000, help="runs to create (default 1000)")
    parser.add_argument("--relays", type=int, default=1, help="relay processes (default 1)")
    parser.add_argument("--consumers", type=int, default=1, help="consumer processes (default 1)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="give up after this many seconds (default 300)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    parser.add_argument("--ask-every", type=int, default=10,
                        help="every N-th run asks a question the demo answers (default 10)")
    parser.add_argument("--stage-ms", type=int, default=0,
                        help="duration of each of the 7 stages of the demo agent (default 0)")


class Children:
    """The demo's child processes; all of them are stopped on exit, whatever happens."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        with log_path.open("ab") as out:
            self.procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=out))

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def dead(self) -> list[int]:
        return [p.returncode for p in self.procs if p.poll() is not None and p.returncode != 0]


def main(args: argparse.Namespace) -> int:
    """Run the demo; 0 when every run's event was consumed and nothing went to dead letters."""
    if args.runs < 1 or args.relays < 1 or args.consumers < 1:
        raise ConfigError("--runs, --relays and --consumers must be at least 1")
    DEMO_DIR.mkdir(exist_ok=True)
    if args.database_url is None and "OUTBOX_DATABASE_URL" not in os.environ:
        path = DEMO_DIR / "demo.db"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        args.database_url = f"sqlite:///{path}"
    settings = options.load_settings(CommonSettings, args)
    children = Children()
    own_redis: subprocess.Popen[bytes] | None = None
    try:
        redis_url, own_redis = _redis(settings.redis_url)
        args.redis_started_for_demo = own_redis is not None
        return _run(args, settings, redis_url, children)
    finally:
        children.stop()
        if own_redis is not None:
            own_redis.terminate()
            own_redis.wait(timeout=10)


def _run(args: argparse.Namespace, settings: CommonSettings, redis_url: str,
         children: Children) -> int:
    engine = db.make_engine(settings.database_url)
    runs_schema.upgrade(engine)  # the core and the runs tables
    stamp = f"demo-{time.strftime('%Y%m%d%H%M%S')}-{os.getpid()}"
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": settings.database_url,
        "OUTBOX_REDIS_URL": redis_url,
        "OUTBOX_KEY_PREFIX": stamp,
        "OUTBOX_PARTITIONS": str(settings.partitions),
        "OUTBOX_GROUP": "demo",
        "OUTBOX_STREAM_GROUPS": "runs:demo",  # the relay creates the workers' group
        "OUTBOX_LOG_LEVEL": args.log_level or "WARNING",  # children: --log-level to see more
        "OUTBOX_CLAIM_IDLE_MS": "5000",
        "OUTBOX_DEMO_STAGE_MS": str(max(args.stage_ms, 0)),
        "OUTBOX_RUN_CONCURRENCY": "16",
    }
    logs = DEMO_DIR / "logs"
    logs.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "outbox_relay"]
    for i in range(args.relays):
        children.start([*cmd, "relay"], env, logs / f"relay-{i}.log")
    for i in range(args.consumers):
        children.start([*cmd, "consume", "--app", apps.DEFAULT_APP], env,
                       logs / f"consumer-{i}.log")
    store = store_for(settings.model_copy(update={"key_prefix": stamp}), source="outbox-demo")
    started = time.monotonic()
    progress = Progress(args.runs, quiet=args.json)
    every = max(args.ask_every, 0)
    for first in range(0, args.runs, CREATE_BATCH):  # each run with its event, 25 per commit
        last = min(first + CREATE_BATCH, args.runs)
        with engine.begin() as conn:
            for n in range(first, last):
                ask = every > 0 and n % every == 0
                store.create(conn, f"{stamp}-{n:06d}", {"request": {"n": n, "ask": ask}})
        progress.show(last, _finished(engine, stamp))
    deadline = started + args.timeout
    replay: dict[str, Any] = {}
    finished = _finished(engine, stamp)
    while finished < args.runs and time.monotonic() < deadline and not children.dead():
        progress.show(args.runs, finished)
        if not _answer_questions(engine, store, stamp, replay):
            time.sleep(0.1)
        finished = _finished(engine, stamp)
    progress.show(args.runs, finished, done=True)
    while not _drained(engine, stamp) and time.monotonic() < deadline and not children.dead():
        time.sleep(0.1)  # the last events (run.completed) are still on their way: let them land
    summary = _summary(engine, connect_redis(redis_url), settings, stamp, args.runs)
    summary["receipt_replay"] = replay
    summary["seconds"] = round(time.monotonic() - started, 2)
    summary["redis_url"] = redact_url(redis_url)
    summary["redis_started_for_demo"] = bool(getattr(args, "redis_started_for_demo", False))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(_render(summary, stamp, settings.partitions, redis_url))
    ok = summary["completed"] == args.runs and summary["dead"] == 0
    return 0 if ok else 1


def _answer_questions(engine: Engine, store: RunStore, stamp: str,
                      replay: dict[str, Any]) -> int:
    """Answer every pending question like a user would; the first one twice with one key."""
    with engine.connect() as conn:
        waiting = list(conn.execute(select(runs.c.id).where(
            runs.c.id.like(f"{stamp}-%"), runs.c.status == rs.NEEDS_INPUT).limit(500)).scalars())
    for run_id in waiting:
        with engine.connect() as conn:
            questions = store.snapshot(store.get(conn, run_id)).questions
        for q in questions:
            key = f"demo-answer-{run_id}-{q.interaction_id}"
            with engine.begin() as conn:
                first = store.submit_answer(conn, run_id, q.interaction_id, "yes", key)
            if not replay:
                with engine.begin() as conn:
                    again = store.submit_answer(conn, run_id, q.interaction_id, "yes", key)
                replay.update(run_id=run_id, idempotency_key=key, first_replayed=first.replayed,
                              second_replayed=again.replayed,
                              revision_unchanged=again.row.revision == first.row.revision)
    return len(waiting)


def _redis(url: str) -> tuple[str, subprocess.Popen[bytes] | None]:
    """The Redis at ``url``, or one started for the demo when none answers there. A server
    that answers but refuses us (credentials, no such database, not Redis) is an error: a
    Redis of our own would hide the mistake in the URL."""
    try:
        with translate_redis_errors():
            connect_redis(url, timeout_s=2).ping()
        return url, None
    except UnavailableError:
        pass
    binary = shutil.which("redis-server")
    if binary is None:
        raise UnavailableError(
            f"no Redis at {redact_url(url)} and no redis-server binary to start one. "
            "Start one with `docker compose up -d redis` (compose.yaml) or install the "
            "system package (apt-get install redis-server), or set OUTBOX_REDIS_URL."
        )
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="outbox-demo-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    own = f"redis://127.0.0.1:{port}/0"
    client = connect_redis(own, timeout_s=1)
    for _ in range(100):
        try:
            client.ping()
            print(f"started redis-server on port {port} for this demo", file=sys.stderr)
            return own, proc
        except redis.RedisError:
            time.sleep(0.05)
    proc.kill()
    raise UnavailableError("could not start a redis-server for the demo")


def _drained(engine: Engine, stamp: str) -> bool:
    """Every event of this demo delivered, and every one has its receipt in the group."""
    like = f"{stamp}-%"
    with engine.connect() as conn:
        total, undelivered = conn.execute(
            select(func.count(), func.count().filter(outbox.c.delivered_at_ms.is_(None)))
            .where(outbox.c.event_id.like(like))
        ).one()
        receipts = conn.execute(
            select(func.count()).where(inbox.c.group_name == "demo", inbox.c.event_id.like(like))
        ).scalar_one()
    return bool(undelivered == 0 and receipts >= total)


def _finished(engine: Engine, stamp: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(
            select(func.count()).where(runs.c.id.like(f"{stamp}-%"),
                                       runs.c.status.in_(rs.TERMINAL))
        ).scalar_one())


def _summary(engine: Engine, client: redis.Redis, settings: CommonSettings, stamp: str,
             wanted: int) -> dict[str, Any]:
    like = f"{stamp}-%"
    with engine.connect() as conn:
        created = conn.execute(select(func.count()).where(runs.c.id.like(like))).scalar_one()
        delivered = conn.execute(select(func.count()).where(
            outbox.c.event_id.like(like), outbox.c.delivered_at_ms.is_not(None))).scalar_one()
        outcomes: dict[str, int] = dict(conn.execute(  # type: ignore[arg-type]
            select(inbox.c.outcome, func.count()).where(
                inbox.c.group_name == "demo", inbox.c.event_id.like(like)
            ).group_by(inbox.c.outcome)).all())
        duplicates = conn.execute(select(func.coalesce(func.sum(inbox.c.duplicates), 0)).where(
            inbox.c.group_name == "demo", inbox.c.event_id.like(like))).scalar_one()
        statuses: dict[str, int] = {r[0]: r[1] for r in conn.execute(select(
            runs.c.status, func.count()).where(runs.c.id.like(like)).group_by(runs.c.status))}
        kinds: dict[str, int] = {r[0]: r[1] for r in conn.execute(select(
            outbox.c.type, func.count()).where(outbox.c.event_id.like(like)).group_by(
            outbox.c.type))}
    entries = dead_letters = 0
    for p in range(settings.partitions):
        entries += client.xlen(keys.stream_key(stamp, "runs", p))
        dead_letters += client.xlen(keys.dead_letter_key(stamp, "runs", p))
    return {
        "runs_requested": wanted,
        "created": created,
        "delivered": delivered,
        "stream_entries": entries,
        "consumed": outcomes.get("applied", 0),
        "completed": statuses.get(rs.COMPLETED, 0),
        "failed": statuses.get(rs.FAILED, 0),
        "questions_asked": kinds.get("run.needs_input", 0),
        "questions_answered": kinds.get("run.answered", 0),
        "resumed": kinds.get("run.resume", 0),
        "duplicates_skipped": int(duplicates),
        "superseded": outcomes.get("superseded", 0),
        "dead": outcomes.get("dead", 0) + dead_letters,
        "database_url": redact_url(settings.database_url),
        "key_prefix": stamp,
    }


def _render(s: dict[str, Any], stamp: str, partitions: int, redis_url: str) -> str:
    rate = s["completed"] / s["seconds"] if s["seconds"] else 0.0
    replay = s.get("receipt_replay") or {}
    receipt = (f"answered {replay['run_id']} twice with key {replay['idempotency_key']!r}: "
               f"second call replayed={replay['second_replayed']}, nothing written="
               f"{replay['revision_unchanged']}" if replay else "no question was answered")
    key0 = keys.stream_key(stamp, "runs", 0)
    cli = f"redis-cli -u {redact_url(redis_url)}"
    env = (f"OUTBOX_DATABASE_URL='{s['database_url']}' OUTBOX_KEY_PREFIX={stamp} "
           f"OUTBOX_PARTITIONS={partitions}")
    if not s.get("redis_started_for_demo"):
        env += f" OUTBOX_REDIS_URL={redact_url(redis_url)}"
    outbox_cmd, hint = outbox_command()
    env += f" {outbox_cmd}"
    return "\n".join([
        "",
        f"created             {s['created']:>8}",
        f"delivered           {s['delivered']:>8}   (stream entries: {s['stream_entries']})",
        f"events consumed     {s['consumed']:>8}",
        f"runs completed      {s['completed']:>8}   ({rate:,.0f} runs/s end to end, 7 stages)",
        f"runs failed         {s['failed']:>8}",
        f"questions asked     {s['questions_asked']:>8}",
        f"questions answered  {s['questions_answered']:>8}   ({receipt})",
        f"runs resumed        {s['resumed']:>8}",
        f"duplicates skipped  {s['duplicates_skipped']:>8}",
        f"superseded          {s['superseded']:>8}   (older run events, already re-read)",
        f"dead                {s['dead']:>8}",
        f"took {s['seconds']}s on {s['database_url']}",
        "",
        f"Inspect what it produced ({partitions} partitions, key prefix {stamp}):"
        if not s.get("redis_started_for_demo") else
        "The demo's own redis-server stopped with it; with a Redis of yours (compose.yaml, or "
        "the redis-server package) these commands show what a demo produced:",
        f"  {cli} --scan --pattern '{stamp}:*'",
        f"  {cli} XLEN '{key0}'",
        f"  {cli} XRANGE '{key0}' - + COUNT 2",
        f"  {cli} XINFO GROUPS '{key0}'",
        f"  {cli} XLEN '{keys.dead_letter_key(stamp, 'runs', 0)}'",
        "",
        "and with outbox (the demo's database and key prefix; status and dlq also need that "
        "Redis):" if not s.get("redis_started_for_demo") else
        "and with outbox, given that Redis (set OUTBOX_REDIS_URL too):",
        f"  {env} status",
        f"  {env} dlq list",
        f"  {env} prune --dry-run",
        *([hint] if hint else []),
    ])


def outbox_command() -> tuple[str, str | None]:
    """How to run this install's ``outbox`` from the current directory, and a hint to print
    when that is not plain ``outbox``. ``make demo`` runs ``.venv/bin/outbox`` without
    activating the virtualenv, so ``outbox`` alone would be "command not found": print the
    script's path (relative when it is below the current directory) and how to activate."""
    script = Path(sys.executable).with_name("outbox")  # the virtualenv's bin/, not resolved
    if not script.exists():  # an interpreter without the console script: run the module
        return f"{shlex.quote(sys.executable)} -m outbox_relay", None
    found = shutil.which("outbox")
    if found is not None and Path(found).resolve() == script.resolve():
        return "outbox", None
    try:
        shown = script.relative_to(Path.cwd())
    except ValueError:
        shown = script
    activate = shlex.quote(str(shown.with_name("activate")))
    hint = (f"({shown} is this install's outbox command; after `source {activate}`, plain "
            "`outbox` works too)" if shown.with_name("activate").exists() else None)
    return shlex.quote(str(shown)), hint


class Progress:
    """A one-line progress bar on a terminal; a line per quarter when stderr is a file."""

    def __init__(self, total: int, *, quiet: bool) -> None:
        self.total, self.quiet = total, quiet
        self.tty = sys.stderr.isatty()
        self.last_quarter = -1

    def show(self, created: int, consumed: int, *, done: bool = False) -> None:
        if self.quiet:
            return
        width = 30
        filled = int(width * consumed / self.total)
        bar = "#" * filled + "." * (width - filled)
        line = f"[{bar}] created {created}/{self.total}  finished {consumed}"
        if self.tty:
            sys.stderr.write(f"\r{line}" + ("\n" if done else ""))
        else:
            quarter = 4 * consumed // self.total
            if quarter == self.last_quarter and not done:
                return
            self.last_quarter = quarter
            sys.stderr.write(line + "\n")
        sys.stderr.flush()
