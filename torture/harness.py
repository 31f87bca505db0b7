"""``python -m torture``: the real daemons under faults, then the verdict.

For each database (SQLite file, PostgreSQL schema of its own): start a Redis of its own
(``appendonly yes``, ``appendfsync always``), a producer (with ``--writers`` threads sharing
aggregates, :mod:`torture.load`), 2 relays, 2 consumers of one group, a consumer of a second
group that applies the events the first group's handlers chain (:mod:`torture.chain`) and (with
``--run-worker``) 2 run workers as separate processes; kill them at random and at every fault
point, pause consumers and workers (most pauses outlast their lease), break Redis and the
database on a schedule, take the handlers' downstream down for ``--outage-s`` seconds; then let
everything settle, check (:mod:`torture.check`), print a table and write JSON. Exit status 1 on
any violation.

Retention runs during the whole torture unless ``--no-retention``: :data:`AGGRESSIVE` trims
every stream down to what some group still needs each second and prunes delivered rows after
20 s and receipts after 30 s, so pruning and trimming delete while daemons die around them.
The verdict then reads the torture's ledger (:mod:`torture.ledger`, installed right after the
migrations) instead of what the daemons prune, and the report shows what retention removed.

``--soak`` runs :mod:`torture.soak` instead (no faults, a steady rate, sizes sampled).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy.exc import DBAPIError

from outbox_relay.producer import Producer
from outbox_relay.relay import entry_ids
from outbox_relay.runs import schema as runs_schema
from outbox_relay.runs.schema import runs
from outbox_relay.shared import db, keys
from outbox_relay.shared.schema import consumer_retries, outbox
from outbox_relay.shared.settings import parse_duration
from torture import app, check, ledger
from torture.brokers import (
    QUICK_FAULTS,
    SINGLE_FAULTS,
    Broker,
    ClusterRedis,
    FailoverTally,
    SentinelRedis,
    SingleRedis,
    last_generated_id,
)
from torture.chaos import Chaos, Plan, Tally, terminate_backends_by_app_name
from torture.ghost import GHOST_CLAIM, Ghost
from torture.procs import Child, base_env, outbox_argv

log = logging.getLogger("torture")

PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
GROUP = "torture"
EVENTS_STREAM = "events"
STREAMS = (EVENTS_STREAM, "runs")  # read by GROUP
ALL_STREAMS = (*STREAMS, app.CHAIN_STREAM)  # app.CHAIN_STREAM is read by app.CHAIN_GROUP
READS = {GROUP: frozenset(STREAMS), app.CHAIN_GROUP: frozenset({app.CHAIN_STREAM})}
CONSUMER_LEASE_MS = 3000  # consumers' and workers' OUTBOX_LEASE_TTL_MS; pauses outlast it
FLOWING = 20  # the outage starts once GROUP received this many events
PARTITIONS = 4
OUT = Path(__file__).with_name("out") / "report.json"
WORKER_GROUP = "workers"
RUNS_STREAM = "runs"

# Retention as hard as the settings allow (inbox >= delivered + keep_s): every stream trimmed
# each second down to what some group has not acknowledged, delivered rows pruned after 20 s,
# receipts and heads after 30 s, idle consumers removed after 30 s.
AGGRESSIVE = {
    "OUTBOX_STREAM_TRIM": "true", "OUTBOX_STREAM_KEEP": "0", "OUTBOX_STREAM_KEEP_S": "0",
    "OUTBOX_TRIM_INTERVAL_S": "1", "OUTBOX_RETENTION_DELIVERED": "20s",
    "OUTBOX_RETENTION_INBOX": "30s", "OUTBOX_PRUNE_INTERVAL_S": "2",
    "OUTBOX_CONSUMER_IDLE_S": "30s",
}
DEFAULTS: dict[str, dict[str, float]] = {
    "torture": {"duration": 300.0, "rate": 80.0},
    "soak": {"duration": 1800.0, "rate": 1000.0, "sample_every": 30.0},
    "soak_quick": {"duration": 90.0, "rate": 300.0, "sample_every": 5.0},
}
RETENTION_OFF = {
    "OUTBOX_STREAM_TRIM": "false", "OUTBOX_RETENTION_DELIVERED": "off",
    "OUTBOX_RETENTION_INBOX": "off", "OUTBOX_CONSUMER_IDLE_S": "off",
    "OUTBOX_RETENTION_DEAD_LETTERS": "off",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m torture", description=__doc__.splitlines()[0])
    p.add_argument("--database", choices=("sqlite", "postgresql", "both"), default="both")
    p.add_argument("--duration", type=float, default=None,
                   help="least seconds of faults per database (default 300; soak: seconds of "
                   "load, default 1800, --quick 90)")
    p.add_argument("--kills", type=int, default=1000,
                   help="least process kills per database (default 1000)")
    p.add_argument("--max-duration", type=float, default=3600.0,
                   help="hard cap on seconds of faults per database (default 3600)")
    p.add_argument("--rate", type=float, default=None,
                   help="events per second (default 80; soak: 1000, --quick 300)")
    p.add_argument("--writers", type=int, default=3,
                   help="producer threads writing the same aggregates (default 3)")
    p.add_argument("--hold-ms", type=int, default=50,
                   help="a writer holds each transaction open a random 0..N ms (default 50)")
    p.add_argument("--quick", action="store_true",
                   help="short run: every fault point at least once, ~1 minute per database")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument("--pg-url", default=PG_ADMIN_URL, help="PostgreSQL database to make a schema in")
    p.add_argument("--out", type=Path, default=OUT, help=f"JSON report path (default {OUT})")
    p.add_argument("--keep", action="store_true", help="keep the work directory and PG schema")
    p.add_argument("--run-worker", action="store_true",
                   help="also run 2 run workers (cli.demo_app) and require every run terminal")
    p.add_argument("--no-retention", dest="retention", action="store_false",
                   help="run without stream trimming and pruning (default: aggressive "
                   "retention, see AGGRESSIVE)")
    p.add_argument("--redis", choices=("single", "cluster", "sentinel"), default="single",
                   help="the Redis under fault: one server (kills, empty restarts, stalls), a "
                   "3-master Redis Cluster or a Sentinel set (failovers, stalls); see "
                   "torture/brokers.py")
    p.add_argument("--wait-replicas", type=int, default=0,
                   help="OUTBOX_WAIT_REPLICAS of the relays (cluster/sentinel): with 1, no entry "
                   "marked delivered may be missing from a promoted replica")
    p.add_argument("--outage-s", type=float, default=None,
                   help="seconds the handlers' downstream is down mid-run (default 150, "
                   "--quick 15; 0: no outage)")
    p.add_argument("--soak", action="store_true",
                   help="soak instead of torture: no faults, a steady --rate for --duration "
                   "seconds, table sizes and stream lengths sampled (torture/soak.py)")
    p.add_argument("--sample-every", type=float, default=None,
                   help="soak: seconds between samples (default 30, --quick 5)")
    args = p.parse_args(argv)
    mode = ("soak_quick" if args.quick else "soak") if args.soak else "torture"
    for name, value in DEFAULTS[mode].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.outage_s is None:
        args.outage_s = 15.0 if args.quick else 150.0
    return args


def retention_env(on: bool) -> dict[str, str]:
    """The daemons' retention settings for a torture run."""
    return dict(AGGRESSIVE if on else RETENTION_OFF)


def retention_of(env: dict[str, str]) -> check.Retention:
    """The ages the verdict holds pruning to, from the daemons' settings."""
    return check.Retention(
        delivered_s=parse_duration(env.get("OUTBOX_RETENTION_DELIVERED", "off")),
        inbox_s=parse_duration(env.get("OUTBOX_RETENTION_INBOX", "off")),
    )


def make_plan(args: argparse.Namespace) -> Plan:
    """The fault plan. The producer's rate is per enqueued event (about ``--rate`` calls a
    second): at 0.004 it dies every few seconds, and lives long enough between deaths for its
    writer threads to collide on shared aggregates. With retention, a quick run lasts 45 s so
    that receipts outlive the 30 s inbox retention and are pruned while the faults go on.
    A consumer or worker is paused every few seconds (two of three pauses outlast
    :data:`CONSUMER_LEASE_MS`); the downstream outage starts 10 s in (30 s in a full run), or
    later once :data:`FLOWING` events were received, and the faults go on until it is over."""
    lease_s = CONSUMER_LEASE_MS / 1000
    if args.quick:
        return Plan(duration_s=45 if args.retention else 25, kills=0, max_s=120,
                    rates={"relay": 0.5, "consumer": 0.5, "producer": 0.004, "worker": 0.3},
                    random_kill_every_s=2.5, broker_every_s=7.0, db_every_s=6.0,
                    unarmed_share=0.0, pause_every_s=4.0, lease_s=lease_s,
                    outage_at_s=10.0, outage_s=args.outage_s, ghost_every_s=4.0)
    return Plan(duration_s=args.duration, kills=args.kills, max_s=args.max_duration,
                rates={"relay": 0.15, "consumer": 0.25, "producer": 0.004, "worker": 0.15},
                random_kill_every_s=1.0, broker_every_s=15.0, db_every_s=8.0,
                pause_every_s=5.0, lease_s=lease_s, outage_at_s=30.0, outage_s=args.outage_s,
                ghost_every_s=6.0)


@contextmanager
def database(kind: str, workdir: Path, pg_url: str, tag: str,
             keep: bool | Callable[[], bool]) -> Iterator[str]:
    """A fresh database URL: a SQLite file, or a PostgreSQL schema dropped afterwards unless
    ``keep`` (asked at the end when callable: a run that found violations keeps its schema,
    so what went wrong can be read from the tables)."""
    if kind == "sqlite":
        yield f"sqlite:///{workdir}/torture.db"
        return
    schema = f"torture_{tag}"
    admin = create_engine(pg_url)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{pg_url}?options=-csearch_path%3D{schema}&application_name=outbox-{schema}"
    finally:
        if not (keep() if callable(keep) else keep):
            _drop_schema(admin, schema)
        admin.dispose()


def _drop_schema(admin: Engine, schema: str) -> None:
    """Drop the run's schema after ending every session still in it (a child the harness
    could not stop would deadlock the ``DROP`` against its own reads); a failure is a
    warning, never the loss of the report."""
    try:
        with admin.begin() as conn:
            conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                              "WHERE application_name = :name AND pid <> pg_backend_pid()"),
                         {"name": f"outbox-{schema}"})
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    except DBAPIError as err:
        log.warning("could not drop schema %s (%s); drop it by hand",
                    schema, type(err.orig).__name__)


def declared_groups(workers: bool) -> str:
    """``OUTBOX_STREAM_GROUPS`` of the relays: each stream with the groups that read it."""
    pairs = [f"{stream}:{GROUP}" for stream in STREAMS]
    pairs.append(f"{app.CHAIN_STREAM}:{app.CHAIN_GROUP}")
    if workers:
        pairs.append(f"{RUNS_STREAM}:{WORKER_GROUP}")
    return ",".join(pairs)


def children(env: dict[str, str], log_dir: Path, seed: int, workers: bool,
             wait_replicas: int = 0) -> list[Child]:
    relay_env = {"OUTBOX_LEASE_TTL_MS": "5000", "OUTBOX_BATCH_SIZE": "50",
                 "OUTBOX_REDIS_TIMEOUT_S": "1.0", "OUTBOX_POLL_MAX_MS": "200",
                 "OUTBOX_WAIT_REPLICAS": str(wait_replicas), "OUTBOX_WAIT_TIMEOUT_MS": "500",
                 # Every group that must read a stream is declared: the relay creates it, so
                 # a trim keeps what it has not read even while its processes cannot start
                 # (workers waiting for the database), as an operator would set it.
                 "OUTBOX_STREAM_GROUPS": declared_groups(workers)}
    # No max_deliveries (0, the default): an event retried through the outage may be
    # delivered more than 100 times; only the retry horizon (6 h) dead-letters.
    consumer_env = {"OUTBOX_GROUP": GROUP, "OUTBOX_STREAMS": ",".join(STREAMS),
                    "OUTBOX_BLOCK_MS": "200", "OUTBOX_REDIS_TIMEOUT_S": "1.5",
                    "OUTBOX_CLAIM_IDLE_MS": "3000", "OUTBOX_CLAIM_INTERVAL_MS": "1000",
                    "OUTBOX_MAX_DELIVERIES": "0", "OUTBOX_BATCH_SIZE": "50",
                    "OUTBOX_LEASE_TTL_MS": str(CONSUMER_LEASE_MS), "TORTURE_FAIL_PERCENT": "2",
                    # Each killed consumer fails an event's first call again, and the attempts
                    # are durable: cap the backoff so the quick run settles in its time.
                    "OUTBOX_RETRY_FIRST_DELAY_S": "0.2", "OUTBOX_RETRY_MAX_DELAY_S": "2"}
    made = [Child("producer", "producer", [sys.executable, "-m", "torture.load"], env, log_dir,
                  seed=seed)]
    for i in range(2):
        made.append(Child(f"relay-{i}", "relay", outbox_argv("relay"),
                          {**env, **relay_env, "OUTBOX_NODE_ID": f"relay-{i}"}, log_dir,
                          seed=seed))
    for i in range(2):
        # consumer-1 applies the same work with async and batch handlers (torture/app.py)
        style = {"TORTURE_HANDLER_STYLE": "async-batch"} if i == 1 else {}
        made.append(Child(f"consumer-{i}", "consumer",
                          outbox_argv("consume", "--app", "torture.app:handlers"),
                          {**env, **consumer_env, **style, "OUTBOX_CONSUMER": f"c{i}"},
                          log_dir, seed=seed))
    chain_env = {**consumer_env, "OUTBOX_GROUP": app.CHAIN_GROUP,
                 "OUTBOX_STREAMS": app.CHAIN_STREAM}
    # One consumer of the chained group: the hop must stay cheap (the quick run's time budget).
    made.append(Child("chain-0", "consumer",
                      outbox_argv("consume", "--app", "torture.app:handlers"),
                      {**env, **chain_env, "OUTBOX_CONSUMER": "k0"}, log_dir, seed=seed))
    if workers:
        worker_env = {**consumer_env, "OUTBOX_GROUP": WORKER_GROUP, "OUTBOX_STREAMS": "runs",
                      "OUTBOX_RUN_LEASE_TTL_MS": "3000", "OUTBOX_RUN_HEARTBEAT_MS": "500",
                      "OUTBOX_SWEEP_INTERVAL_MS": "1000", "OUTBOX_RUN_MAX_ATTEMPTS": "1000",
                      # As `make demo` runs them: with the default 4, two workers restarted
                      # every few seconds finished about 3.7 runs/s on PostgreSQL while the
                      # load created about 6, and the backlog outlasted the settle.
                      "OUTBOX_RUN_CONCURRENCY": "16",
                      "OUTBOX_DEMO_STAGE_MS": "5"}
        for i in range(2):
            made.append(Child(f"worker-{i}", "worker",
                              outbox_argv("consume", "--app", "outbox_relay.cli.demo_app:handlers"),
                              {**env, **worker_env, "OUTBOX_CONSUMER": f"w{i}"}, log_dir,
                              seed=seed))
    return made


def runs_open(engine: Engine, workers: bool) -> int:
    """Runs not yet terminal, plus run events the workers' group never had a receipt for (0
    without run workers: nothing would finish them)."""
    if not workers:
        return 0
    with engine.connect() as conn:
        active = conn.execute(
            select(func.count()).where(runs.c.status.not_in(check.TERMINAL))
        ).scalar_one()
    return int(active) + ledger.unreceived(engine, WORKER_GROUP, RUNS_STREAM)


def settled(engine: Engine, client: Any, prefix: str, workers: bool,
            streams: tuple[str, ...] = ALL_STREAMS) -> bool:
    """Nothing undelivered, every event of the ledger received by each group that reads its
    stream (:data:`READS`; pruned receipts count), nothing pending or unread."""
    with engine.connect() as conn:
        undelivered = conn.execute(
            select(func.count()).where(outbox.c.delivered_at_ms.is_(None))
        ).scalar_one()
    if undelivered or runs_open(engine, workers) or any(
            ledger.unreceived(engine, group, stream)
            for group, read in READS.items() for stream in read):
        return False
    stream_keys = [keys.stream_key(prefix, s, p) for s in streams for p in range(PARTITIONS)]
    return not any(check.pending_total(client, k) or check.lag_total(client, k)
                   for k in stream_keys)


def retention_report(engine: Engine, client: Any, prefix: str,
                     streams: tuple[str, ...] = ALL_STREAMS) -> dict[str, Any]:
    """What retention removed (the ledger next to the tables, the trim floors' counts) and
    what Redis holds now."""
    stream_keys = [keys.stream_key(prefix, s, p) for s in streams for p in range(PARTITIONS)]
    return {
        **ledger.sizes(engine),
        "stream_entries": sum(int(client.xlen(k)) for k in stream_keys),
        "consumers": check.consumers_per_group(client, stream_keys),
    }


def run_one(kind: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One database's torture run; its report."""
    tag = uuid.uuid4().hex[:10]
    workdir = Path(tempfile.mkdtemp(prefix=f"outbox-torture-{kind}-"))
    (workdir / "logs").mkdir()
    kids: list[Child] = []
    plan = make_plan(args)
    server: Broker | None = None
    found: list[str] = []  # the checker's violations, known before the schema would go
    try:
        with database(kind, workdir, args.pg_url, tag,
                      lambda: bool(args.keep or found)) as url:
            # The harness's own sessions carry another application_name: never terminated.
            engine = db.make_engine(url.replace("application_name=outbox-", "application_name=h-"))
            runs_schema.upgrade(engine)  # the core and the runs tables
            app.create_tables(engine)
            ledger.install(engine)
            prefix = f"torture{tag}"
            server = broker(args.redis, workdir / "redis", engine, prefix, plan,
                            args.wait_replicas)
            env = {**base_env(), "OUTBOX_DATABASE_URL": url, "OUTBOX_REDIS_URL": server.url,
                   "OUTBOX_KEY_PREFIX": prefix, "OUTBOX_PARTITIONS": str(PARTITIONS),
                   "OUTBOX_LOG_LEVEL": "WARNING", "TORTURE_RATE": str(args.rate),
                   "TORTURE_WRITERS": str(args.writers), "TORTURE_HOLD_MS": str(args.hold_ms),
                   "TORTURE_OUTAGE_FILE": str(workdir / "downstream-down"),
                   "TORTURE_CHAIN": "1",
                   **retention_env(args.retention)}
            kids = children(env, workdir / "logs", seed, args.run_worker, args.wait_replicas)
            terminate = None
            if kind == "postgresql":
                admin = create_engine(args.pg_url)
                terminate = terminate_backends_by_app_name(admin, f"outbox-torture_{tag}")
            # The chaos loop's own reads: on SQLite without BEGIN IMMEDIATE (WAL: a reader never
            # waits for the write lock, which a paused daemon may hold).
            reader = create_engine(url) if kind == "sqlite" else engine
            chaos = Chaos(plan, kids, server, seed=seed, terminate_backends=terminate,
                          outage_file=workdir / "downstream-down",
                          flowing=lambda: received(reader, GROUP) >= FLOWING,
                          felt=lambda: outage_failures(kids) > 0,
                          ghost=Ghost(server.client, [
                              (keys.stream_key(prefix, stream, p), group)
                              for group, streams in sorted(READS.items())
                              for stream in sorted(streams) for p in range(PARTITIONS)],
                              every_s=plan.ghost_every_s, seed=seed,
                              blockers=lambda: retrying_entries(reader))
                          if plan.ghost_every_s else None)
            started = time.monotonic()
            log.info("%s: faults start (work dir %s)", kind, workdir)
            tally = chaos.run()
            fault_s = time.monotonic() - started
            settle_samples: list[tuple[float, int]] = []
            settle_s = _settle(kids, engine, server, prefix, tally.unexpected_exits,
                               args.run_worker, settle_samples)
            verdict = check.verify(engine, server.client(), prefix, list(READS),
                                   check_runs=args.run_worker,
                                   worker_group=WORKER_GROUP if args.run_worker else None,
                                   retention=retention_of(env), reads=READS,
                                   chain=(GROUP, app.CHAIN_GROUP))
            found += verdict.violations(runs_must_finish=args.run_worker)
            retained = retention_report(engine, server.client(), prefix)
            engine.dispose()
            reader.dispose()
    finally:
        for child in kids:
            child.stop()
        if server is not None:
            server.stop()
    repaired = sum(c.repaired_entries() for c in kids if c.kind == "relay")
    resurrected = sum(c.resurrected_entries() for c in kids if c.kind in ("consumer", "worker"))
    handler_failures = sum(c.handler_failures(app.TransientError.__name__)
                           for c in kids if c.kind == "consumer")
    outage_failed = outage_failures(kids)
    # The relay's backoff after a refused append says so once per stream and change of state
    # (relay/refusals.py), a refused repair once per check (relay/repair.py): a refuse_appends
    # fault that made Redis refuse writes must show one of them.
    append_refusals = sum(c.count_in_logs(b"Redis refused an append")
                          + c.count_in_logs(b"Redis refused the append of a retried batch")
                          + c.count_in_logs(b") refused by Redis: ")
                          for c in kids if c.kind == "relay")
    refused = list(getattr(server, "refused", []))
    violations = verdict.violations(runs_must_finish=args.run_worker)
    if tally.faults.get("redis.refuse_appends") and not refused:
        violations.append("refused_appends_never_met_a_relay")
    if refused and not append_refusals:
        violations.append("refused_appends_not_backed_off")
    violations += plan_violations(plan, tally, outage_failed, verdict.chained_applied)
    missing = [p for p in chaos.points if not tally.kills[p]]
    violations += [f"never_killed_at:{p}" for p in missing]
    violations += [f"unexpected_exit:{e}" for e in tally.unexpected_exits]
    if settle_s is None:
        violations.append("did_not_settle")
    assert server is not None
    failovers = server.failovers
    probe = getattr(server, "probe", None)  # an entry still missing at the next failover
    lacked_distinct = len(probe.lacked_ids) if isinstance(probe, LedgerProbe) else 0  # once
    lacked = sum(failovers.lacked)
    violations += failover_violations(failovers, args.wait_replicas)
    report = {
        "database": kind, "seed": seed, "run_worker": args.run_worker,
        "fault_seconds": round(fault_s, 1),
        "settle_seconds": None if settle_s is None else round(settle_s, 1),
        "settle_outstanding": settle_samples,
        "kills": dict(sorted(tally.kills.items())), "total_kills": tally.total_kills(),
        "infra_faults": dict(sorted(tally.faults.items())), "repaired_entries": repaired,
        "resurrected_entries": resurrected,
        "handler_failures": handler_failures,
        "pauses": tally.pauses, "pauses_past_lease": tally.pauses_past_lease,
        "pauses_short": tally.pauses_short, "pauses_killed": tally.pauses_killed,
        "paused_by_kind": dict(sorted(tally.paused_by_kind.items())),
        "outage_seconds": round(tally.outage_seconds, 1), "outage_failures": outage_failed,
        "redis": args.redis, "wait_replicas": args.wait_replicas,
        "failovers": failovers.failovers, "lacked_after_failover": lacked,
        "lacked_per_failover": failovers.lacked, "failovers_unmeasured": failovers.unmeasured,
        "marked_per_failover": failovers.marked, "failovers_aborted": failovers.aborted,
        "lacked_distinct": lacked_distinct,
        "destroyed_per_empty_restart": getattr(server, "destroyed", []),
        "refused_per_fault": refused, "append_refusals": append_refusals,
        "refusals_unmet": getattr(server, "unmet", 0),
        "unavailable_exits": dict(sorted(tally.unavailable_exits.items())),
        "retention": {"settings": retention_env(args.retention), **retained},
        **verdict.as_dict(), "violations": violations,
    }
    if not args.keep and not violations:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        report["work_dir"] = str(workdir)
    if kind == "postgresql" and (args.keep or found):
        report["pg_schema"] = f"torture_{tag}"  # kept: drop it by hand when read
    return report


def retrying_entries(engine: Engine) -> list[tuple[str, str, str]]:
    """``(stream key, group, entry id)`` of up to 50 entries whose handler failed and waits for
    its retry (``outbox_consumer_retries``): the ghost's favourite targets."""
    r = consumer_retries.c
    with engine.connect() as conn:
        rows = conn.execute(select(r.stream_key, r.group_name, r.entry_id).limit(50)).all()
    return [(k, g, e) for k, g, e in rows]


def received(engine: Engine, group: str) -> int:
    """:func:`torture.ledger.received`, 0 while the database does not answer."""
    try:
        return ledger.received(engine, group)
    except DBAPIError:
        return 0


def outage_failures(kids: list[Child]) -> int:
    """Handler calls the consumers logged as failed with the outage's error."""
    return sum(c.handler_failures(app.DownstreamDown.__name__)
               for c in kids if c.kind == "consumer")


def plan_violations(plan: Plan, tally: Tally, outage_failures: int, chained_applied: int
                    ) -> list[str]:
    """What the plan promised and the run must show: pauses past the lease (and shorter ones),
    an outage that ran its length and failed handler calls, chained events applied, pending
    entries a ghost claimed away from their owner."""
    found = []
    if plan.pause_every_s and not tally.pauses_past_lease:
        found.append("never_paused_past_lease")
    if plan.pause_every_s and not tally.pauses_short:
        found.append("never_paused_briefly")
    if plan.outage_s > 0 and tally.outage_seconds < plan.outage_s:
        found.append(f"outage_cut_short:{tally.outage_seconds:.1f}s")
    if plan.outage_s > 0 and not outage_failures:
        found.append("outage_failed_no_call")
    if not chained_applied:
        found.append("nothing_chained")
    if plan.ghost_every_s and not tally.faults[GHOST_CLAIM]:
        found.append("ghost_never_claimed")  # the owners' take-back was never exercised
    return found


class LedgerProbe:
    """The failovers' view of the outbox (torture/brokers.py :class:`Probe`): bursts of
    plain events committed through the producer API, and what the ledger says was marked."""

    BURST = 5  # events per partition stream of the master about to die

    def __init__(self, engine: Engine, prefix: str) -> None:
        self.engine = engine
        self.prefix = prefix
        self.producer = Producer(source="torture", partitions=PARTITIONS, key_prefix=prefix)
        self.bursts = 0
        self.lacked_ids: set[tuple[str, str]] = set()  # every (stream key, entry id) ever lacked

    def burst(self, stream_keys: list[str]) -> list[str]:
        """``BURST`` ``torture.event`` events (stream ``events``, no aggregate) per partition
        stream of ``stream_keys``, in one transaction; their ids (``burst<n>-…``)."""
        wanted = self._partitions_among(stream_keys)
        self.bursts += 1
        ids: list[str] = []
        n = 0
        with self.engine.begin() as conn:
            for partition in wanted:
                made = 0
                while made < self.BURST:
                    event_id = f"burst{self.bursts}-{n}"
                    n += 1
                    if keys.partition_for(event_id, PARTITIONS) != partition:
                        continue
                    ids.append(self.producer.enqueue(
                        conn, type="torture.event", stream=EVENTS_STREAM,
                        data={"burst": self.bursts}, event_id=event_id))
                    made += 1
        return ids

    def can_burst(self, stream_keys: list[str]) -> bool:
        return bool(self._partitions_among(stream_keys))

    def oom_attempts(self) -> dict[int, int] | None:
        """The undelivered rows whose last append Redis refused for memory: ``{seq:
        attempts}`` (the relay records a refused ``XADD`` on its row, relay/store.py); None
        when the database does not answer."""
        try:
            with self.engine.connect() as conn:
                return {int(seq): int(n) for seq, n in conn.execute(
                    select(outbox.c.seq, outbox.c.attempts).where(
                        outbox.c.delivered_at_ms.is_(None),
                        outbox.c.last_error == "redis_oom"))}
        except DBAPIError:
            return None  # the database is being broken too: ask again

    def _partitions_among(self, stream_keys: list[str]) -> list[int]:
        """The partitions of stream ``events`` whose keys are among ``stream_keys``."""
        return [p for p in range(PARTITIONS)
                if keys.stream_key(self.prefix, EVENTS_STREAM, p) in stream_keys]

    def marked(self, event_ids: list[str]) -> int:
        with self.engine.connect() as conn:
            marked = conn.execute(select(func.count()).where(
                ledger.events.c.event_id.in_(event_ids),
                ledger.events.c.delivered_at_ms.is_not(None))).scalar_one()
        return int(marked)

    def marked_among(self, entries: dict[str, list[str]]) -> int:
        """How many of ``entries`` (stream key: entry ids) the ledger has marked delivered."""
        wanted = {(k, i) for k, ids in entries.items() for i in ids}
        if not wanted:
            return 0
        lowest = min(i for _, i in wanted)
        with self.engine.connect() as conn:
            rows = conn.execute(select(ledger.events.c.stream, ledger.events.c.partition,
                                       ledger.events.c.entry_id).where(
                ledger.events.c.delivered_at_ms.is_not(None),
                ledger.events.c.entry_id >= lowest.split("-")[0]))
            return sum((keys.stream_key(self.prefix, r.stream, r.partition), r.entry_id)
                       in wanted for r in rows)

    def lacked(self, replica: Any, stream_keys: list[str]) -> int:
        marked: dict[str, list[str]] = {}
        with self.engine.connect() as conn:
            for row in conn.execute(select(ledger.events.c.stream, ledger.events.c.partition,
                                           ledger.events.c.entry_id).where(
                    ledger.events.c.delivered_at_ms.is_not(None))):
                key = keys.stream_key(self.prefix, row.stream, row.partition)
                if key in stream_keys:
                    marked.setdefault(key, []).append(row.entry_id)
        lacked = 0
        for key in stream_keys:
            top = last_generated_id(replica, key)
            gone = [i for i in marked.get(key, []) if entry_ids.greater(i, top)]
            self.lacked_ids.update((key, i) for i in gone)
            missing = len(gone)
            log.info("failover: %s: replica's last id %s, %d marked, %d of them missing",
                     key, top, len(marked.get(key, [])), missing)
            lacked += missing
        return lacked


def broker(
    mode: str, workdir: Path, engine: Engine, prefix: str, plan: Plan, wait_replicas: int
) -> Broker:
    """The Redis of one run (torture/brokers.py), its failovers probed through the ledger;
    without WAIT a failover must find its burst marked (else it is called off and retried)."""
    stream_keys = [keys.stream_key(prefix, s, p) for s in ALL_STREAMS for p in range(PARTITIONS)]
    if mode == "single":
        # The refused-append fault needs a relay to meet it (up to REFUSAL_WAIT_S a try): the
        # full run's; the quick run in `make test` keeps its time budget (integration tests
        # cover the refusal paths: test_relay_refusal.py, test_consumer_refusals.py).
        faults = SINGLE_FAULTS if plan.kills else QUICK_FAULTS
        return SingleRedis(workdir, stream_keys, LedgerProbe(engine, prefix), plan.stall_s,
                           faults=faults)
    kind = ClusterRedis if mode == "cluster" else SentinelRedis
    return kind(workdir, stream_keys, LedgerProbe(engine, prefix),
                expect_marks=wait_replicas == 0)


def failover_violations(tally: FailoverTally, wait_replicas: int) -> list[str]:
    """What the measured failovers must show (torture/brokers.py, module docstring). With
    WAIT: nothing of the burst marked while the only replica was cut off, nothing marked
    missing on the promoted replica. Without: every marked burst event missing from it (it
    was appended after the cut-off), so each failover lacked at least what it marked."""
    lacked, marked = sum(tally.lacked), sum(tally.marked)
    if wait_replicas > 0:
        return ([f"marked_entries_missing_after_failover:{lacked}"] if lacked else []) + (
            [f"marked_without_replica_confirmation:{marked}"] if marked else [])
    short = [(m, n) for m, n in zip(tally.marked, tally.lacked, strict=True) if n < m]
    return [f"failover_lacked_less_than_marked:{short}"] if short else []


SETTLE_S = 240.0
"""How long the system gets to settle after the faults, while it makes no progress."""
SETTLE_MAX_S = 1800.0
"""The cap while it does: a backlog drains at the daemons' pace, never forever."""
SETTLE_SAMPLE_S = 30.0


def outstanding(engine: Engine, client: Any, prefix: str, workers: bool,
                streams: tuple[str, ...] = ALL_STREAMS) -> int:
    """What stands between now and :func:`settled`, in one number: rows undelivered, runs
    open, ledger events some group never received, entries pending or unread."""
    with engine.connect() as conn:
        undelivered = int(conn.execute(
            select(func.count()).where(outbox.c.delivered_at_ms.is_(None))).scalar_one())
    unreceived = sum(ledger.unreceived(engine, group, stream)
                     for group, read in READS.items() for stream in read)
    stream_keys = [keys.stream_key(prefix, s, p) for s in streams for p in range(PARTITIONS)]
    in_redis = sum(check.pending_total(client, k) + check.lag_total(client, k)
                   for k in stream_keys)
    return undelivered + runs_open(engine, workers) + unreceived + in_redis


def _settle(
    kids: list[Child], engine: Engine, server: Broker, prefix: str, unexpected: list[str],
    workers: bool, samples: list[tuple[float, int]],
) -> float | None:
    """Stop the load, restart every daemon unarmed, wait until the system is quiet.

    "Did not settle" must mean stuck, not slow: the faults leave a backlog (runs the workers
    must finish, entries that empty restarts made the relay put back) that drains at the
    daemons' pace on a 2-core machine. The wait ends in failure when :func:`outstanding` made
    no progress (no new low) for :data:`SETTLE_S`, or at :data:`SETTLE_MAX_S` in all; every
    :data:`SETTLE_SAMPLE_S` it appends ``(seconds, outstanding)`` to ``samples`` (the report
    shows them). Either way every daemon is stopped before it returns: the checks read the
    ledger, the tables and Redis one after the other, and on a system still running a trim or
    prune between two reads looks like a loss."""
    server.resume()
    started = time.monotonic()
    for child in kids:
        child.stop()
        if child.kind != "producer":
            child.start("")
    progress = _Progress(started)
    while not settled(engine, server.client(), prefix, workers):
        now = time.monotonic()
        if now - progress.at > SETTLE_S or now - started > SETTLE_MAX_S:
            _stop_all(kids, unexpected)
            return None
        for child in kids:
            if child.kind != "producer" and not child.alive():
                unexpected.append(f"{child.name}#{child.incarnation}: exit {child.returncode()}")
                child.start("")
        if now >= progress.next_sample:
            left = outstanding(engine, server.client(), prefix, workers)
            samples.append((round(now - started, 1), left))
            log.info("settling: %d outstanding after %.0f s", left, now - started)
            progress.seen(left, now)
        time.sleep(0.5)
    elapsed = time.monotonic() - started
    _stop_all(kids, unexpected)
    return elapsed


@dataclass
class _Progress:
    """The settle's lowest :func:`outstanding` so far, when it was reached, the next sample."""

    at: float
    best: int | None = None
    next_sample: float = 0.0

    def seen(self, left: int, now: float) -> None:
        if self.best is None or left < self.best:
            self.best, self.at = left, now
        self.next_sample = now + SETTLE_SAMPLE_S


def _stop_all(kids: list[Child], unexpected: list[str]) -> None:
    """Stop every child; a daemon that does not stop cleanly is an unexpected exit."""
    for child in kids:
        code = child.stop()
        if child.kind != "producer" and code not in (0, -15, None):  # -15: still starting
            unexpected.append(f"{child.name}#{child.incarnation}: stop exit {code}")
