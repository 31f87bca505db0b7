"""``python -m torture.outage_drill``: a downstream outage ridden out, from the CLI (issue 22,
finding 1; design.md flow 3 "Retries wait out outages", invariant 9).

As a user runs it: a Redis of the drill's own, ``outbox db upgrade``, then ``outbox relay``
and ``outbox consume --app torture.outage_drill:handlers`` as subprocesses with the default
settings (retry policy included, unless flags say otherwise). Their handler calls a
"downstream", a small HTTP server of the drill on loopback, and writes what it applied in the
claim transaction; while the downstream is down (its port closed: connection refused) the
handler raises ``DownstreamDown``. A producer commits ``--events`` events over
``--aggregates`` aggregates (revisions in order, strict handler) at ``--rate`` events/s; the
downstream goes down ``--outage-at-s`` after the first event, for ``--outage-s``.

The producer starts once the consumer answers ``/readyz``. From a second into the outage on,
``outbox status --json`` runs every ``--status-every-s`` (on a thread of its own: on a busy
machine one run takes seconds) and the consumer's ``/metrics`` is scraped: they must show the
retrying entries (rows exist only while a handler fails). Afterwards the verdict: every
event applied exactly once, in revision order per aggregate, nothing dead (no dead letter, no
``dead`` receipt), nothing pending. Prints one JSON report per database (also written to
``--out``); exit status 1 if any verdict fails.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    func,
    select,
)

from outbox_relay.consumer import Handlers
from outbox_relay.producer import Producer
from outbox_relay.shared import db, keys
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.schema import inbox
from outbox_relay.shared.settings import ConsumerSettings
from torture import harness
from torture.procs import Child, RedisServer, base_env, free_port, outbox_argv

log = logging.getLogger("torture.outage_drill")

ROOT = Path(__file__).resolve().parents[1]
PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
OUT = Path(__file__).with_name("out") / "outage_drill.json"
GROUP, STREAM, TYPE, PARTITIONS = "billing", "orders", "order.updated", 4

metadata = MetaData()
applied = Table(  # what the handler did, in its claim transaction (no unique key: count copies)
    "drill_applied", metadata,
    Column("n", Integer, primary_key=True, autoincrement=True),
    Column("event_id", String(512), nullable=False),
    Column("aggregate_id", String(256), nullable=False),
    Column("revision", BigInteger, nullable=False),
)


class DownstreamDown(Exception):
    """The downstream service did not answer (connection refused while it is down)."""


def handlers(settings: ConsumerSettings) -> Handlers:
    """The consumer's app: call the downstream (``DRILL_DOWNSTREAM_URL``), then record the
    event in the claim transaction; strict order, the group's default retry policy."""
    url = os.environ["DRILL_DOWNSTREAM_URL"]
    app = Handlers()

    @app.on(TYPE)
    def apply(conn: Connection, event: Event) -> None:
        try:
            request = urllib.request.Request(url, data=event.id.encode(), method="POST")
            with urllib.request.urlopen(request, timeout=5) as answer:
                answer.read()
        except OSError as err:  # URLError, refused, reset, timeout
            raise DownstreamDown(type(err).__name__) from None
        conn.execute(applied.insert().values(event_id=event.id,
                                             aggregate_id=event.aggregateid or "",
                                             revision=event.revision or 0))

    return app


class Downstream:
    """An HTTP server on a fixed loopback port that answers every POST with 204; ``down()``
    closes its port (callers get connection refused), ``up()`` opens it again."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/apply"
        self.calls = 0
        self._server: ThreadingHTTPServer | None = None

    def up(self) -> None:
        downstream = self

        class Answer(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                downstream.calls += 1
                self.send_response(204)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet."""

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Answer)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def down(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def produce(engine: Engine, events: int, aggregates: int, rate: float) -> threading.Thread:
    """Commit the events one transaction each at ``rate``/s on a thread: event ``i`` is
    revision ``i // aggregates + 1`` of aggregate ``o-{i % aggregates}``."""
    producer = Producer(source="outage-drill", partitions=PARTITIONS)

    def run() -> None:
        started = time.monotonic()
        for i in range(events):
            time.sleep(max(0.0, started + i / rate - time.monotonic()))
            with engine.begin() as conn:
                producer.enqueue(conn, type=TYPE, stream=STREAM, data={"i": i},
                                 aggregate_type="order", aggregate_id=f"o-{i % aggregates}",
                                 revision=i // aggregates + 1)

    thread = threading.Thread(target=run, name="producer", daemon=True)
    thread.start()
    return thread


def status(env: dict[str, str]) -> dict[str, Any] | None:
    """This group's entry of ``outbox status --json``'s ``retries`` ({} when none wait);
    None when the command failed."""
    done = subprocess.run(outbox_argv("status", "--json"), env=env, capture_output=True,
                          timeout=60, check=False)
    if done.returncode != 0:
        log.warning("outbox status failed: %s", done.stderr.decode(errors="replace")[-300:])
        return None
    report = json.loads(done.stdout)
    return next((g for g in report.get("retries", []) if g["group"] == GROUP), {})


def scrape(port: int) -> dict[str, float]:
    """The consumer's retry series, summed (the ages: their maximum); {} if unreachable."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            body = answer.read().decode()
    except (OSError, urllib.error.URLError):
        return {}
    out: dict[str, float] = defaultdict(float)
    for line in body.splitlines():
        name, _, rest = line.partition("{")
        if name in ("outbox_consumer_retrying_entries", "outbox_consumer_retries_total",
                    "outbox_consumer_oldest_retry_age_seconds"):
            value = float(rest.rsplit(" ", 1)[1])
            out[name] = max(out[name], value) if name.endswith("_seconds") else \
                out[name] + value
    return dict(out)


def verdict(engine: Engine, client: Any, prefix: str, events: int) -> dict[str, Any]:
    """Applied exactly once and in revision order per aggregate; dead letters, dead receipts
    and pending entries left."""
    with engine.connect() as conn:
        rows = conn.execute(select(applied.c.event_id, applied.c.aggregate_id,
                                   applied.c.revision).order_by(applied.c.n)).all()
        dead_receipts = conn.execute(select(func.count()).where(
            inbox.c.group_name == GROUP, inbox.c.outcome == "dead")).scalar_one()
    copies: dict[str, int] = defaultdict(int)
    revisions: dict[str, list[int]] = defaultdict(list)
    for event_id, aggregate_id, revision in rows:
        copies[event_id] += 1
        revisions[aggregate_id].append(revision)
    stream_keys = [keys.stream_key(prefix, STREAM, p) for p in range(PARTITIONS)]
    dead_letters = sum(int(client.xlen(keys.dead_letter_key(prefix, STREAM, p)))
                       for p in range(PARTITIONS))
    pending = sum(int(client.xpending(k, GROUP)["pending"]) for k in stream_keys
                  if client.exists(k))
    return {
        "applied": len(copies),
        "applied_twice_or_more": sum(1 for n in copies.values() if n > 1),
        "missing": events - len(copies),
        "order_violations": sum(1 for revs in revisions.values()
                                for a, b in itertools.pairwise(revs) if b <= a),
        "dead_letters": dead_letters,
        "dead_receipts": int(dead_receipts),
        "pending": pending,
    }


def applied_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count(func.distinct(applied.c.event_id))))
                   .scalar_one())


def run_one(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """One database's drill; its report."""
    workdir = Path(tempfile.mkdtemp(prefix=f"outbox-outage-drill-{kind}-"))
    (workdir / "logs").mkdir()
    server = RedisServer(workdir / "redis")
    downstream = Downstream()
    kids: list[Child] = []
    prefix = f"drill{uuid.uuid4().hex[:8]}"
    metrics_port = free_port()
    try:
        with harness.database(kind, workdir, PG_ADMIN_URL, f"drill_{uuid.uuid4().hex[:10]}",
                              keep=False) as url:
            server.start()
            env = {**base_env(), "OUTBOX_DATABASE_URL": url, "OUTBOX_REDIS_URL": server.url,
                   "OUTBOX_KEY_PREFIX": prefix, "OUTBOX_PARTITIONS": str(PARTITIONS),
                   "OUTBOX_STREAMS": STREAM, "OUTBOX_GROUP": GROUP,
                   "OUTBOX_LOG_LEVEL": "WARNING", "DRILL_DOWNSTREAM_URL": downstream.url,
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                               os.environ.get("PYTHONPATH")]))}
            env.update({f"OUTBOX_{name.upper()}": str(value) for name, value in (
                ("retry_first_delay_s", args.retry_first_delay_s),
                ("retry_max_delay_s", args.retry_max_delay_s),
                ("claim_interval_ms", args.claim_interval_ms)) if value is not None})
            log.info("%s: outbox db upgrade", kind)
            subprocess.run(outbox_argv("db", "upgrade"), env=env, check=True,
                           capture_output=True, timeout=120)
            engine = db.make_engine(url)
            metadata.create_all(engine)
            downstream.up()
            kids = [Child("relay", "relay", outbox_argv("relay"), env, workdir / "logs"),
                    Child("consumer", "consumer",
                          outbox_argv("consume", "--app", "torture.outage_drill:handlers"),
                          {**env, "OUTBOX_METRICS_PORT": str(metrics_port)},
                          workdir / "logs")]
            for kid in kids:
                kid.start()
            report = drive(args, engine, env, downstream, metrics_port, kids)
            client = server.client()
            settle_until = time.monotonic() + 30  # the last batches' XACK
            while verdict(engine, client, prefix, args.events)["pending"] and \
                    time.monotonic() < settle_until:
                time.sleep(0.5)
            report.update(verdict(engine, client, prefix, args.events))
            engine.dispose()
    finally:
        for kid in kids:
            kid.stop()
        downstream.down()
        server.stop()
    report["consumer_handler_failures_logged"] = sum(
        c.handler_failures(DownstreamDown.__name__) for c in kids if c.kind == "consumer")
    report["database"] = kind
    report["work_dir"] = str(workdir)
    report["ok"] = (report["applied"] == args.events and not report["missing"]
                    and not report["applied_twice_or_more"] and not report["order_violations"]
                    and not report["dead_letters"] and not report["dead_receipts"]
                    and not report["pending"] and report["status_max_retrying"] > 0
                    and report["drained"])
    if report["ok"] and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return report


def ready(port: int, kids: list[Child], timeout_s: float = 120.0) -> None:
    """Wait until the consumer answers ``/readyz`` with 200 (it reads its streams), so that
    the outage meets a running consumer however slow the start-up of the processes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and all(k.alive() for k in kids):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the consumer did not get ready: see its log in the work directory")


def drive(args: argparse.Namespace, engine: Engine, env: dict[str, str],
          downstream: Downstream, metrics_port: int, kids: list[Child]) -> dict[str, Any]:
    """Produce, take the downstream down and up again, watch ``outbox status`` and
    ``/metrics`` throughout; wait until everything is applied (or the deadline)."""
    seen: list[dict[str, Any]] = []
    phase = ["before"]
    stop = threading.Event()

    def watch() -> None:  # on its own thread: a look takes seconds on a busy machine
        stop.wait(args.outage_at_s + 1)  # from the outage's first failures on
        while not stop.is_set():
            at, tag = time.monotonic(), phase[0]
            look = {"t_s": round(at - started, 1), "status": status(env),
                    "metrics": scrape(metrics_port)}
            # a look counts for a phase if it started and ended in it
            seen.append({**look, "phase": tag if phase[0] == tag else "between"})
            stop.wait(max(0.0, at + args.status_every_s - time.monotonic()))

    ready(metrics_port, kids)
    log.info("consumer ready; producing %d events at %s/s", args.events, args.rate)
    producer = produce(engine, args.events, args.aggregates, args.rate)
    started = time.monotonic()
    watcher = threading.Thread(target=watch, name="watcher", daemon=True)
    watcher.start()
    outage_start, outage_end = started + args.outage_at_s, started + args.outage_at_s + \
        args.outage_s
    # Worst case after the outage: every aggregate's next attempt is a capped delay away.
    cap = args.retry_max_delay_s if args.retry_max_delay_s is not None else 300.0
    deadline = outage_end + cap * 1.25 + 120
    drained_at = None
    while time.monotonic() < deadline:
        now = time.monotonic()
        if phase[0] == "before" and now >= outage_start:
            downstream.down()
            phase[0] = "down"
            log.info("downstream down for %ss", args.outage_s)
        elif phase[0] == "down" and now >= outage_end:
            downstream.up()
            phase[0] = "after"
            log.info("downstream up again")
        if phase[0] == "after" and not producer.is_alive() and \
                applied_count(engine) == args.events:
            drained_at = time.monotonic()
            break
        if not all(k.alive() for k in kids):
            log.error("a daemon exited: %s", [(k.name, k.returncode()) for k in kids])
            break
        time.sleep(0.05)
    log.info("drained: %s", drained_at is not None)
    stop.set()
    watcher.join(timeout=1)  # a look still running is left out (the thread is a daemon)
    looks = list(seen)
    during = [s for s in looks if s["phase"] == "down"]
    # Retry rows exist only while a handler fails: a look that shows some, whenever it
    # started, saw the outage's retrying entries.
    shown = [s["status"] for s in looks if s["status"]]
    return {
        "events": args.events, "aggregates": args.aggregates, "rate": args.rate,
        "outage_s": args.outage_s,
        "drained": drained_at is not None,
        "drain_after_outage_s": None if drained_at is None else round(drained_at - outage_end, 1),
        "status_looks_during_outage": len(during),
        "status_showed_retrying": sum(1 for s in shown if s.get("entries")),
        "status_max_retrying": max((s.get("entries", 0) for s in shown), default=0),
        "status_max_attempts": max((s.get("max_attempts", 0) for s in shown), default=0),
        "status_oldest_first_failure_age_s": max(
            (s.get("oldest_first_failure_age_s", 0) for s in shown), default=0),
        "metrics_max_retrying": max((s["metrics"].get("outbox_consumer_retrying_entries", 0)
                                     for s in looks), default=0),
        "metrics_max_oldest_retry_age_s": max(
            (s["metrics"].get("outbox_consumer_oldest_retry_age_seconds", 0)
             for s in looks), default=0),
        "metrics_retries_total": max((s["metrics"].get("outbox_consumer_retries_total", 0)
                                      for s in looks), default=0),
        "downstream_calls_answered": downstream.calls,
        "looks": looks,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m torture.outage_drill", description=__doc__
                                .split("\n\n")[0] if __doc__ else None)
    p.add_argument("--database", choices=("sqlite", "postgresql", "both"), default="both")
    p.add_argument("--outage-s", type=float, default=60.0, help="how long the downstream is down")
    p.add_argument("--outage-at-s", type=float, default=5.0,
                   help="when it goes down, after the first event")
    p.add_argument("--events", type=int, default=300)
    p.add_argument("--aggregates", type=int, default=30)
    p.add_argument("--rate", type=float, default=10.0, help="events per second")
    p.add_argument("--status-every-s", type=float, default=5.0)
    p.add_argument("--retry-first-delay-s", type=float, default=None,
                   help="OUTBOX_RETRY_FIRST_DELAY_S of the consumer (default: the setting's)")
    p.add_argument("--retry-max-delay-s", type=float, default=None,
                   help="OUTBOX_RETRY_MAX_DELAY_S of the consumer (default: the setting's)")
    p.add_argument("--claim-interval-ms", type=int, default=None,
                   help="OUTBOX_CLAIM_INTERVAL_MS of the consumer (default: the setting's)")
    p.add_argument("--parallel", action="store_true",
                   help="run the databases at the same time (quicker; timings less clean)")
    p.add_argument("--keep", action="store_true",
                   help="keep the work directory (logs, Redis data) of a clean run too")
    p.add_argument("--out", type=Path, default=OUT, help="where the JSON report goes")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    kinds = ["sqlite", "postgresql"] if args.database == "both" else [args.database]
    if args.parallel:  # each database has its own Redis, downstream, ports and work dir
        with ThreadPoolExecutor(len(kinds)) as pool:
            reports = list(pool.map(lambda kind: run_one(kind, args), kinds))
    else:
        reports = [run_one(kind, args) for kind in kinds]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(reports, indent=2))
    for r in reports:
        summary = {k: v for k, v in r.items() if k != "looks"}
        print(json.dumps(summary))
    return 0 if all(r["ok"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
