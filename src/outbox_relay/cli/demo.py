"""``outbox demo``: the whole pipeline on this machine, end to end, in one command.

It migrates a database (a fresh SQLite file unless ``--database-url``/``OUTBOX_DATABASE_URL``
names one), starts relays and consumers (run workers with the demo agent) as child processes,
creates runs through the run store (each run and its ``run.created`` event in one transaction)
and shows a progress bar until every run completed. Every ``--ask-every``-th run stops at
``needs_input`` with a question; the demo answers it like a user would, and answers the first
one twice with the same idempotency key to show that the second call is a receipt replay that
writes nothing. The summary counts runs completed and questions asked and answered, then shows
the ``redis-cli`` commands to look at the streams. Every demo uses its own key prefix and group,
so repeated demos never mix.

It also leaves ``--dead-letters`` (3) dead letters **on purpose**, so that a new user has one to
find and replay in the console (issue 26): a second group, ``billing``, books ``invoice.issued``
events of the stream ``invoices`` (:data:`cli.demo_app.billing`) and rejects an invoice whose
customer it does not know. The demo issues a few invoices for known customers and
``--dead-letters`` for a customer whose row it adds only once their letters are dead, so a replay
then applies them; the summary ends with the commands that serve the console on the demo's
database, Redis and key prefix, and the ``curl`` calls that list and replay the letters.

Exit status 0 when every run completed, the known customers' invoices were applied, the
deliberate letters are there, and nothing else was dead: those letters are counted apart
(``dead_on_purpose``), so any other dead letter still fails ``make demo``.

Why this module reads both the database and Redis itself: the demo is a script that checks the
whole pipeline from outside, as a user would, and its summary counts both ends (runs, outbox
rows and receipts in the database; entries and dead letters in Redis, ``XLEN``).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import Engine, func, select

from outbox_relay.cli import apps, demo_app, demo_billing, demo_redis, options
from outbox_relay.runs import pipeline as rs
from outbox_relay.runs import schema as runs_schema
from outbox_relay.runs.schema import runs
from outbox_relay.runs.store import RunStore, store_for
from outbox_relay.shared import db, keys
from outbox_relay.shared.errors import ConfigError
from outbox_relay.shared.redaction import redact_url
from outbox_relay.shared.redis_conn import connect_redis
from outbox_relay.shared.schema import inbox, outbox
from outbox_relay.shared.settings import CommonSettings

DEMO_DIR = Path(".outbox-demo")
CREATE_BATCH = 25
BILLING_APP = "outbox_relay.cli.demo_app:billing"
"""The billing group's handlers, for its consumer and for ``OUTBOX_CONSOLE_APPS``."""
CONSOLE_PORT = 8080  # outbox serve's default


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
    parser.add_argument("--dead-letters", type=int, default=3,
                        help="invoices dead-lettered on purpose, to replay in the console "
                        "(default 3; 0: none)")
    parser.add_argument("--keep-redis", action="store_true",
                        help="when the demo starts its own redis-server, leave it running "
                        "afterwards (for the console walkthrough; the summary says how to stop "
                        "it)")


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
    """Run the demo; 0 when every run's event was consumed, and nothing but the deliberate
    letters went to dead letters (see the module docstring)."""
    if args.runs < 1 or args.relays < 1 or args.consumers < 1:
        raise ConfigError("--runs, --relays and --consumers must be at least 1")
    if args.dead_letters < 0:
        raise ConfigError("--dead-letters must be 0 or more")
    DEMO_DIR.mkdir(exist_ok=True)
    if args.database_url is None and "OUTBOX_DATABASE_URL" not in os.environ:
        path = DEMO_DIR / "demo.db"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        args.database_url = f"sqlite:///{path}"
    settings = options.load_settings(CommonSettings, args)
    children = Children()
    own_redis: demo_redis.OwnRedis | None = None
    kept = False
    try:
        redis_url, own_redis = demo_redis.reuse_or_start(settings.redis_url, detach=args.keep_redis)
        args.redis_started_for_demo = own_redis is not None
        args.redis_pid = own_redis.proc.pid if own_redis is not None else None
        status = _run(args, settings, redis_url, children)
        kept = args.keep_redis  # only once the summary said how to stop it
        return status
    finally:
        children.stop()
        if own_redis is not None and not kept:
            own_redis.stop()


def _run(args: argparse.Namespace, settings: CommonSettings, redis_url: str,
         children: Children) -> int:
    engine = db.make_engine(settings.database_url)
    runs_schema.upgrade(engine)  # the core and the runs tables
    stamp = f"demo-{time.strftime('%Y%m%d%H%M%S')}-{os.getpid()}"
    env = _child_env(args, settings, redis_url, stamp)
    logs = DEMO_DIR / "logs"
    logs.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "outbox_relay"]
    for i in range(args.relays):
        children.start([*cmd, "relay"], env, logs / f"relay-{i}.log")
    for i in range(args.consumers):
        children.start([*cmd, "consume", "--app", apps.DEFAULT_APP], env,
                       logs / f"consumer-{i}.log")
    billing = None
    if args.dead_letters:
        demo_app.create_billing_tables(engine)
        billing = demo_billing.issue_invoices(engine, settings, stamp, args.dead_letters)
        children.start([*cmd, "consume", "--app", BILLING_APP, "--group",
                        demo_app.BILLING_GROUP, "--streams", demo_app.INVOICES], env,
                       logs / "billing-consumer.log")
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
    client = connect_redis(redis_url)
    if billing is not None:
        demo_billing.late_customer_arrives(engine, client, stamp, billing,
                               lambda: time.monotonic() < deadline and not children.dead())
    summary = _summary(engine, client, settings, stamp, args.runs)
    summary.update(demo_billing.billing_summary(engine, client, stamp, billing))
    summary["dead"] += summary.pop("billing_dead_other", 0)  # ``dead``: every unexpected one
    summary["receipt_replay"] = replay
    summary["seconds"] = round(time.monotonic() - started, 2)
    _report(summary, args, settings, redis_url)
    ok = (summary["completed"] == args.runs and summary["dead"] == 0
          and summary["dead_on_purpose"] == args.dead_letters
          and summary["invoices_applied"] == (demo_billing.INVOICES_FOR_KNOWN if billing else 0))
    return 0 if ok else 1


def _report(summary: dict[str, Any], args: argparse.Namespace, settings: CommonSettings,
            redis_url: str) -> None:
    """Print the summary (JSON or text), with where Redis is and, when the deliberate letters
    are still there to see, how to replay them in the console."""
    summary["redis_url"] = redact_url(redis_url)
    started_own = bool(getattr(args, "redis_started_for_demo", False))
    summary["redis_started_for_demo"] = started_own
    summary["redis_kept"] = started_own and args.keep_redis
    if summary["redis_kept"]:
        summary["redis_pid"] = args.redis_pid
    if summary["dead_on_purpose"] and (summary["redis_kept"] or not started_own):
        summary["console"] = _console(summary, settings.partitions, redis_url)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(_render(summary, summary["key_prefix"], settings.partitions, redis_url))


def _child_env(args: argparse.Namespace, settings: CommonSettings, redis_url: str,
               stamp: str) -> dict[str, str]:
    """The environment of the demo's relays and consumers: its database, Redis and prefix."""
    return {
        **os.environ,
        "OUTBOX_DATABASE_URL": settings.database_url,
        "OUTBOX_REDIS_URL": redis_url,
        "OUTBOX_KEY_PREFIX": stamp,
        "OUTBOX_PARTITIONS": str(settings.partitions),
        "OUTBOX_GROUP": "demo",
        # the relay creates the workers' group (and billing's, before its consumer starts)
        "OUTBOX_STREAM_GROUPS": "runs:demo" + (
            f",{demo_app.INVOICES}:{demo_app.BILLING_GROUP}" if args.dead_letters else ""),
        "OUTBOX_LOG_LEVEL": args.log_level or "WARNING",  # children: --log-level to see more
        "OUTBOX_CLAIM_IDLE_MS": "5000",
        "OUTBOX_DEMO_STAGE_MS": str(max(args.stage_ms, 0)),
        "OUTBOX_RUN_CONCURRENCY": "16",
    }


def _console(s: dict[str, Any], partitions: int, redis_url: str) -> dict[str, Any]:
    """How to serve the console on the demo's database, Redis and prefix, with a token of its
    own (made up for this demo, for a server on loopback) and billing's handlers to replay
    with. A port other than 8080 is named when 8080 is taken, so the command runs as printed."""
    token = secrets.token_hex(16)
    port = _free_port(CONSOLE_PORT)
    outbox_cmd, _hint = outbox_command()
    env = (f"OUTBOX_DATABASE_URL='{s['database_url']}' OUTBOX_KEY_PREFIX={s['key_prefix']} "
           f"OUTBOX_PARTITIONS={partitions} OUTBOX_REDIS_URL={redact_url(redis_url)} "
           f"OUTBOX_API_TOKENS=demo:{token} "
           f"OUTBOX_CONSOLE_APPS={demo_app.BILLING_GROUP}={BILLING_APP}"
           + (f" OUTBOX_PORT={port}" if port != CONSOLE_PORT else ""))
    base = f"http://127.0.0.1:{port}/console"
    auth = f"-H 'Authorization: Bearer {token}'"
    body = json.dumps({"filter": {"group": demo_app.BILLING_GROUP}})
    return {
        "token": token,
        "url": f"{base}/",
        "command": f"{env} {outbox_cmd} serve --console",
        "list": f"curl -s {auth} '{base}/api/letters?group={demo_app.BILLING_GROUP}'",
        "replay": (f"curl -s -X POST {auth} -H 'Content-Type: application/json' "
                   f"-d '{body}' {base}/api/replay"),
    }


def _free_port(preferred: int) -> int:
    """``preferred`` if nothing listens on it on loopback, else a free port."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
            return preferred
        except OSError:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])


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


def _drained(engine: Engine, stamp: str) -> bool:
    """Every run event of this demo delivered, and every one has its receipt in the group."""
    like = f"{stamp}-%"
    with engine.connect() as conn:
        total, undelivered = conn.execute(
            select(func.count(), func.count().filter(outbox.c.delivered_at_ms.is_(None)))
            .where(outbox.c.stream == "runs", outbox.c.event_id.like(like))
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
            outbox.c.stream == "runs", outbox.c.event_id.like(like),
            outbox.c.delivered_at_ms.is_not(None))).scalar_one()
        outcomes: dict[str, int] = dict(conn.execute(  # type: ignore[arg-type]
            select(inbox.c.outcome, func.count()).where(
                inbox.c.group_name == "demo", inbox.c.event_id.like(like)
            ).group_by(inbox.c.outcome)).all())
        duplicates = conn.execute(select(func.coalesce(func.sum(inbox.c.duplicates), 0)).where(
            inbox.c.group_name == "demo", inbox.c.event_id.like(like))).scalar_one()
        statuses: dict[str, int] = {r[0]: r[1] for r in conn.execute(select(
            runs.c.status, func.count()).where(runs.c.id.like(like)).group_by(runs.c.status))}
        kinds: dict[str, int] = {r[0]: r[1] for r in conn.execute(select(
            outbox.c.type, func.count()).where(outbox.c.stream == "runs",
                                               outbox.c.event_id.like(like)).group_by(
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
    stopped = s.get("redis_started_for_demo") and not s.get("redis_kept")
    env = (f"OUTBOX_DATABASE_URL='{s['database_url']}' OUTBOX_KEY_PREFIX={stamp} "
           f"OUTBOX_PARTITIONS={partitions}")
    if not stopped:
        env += f" OUTBOX_REDIS_URL={redact_url(redis_url)}"
    outbox_cmd, hint = outbox_command()
    env += f" {outbox_cmd}"
    invoices = (f"   ({s['invoices_applied']} of {s['invoices_issued']} invoices applied; "
                "the others, below)" if s["invoices_issued"] else "")
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
        f"dead on purpose     {s['dead_on_purpose']:>8}{invoices}",
        *([f"earlier demos'      {s['dead_on_purpose_earlier_demos']:>8}   (their deliberate "
           "letters, never replayed, refilled into this demo's streams from the shared "
           "database)"] if s.get("dead_on_purpose_earlier_demos") else []),
        f"took {s['seconds']}s on {s['database_url']}",
        "",
        f"Inspect what it produced ({partitions} partitions, key prefix {stamp}):"
        if not stopped else
        "The demo's own redis-server stopped with it; with a Redis of yours (compose.yaml, or "
        "the redis-server package) these commands show what a demo produced:",
        f"  {cli} --scan --pattern '{stamp}:*'",
        f"  {cli} XLEN '{key0}'",
        f"  {cli} XRANGE '{key0}' - + COUNT 2",
        f"  {cli} XINFO GROUPS '{key0}'",
        f"  {cli} XLEN '{keys.dead_letter_key(stamp, 'runs', 0)}'",
        "",
        "and with outbox (the demo's database and key prefix; status and dlq also need that "
        "Redis):" if not stopped else
        "and with outbox, given that Redis (set OUTBOX_REDIS_URL too):",
        f"  {env} status",
        f"  {env} dlq list",
        f"  {env} prune --dry-run",
        *([hint] if hint else []),
        *_render_console(s, outbox_cmd),
    ])


def _render_console(s: dict[str, Any], outbox_cmd: str) -> list[str]:
    """The walkthrough from the deliberate letters to their replay in the console; when the
    demo's own redis-server stopped, the letters went with it, and it says how to keep it."""
    if not s["dead_on_purpose"]:
        return []
    story = (f"Dead letters on purpose: billing rejected {s['dead_on_purpose']} invoice.issued "
             f"events for customer {s['late_customer']}, unknown to it then; the demo has added "
             "that customer since, so a replay now applies them, once.")
    console = s.get("console")
    if console is None:
        return ["", story, "They were in the demo's own redis-server, which stopped with it. "
                "To replay them in the console, run the demo again keeping that server (the "
                "summary then shows how), or start a Redis on localhost:6379 first "
                "(docker compose up -d redis):", f"  {outbox_cmd} demo --keep-redis"]
    kept = ([f"(The demo's redis-server keeps running for this: stop it afterwards with "
             f"`kill {s['redis_pid']}`.)"] if s.get("redis_kept") else [])
    return [
        "", story,
        "Serve the console on the demo's database, Redis and key prefix (Ctrl-C stops it):",
        f"  {console['command']}",
        f"then open {console['url']}, paste the token {console['token']} under API token, "
        "press Use token, and Replay each letter. Or, from another terminal, list and replay "
        "them (replayed again, a letter answers already_replayed):",
        f"  {console['list']}",
        f"  {console['replay']}",
        *kept,
    ]


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
