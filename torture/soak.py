"""``python -m torture --soak``: a steady load with retention set to minutes; sizes must stay flat.

Issue 10 asks that, at a steady 1,000 events/s with retention on, table sizes and stream lengths
stay flat while nothing is lost, duplicated or reordered. For one database (``--database``; a
SQLite file or a PostgreSQL schema of its own) this starts a Redis of its own, the torture's
producer (:mod:`torture.load`: plain events and concurrent writers of shared aggregates, no
runs, no transaction held open) at ``--rate``, one relay and two consumers of the torture group,
with the retention of :data:`SOAK` (``--quick``: :data:`QUICK`). No process is killed and no
handler fails on purpose.

Every ``--sample-every`` seconds (30; ``--quick`` 5) a :class:`Sample` is taken: rows of
``outbox_events``, ``outbox_inbox`` and ``outbox_inbox_heads``, the summed ``XLEN`` of the
partition streams and of their dead-letter streams, the consumers each group has (``XINFO
CONSUMERS``), and how far behind the pipeline is (undelivered rows; events the group has not
received yet; both from the torture's ledger, :mod:`torture.ledger`). After ``--duration``
seconds the producer stops, the rest drains, and the torture's checks run
(:func:`torture.check.verify`: nothing lost, nothing duplicated, order kept; pruning only under
its conditions).

**Flatness**: for each series of :data:`FLAT_SERIES`, the maximum over the last third of the
samples must be at most 1.2 times the maximum over the middle third (for the stream lengths,
over the middle third or the trim's own ceiling, whichever is higher:
:func:`stream_ceiling`). That only means something once retention has reached its steady
state: when the middle third starts before :func:`warm_up_s` (the inbox retention plus the
stream keep time plus a prune interval), the verdict is ``inconclusive`` (a run too short for
its retention), never a pass.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import Engine, func, select

from outbox_relay.shared import db, keys
from outbox_relay.shared.schema import inbox, inbox_heads, outbox
from outbox_relay.shared.settings import parse_duration
from torture import app, check, harness, ledger
from torture.procs import Child, RedisServer, base_env, outbox_argv

log = logging.getLogger("torture.soak")

STREAMS = ("events",)
SOAK = {
    "OUTBOX_STREAM_TRIM": "true", "OUTBOX_STREAM_KEEP": "1000", "OUTBOX_STREAM_KEEP_S": "30s",
    "OUTBOX_TRIM_INTERVAL_S": "10", "OUTBOX_RETENTION_DELIVERED": "2m",
    "OUTBOX_RETENTION_INBOX": "3m", "OUTBOX_PRUNE_INTERVAL_S": "10",
    "OUTBOX_CONSUMER_IDLE_S": "5m", "OUTBOX_RETENTION_DEAD_LETTERS": "10m",
    "OUTBOX_STREAM_GROUPS": f"events:{harness.GROUP}",
}
QUICK = {
    "OUTBOX_STREAM_TRIM": "true", "OUTBOX_STREAM_KEEP": "0", "OUTBOX_STREAM_KEEP_S": "5s",
    "OUTBOX_TRIM_INTERVAL_S": "2", "OUTBOX_RETENTION_DELIVERED": "20s",
    "OUTBOX_RETENTION_INBOX": "25s", "OUTBOX_PRUNE_INTERVAL_S": "2",
    "OUTBOX_CONSUMER_IDLE_S": "30s", "OUTBOX_RETENTION_DEAD_LETTERS": "1m",
    "OUTBOX_STREAM_GROUPS": f"events:{harness.GROUP}",
}
FLAT_SERIES = ("outbox_events", "outbox_inbox", "outbox_inbox_heads", "stream_entries",
               "dead_letters", "consumers")
FLAT_FACTOR = 1.2
OUT = Path(__file__).with_name("out") / "soak.json"


@dataclass
class Sample:
    """Sizes at one moment of the soak."""

    t_s: float  # seconds since the load started
    enqueued: int  # events committed so far (ledger)
    rate: float  # events committed per second since the previous sample
    backlog: int  # outbox rows not yet delivered
    unreceived: int  # events the group has no receipt for yet (ledger counts)
    outbox_events: int
    outbox_inbox: int
    outbox_inbox_heads: int
    stream_entries: int  # sum of XLEN over the partition streams
    dead_letters: int  # sum of XLEN over their dead-letter streams
    consumers: int  # consumers of the torture group (XINFO CONSUMERS, all partitions)


def warm_up_s(retention: dict[str, str]) -> float:
    """Seconds until retention has started deleting everything it will: the longest of the
    delivered and inbox retentions (plus the stream's keep time) and a prune interval."""
    longest = max(parse_duration(retention["OUTBOX_RETENTION_DELIVERED"]),
                  parse_duration(retention["OUTBOX_RETENTION_INBOX"]))
    return (longest + parse_duration(retention["OUTBOX_STREAM_KEEP_S"])
            + float(retention["OUTBOX_PRUNE_INTERVAL_S"]))


def stream_ceiling(retention: dict[str, str], rate: float) -> float:
    """The most entries a partition stream set holds by the trim's own rule while every group
    keeps up: the newest ``OUTBOX_STREAM_KEEP`` per stream plus all entries younger than
    ``OUTBOX_STREAM_KEEP_S``, and what arrives until the next trim (``OUTBOX_TRIM_INTERVAL_S``).

    A sample falls anywhere in that cycle, so between thirds the sampled maximum swings by
    up to ``(keep_s + interval) / keep_s`` (7/5 in the quick soak) with nothing growing: the
    maxima are compared from this ceiling up, never below it."""
    keep_s = parse_duration(retention["OUTBOX_STREAM_KEEP_S"])
    interval = float(retention["OUTBOX_TRIM_INTERVAL_S"])
    streams = len(STREAMS) * harness.PARTITIONS
    return int(retention["OUTBOX_STREAM_KEEP"]) * streams + rate * (keep_s + interval)


def flatness(
    samples: list[Sample], warm_up: float, least: dict[str, float] | None = None
) -> dict[str, Any]:
    """Per series of :data:`FLAT_SERIES`: the maxima of the middle and last thirds, and whether
    the last stays within :data:`FLAT_FACTOR` of the middle (or of the series' ``least``
    entry when that is higher: :func:`stream_ceiling`); ``verdict`` ``flat``, ``growing`` or
    ``inconclusive`` (too few samples, or the middle third starts before ``warm_up``
    seconds)."""
    least = least or {}
    third = len(samples) // 3
    if third == 0:
        return {"verdict": "inconclusive", "reason": "fewer than 3 samples", "series": {}}
    middle, last = samples[third:2 * third], samples[2 * third:]
    series = {}
    for name in FLAT_SERIES:
        mid_max = max(getattr(s, name) for s in middle)
        last_max = max(getattr(s, name) for s in last)
        base = max(mid_max, least.get(name, 0))
        series[name] = {"middle_max": mid_max, "last_max": last_max, "compared_to": base,
                        "flat": last_max <= FLAT_FACTOR * base}
    if middle[0].t_s < warm_up:
        return {"verdict": "inconclusive", "series": series,
                "reason": f"the middle third starts at {middle[0].t_s:.0f}s, before the "
                          f"retention's warm-up of {warm_up:.0f}s: run longer"}
    flat = all(s["flat"] for s in series.values())
    return {"verdict": "flat" if flat else "growing", "series": series}


def children(env: dict[str, str], log_dir: Path) -> list[Child]:
    """The producer, one relay and two consumers of the torture group (no faults armed)."""
    consumer_env = {"OUTBOX_GROUP": harness.GROUP, "OUTBOX_STREAMS": ",".join(STREAMS),
                    "OUTBOX_BLOCK_MS": "200", "OUTBOX_BATCH_SIZE": "200"}
    made = [Child("producer", "producer", [sys.executable, "-m", "torture.load"], env, log_dir),
            Child("relay-0", "relay", outbox_argv("relay"),
                  {**env, "OUTBOX_NODE_ID": "relay-0", "OUTBOX_BATCH_SIZE": "500"}, log_dir)]
    for i in range(2):
        made.append(Child(f"consumer-{i}", "consumer",
                          outbox_argv("consume", "--app", "torture.app:handlers"),
                          {**env, **consumer_env, "OUTBOX_CONSUMER": f"c{i}"}, log_dir))
    return made


def take_sample(engine: Engine, client: redis.Redis, prefix: str, t_s: float,
                previous: Sample | None) -> Sample:
    """One :class:`Sample` (a few counts and ``XLEN``/``XINFO`` calls)."""
    stream_keys = [keys.stream_key(prefix, s, p) for s in STREAMS
                   for p in range(harness.PARTITIONS)]
    with engine.connect() as conn:
        def count(table: Any, *where: Any) -> int:
            return int(conn.execute(select(func.count()).select_from(table).where(*where))
                       .scalar_one())

        # Received before enqueued: a receipt is never counted for an event not counted yet.
        received = count(ledger.receipts, ledger.receipts.c.group_name == harness.GROUP)
        enqueued = count(ledger.events)
        backlog = count(outbox, outbox.c.delivered_at_ms.is_(None))
        rows, receipts, heads = count(outbox), count(inbox), count(inbox_heads)
    dead = [keys.dead_letter_key(prefix, s, p) for s in STREAMS
            for p in range(harness.PARTITIONS)]
    elapsed = t_s - (previous.t_s if previous else 0.0)
    rate = (enqueued - (previous.enqueued if previous else 0)) / elapsed if elapsed > 0 else 0.0
    return Sample(
        t_s=round(t_s, 1), enqueued=enqueued, rate=round(rate, 1), backlog=backlog,
        unreceived=enqueued - received, outbox_events=rows, outbox_inbox=receipts,
        outbox_inbox_heads=heads,
        stream_entries=sum(int(client.xlen(k)) for k in stream_keys),
        dead_letters=sum(int(client.xlen(k)) for k in dead),
        consumers=check.consumers_per_group(client, stream_keys).get(harness.GROUP, 0),
    )


def run_soak(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """One database's soak; its report."""
    tag = uuid.uuid4().hex[:10]
    retention = dict(QUICK if args.quick else SOAK)
    every = float(args.sample_every)
    workdir = Path(tempfile.mkdtemp(prefix=f"outbox-soak-{kind}-"))
    (workdir / "logs").mkdir()
    server = RedisServer(workdir / "redis")
    server.start()
    kids: list[Child] = []
    samples: list[Sample] = []
    try:
        with harness.database(kind, workdir, args.pg_url, tag, args.keep) as url:
            engine = db.make_engine(url.replace("application_name=outbox-", "application_name=h-"))
            db.upgrade(engine)
            app.create_tables(engine)
            ledger.install(engine)
            prefix = f"soak{tag}"
            env = {**base_env(), "OUTBOX_DATABASE_URL": url, "OUTBOX_REDIS_URL": server.url,
                   "OUTBOX_KEY_PREFIX": prefix, "OUTBOX_PARTITIONS": str(harness.PARTITIONS),
                   "OUTBOX_LOG_LEVEL": "WARNING", "TORTURE_RATE": str(args.rate),
                   "TORTURE_WRITERS": str(args.writers), "TORTURE_HOLD_MS": "0",
                   "TORTURE_RUNS_SHARE": "0", **retention}
            kids = children(env, workdir / "logs")
            for child in kids[1:]:  # daemons first: the producer's first events are read
                child.start()
            kids[0].start()
            client = server.client()
            started = time.monotonic()
            log.info("%s soak: %.0f s at %.0f events/s (work dir %s)", kind, args.duration,
                     args.rate, workdir)
            exits: list[str] = []
            while (elapsed := time.monotonic() - started) < args.duration:
                time.sleep(max(0.0, min(every * (len(samples) + 1), args.duration) - elapsed))
                samples.append(take_sample(engine, client, prefix,
                                           time.monotonic() - started,
                                           samples[-1] if samples else None))
                log.info("%s", asdict(samples[-1]))
                exits += [f"{c.name}: exit {c.returncode()}" for c in kids if not c.alive()]
                if exits:
                    break
            kids[0].stop()
            drain = _drain(kids, engine, server, prefix)
            for child in kids:
                child.stop()
            verdict = check.verify(engine, client, prefix, [harness.GROUP], check_runs=False,
                                   retention=harness.retention_of(retention))
            retained = harness.retention_report(engine, client, prefix, STREAMS)
            engine.dispose()
    finally:
        for child in kids:
            child.stop()
        server.stop()
    flat = flatness(samples, warm_up_s(retention),
                    {"stream_entries": stream_ceiling(retention, args.rate)})
    violations = verdict.violations(runs_must_finish=False)
    violations += [f"unexpected_exit:{e}" for e in exits]
    if drain is None:
        violations.append("did_not_drain")
    if flat["verdict"] == "growing":
        violations += [f"growing:{n}" for n, s in flat["series"].items() if not s["flat"]]
    report = {
        "database": kind, "mode": "soak", "quick": args.quick, "duration_s": args.duration,
        "rate": args.rate, "sample_every_s": every, "retention": retention,
        "warm_up_s": warm_up_s(retention), "samples": [asdict(s) for s in samples],
        "flatness": flat, "drain_seconds": None if drain is None else round(drain, 1),
        "after": retained, **verdict.as_dict(), "violations": violations,
    }
    if not args.keep and not violations:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        report["work_dir"] = str(workdir)
    return report


def _drain(kids: list[Child], engine: Engine, server: RedisServer, prefix: str) -> float | None:
    """Seconds until everything enqueued was delivered and received (None: not in 300 s)."""
    started = time.monotonic()
    while time.monotonic() - started < 300:
        if harness.settled(engine, server.client(), prefix, False, STREAMS):
            return time.monotonic() - started
        time.sleep(0.5)
    return None


SAMPLE_COLUMNS = (
    ("t_s", "t s"), ("rate", "ev/s"), ("backlog", "backlog"), ("unreceived", "unreceived"),
    ("outbox_events", "outbox rows"), ("outbox_inbox", "receipts"),
    ("outbox_inbox_heads", "heads"), ("stream_entries", "XLEN sum"),
    ("dead_letters", "dead"), ("consumers", "consumers"),
)


def render(report: dict[str, Any]) -> str:
    """The samples as a table, then the flatness and the checks."""
    rows = report["samples"]
    widths = [max(len(h), *(len(str(r[k])) for r in rows)) if rows else len(h)
              for k, h in SAMPLE_COLUMNS]
    lines = [f"{report['database']} soak: {report['duration_s']:.0f} s at {report['rate']:.0f}"
             f" events/s, retention {report['retention']}",
             "  ".join(h.rjust(w) for (_, h), w in zip(SAMPLE_COLUMNS, widths, strict=True))]
    lines += ["  ".join(str(r[k]).rjust(w) for (k, _), w in zip(SAMPLE_COLUMNS, widths,
                                                                 strict=True)) for r in rows]
    flat = report["flatness"]
    lines.append(f"flatness (last third max <= {FLAT_FACTOR} x middle third max): "
                 f"{flat['verdict']}" + (f" ({flat['reason']})" if "reason" in flat else ""))
    lines += [f"  {name:<20} middle {s['middle_max']:>9}  last {s['last_max']:>9}  "
              f"{'flat' if s['flat'] else 'GROWING'}" for name, s in flat["series"].items()]
    lines.append(
        f"checks: events {report['events']}, lost {report['lost']}, duplicate entries "
        f"{report['duplicate_entries']}, duplicate effects {report['duplicate_effects']}, "
        f"order violations {report['order_violations']}/{report['stream_order_violations']}, "
        f"rows pruned {report['rows_pruned']}, receipts pruned {report['receipts_pruned']}, "
        f"entries trimmed {report['entries_trimmed']}; drained in {report['drain_seconds']} s")
    verdict = "OK" if not report["violations"] else "VIOLATIONS: " + ", ".join(
        report["violations"])
    lines.append(f"verdict: {verdict}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Run the soak on each database asked for; print, write JSON; 1 on any violation."""
    out = OUT if args.out == harness.OUT else args.out
    kinds = ["sqlite", "postgresql"] if args.database == "both" else [args.database]
    reports = [run_soak(kind, args) for kind in kinds]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"mode": "soak", "runs": reports}, indent=2) + "\n")
    print("\n\n".join(render(r) for r in reports))
    print(f"\nreport written to {out}")
    return 1 if any(r["violations"] for r in reports) else 0
