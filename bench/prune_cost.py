"""What retention costs the relay at full speed (PostgreSQL), and what its index costs a settle.

``python -m bench.prune_cost [--events 100000] [--old 800000] [--runs 5] [--only prune,index]``

**Pruning.** Each run gets a fresh schema holding ``--old`` delivered rows 30 days old (below
a trim floor, as after the relay trimmed their entries, so a repair leaves them alone) and a
backlog of ``--events`` undelivered rows. One :class:`relay.daemon.Relay` in this process
drains the backlog (``run(until_idle=True)``, timed without the seeding) in one of three modes,
run back to back in each repetition (their order alternates):

* ``none``: nothing prunes (the reference);
* ``concurrent``: another process prunes the old rows without pause during the whole drain
  (``relay.prune.prune_delivered``, batches of 1,000, one transaction each: another relay's
  retention task in catch-up mode, or ``outbox prune``, at full speed: the worst case);
* ``in_loop``: the relay's own retention task (``cli.prune.register_relay``, the daemon's
  wiring: up to 5 batches of 1,000 per pass, a pass every second while old rows remain, run
  between rounds).

Reported: events/s per mode and, per repetition, the ratio to that repetition's ``none`` run
(median [min-max] of those ratios: a machine whose load drifts between repetitions moves both
sides of a ratio alike), the rows pruned meanwhile, and for ``in_loop`` the loop time its
passes took (``loop_share``: a figure load noise hardly moves).

**Index.** ``ix_outbox_events_delivered`` (partial, ``delivered_at_ms IS NOT NULL``) makes a
settle add each delivered row to one more index. The settle's own statement
(``relay.store._mark_delivered``, 500 rows per transaction, as the relay commits them) marks a
``--events`` backlog in a fresh schema with the index and in one where it was dropped,
alternately; reported: ms per 500-row settle statement and the ratio. One JSON object goes to
stdout at the end (each run's line before it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from typing import Any

from sqlalchemy import text

from bench import env
from outbox_relay.shared.db import now_ms

CTX = multiprocessing.get_context("spawn")
RETENTION_S = 7 * 86400.0
PRUNE_BATCH = 1000
DAY_MS = 86_400_000

OLD_ROWS = text("""
INSERT INTO outbox_events (event_id, stream, partition, aggregate_type, aggregate_id, revision,
    type, source, payload, headers, created_at_ms, available_at_ms, attempts, entry_id,
    delivered_at_ms)
SELECT 'old-' || g, :stream, g % :partitions, 'order', 'old-' || g, 1, 'bench.created',
    'bench', :payload, '{}', :old_ms, :old_ms, 1, :old_ms || '-' || g,
    :old_ms + g / 100
FROM generate_series(1, :n) AS g
""")


def _pruner(url: str, ready: Any, start: Any, stop: Any, results: Any) -> None:
    """Child process: prune old delivered rows without pause from ``start`` until ``stop``."""
    from outbox_relay.relay.prune import prune_delivered
    from outbox_relay.shared import db

    engine = db.make_engine(url)
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
    ready.put("pruner")
    start.wait()
    total = batches = 0
    t0 = time.perf_counter()
    while not stop.is_set():
        result = prune_delivered(engine, RETENTION_S, batch=PRUNE_BATCH, max_batches=1)
        total += result.rows
        batches += 1
        if result.rows == 0:
            break
    results.put({"rows": total, "batches": batches, "seconds": time.perf_counter() - t0})
    engine.dispose()


def _prepare(target: env.Target, events: int, old: int, partitions: int) -> None:
    target.reset(partitions)
    if old:
        old_ms = now_ms() - 30 * DAY_MS
        with target.engine.begin() as conn:
            conn.execute(OLD_ROWS, {"stream": env.STREAM, "partitions": partitions,
                                    "old_ms": old_ms, "n": old,
                                    "payload": '{"n":1,"sku":"A-1","qty":2}'})
            # Their entries were trimmed on purpose: every partition's floor is above them.
            conn.execute(text(
                "INSERT INTO outbox_stream_trims (stream, partition, floor_entry_id, trimmed, "
                "updated_at_ms) SELECT :stream, p, :floor, 0, :now "
                "FROM generate_series(0, :last) AS p"),
                {"stream": env.STREAM, "floor": f"{old_ms + old // 100 + 1}-0",
                 "now": now_ms(), "last": partitions - 1})
    target.seed(events, partitions)  # also VACUUM ANALYZE


def drain(mode: str, events: int, old: int, partitions: int, batch: int) -> dict[str, Any]:
    """One run of ``mode`` in a fresh schema; the drain's events/s and what was pruned."""
    from outbox_relay.cli import prune as retention
    from outbox_relay.relay.daemon import Relay
    from outbox_relay.shared.redis_conn import connect_redis
    from outbox_relay.shared.settings import RelaySettings

    target = env.open_target("postgresql", tempfile.gettempdir())
    procs: list[Any] = []
    try:
        _prepare(target, events, old, partitions)
        settings = RelaySettings.model_validate({
            "database_url": target.url, "redis_url": env.REDIS_URL, "key_prefix": target.prefix,
            "partitions": partitions, "batch_size": batch, "node_id": "prune-bench",
            "retention_delivered": RETENTION_S if mode == "in_loop" else 0,
            "prune_batch": PRUNE_BATCH,
        })
        relay = Relay(settings, target.engine, connect_redis(env.REDIS_URL))
        retention.register_relay(relay, settings)
        spent = _time_retention(relay)
        ready, start, stop, results = CTX.Queue(), CTX.Event(), CTX.Event(), CTX.Queue()
        if mode == "concurrent":
            proc = CTX.Process(target=_pruner, args=(target.url, ready, start, stop, results),
                               daemon=True)
            proc.start()
            procs.append(proc)
            ready.get(timeout=120)
            start.set()
        t0 = time.perf_counter()
        stats = relay.run(until_idle=True)
        elapsed = time.perf_counter() - t0
        stop.set()
        assert stats.delivered == events, stats
        out: dict[str, Any] = {"mode": mode, "events_per_s": round(events / elapsed),
                               "seconds": round(elapsed, 3)}
        if mode == "concurrent":
            pruned = results.get(timeout=120)
            out["pruned"] = pruned["rows"]
            out["pruned_per_s"] = round(pruned["rows"] / pruned["seconds"])
            out["pruner_outlasted_drain"] = pruned["rows"] < old
        if mode == "in_loop":
            assert relay.prune_stats is not None
            out["pruned"] = relay.prune_stats.outbox_rows
            out["passes"] = relay.prune_stats.passes
            out["prune_seconds"] = round(spent[0], 3)  # loop time spent in retention passes
            out["loop_share"] = round(spent[0] / elapsed, 4)
        return out
    finally:
        for proc in procs:
            proc.join(timeout=60)
        target.close()


def settle_ab(index: bool, events: int, partitions: int, batch: int) -> dict[str, Any]:
    """Mark a seeded backlog delivered with the settle's statement, ``batch`` rows per
    transaction, with or without the delivered index; ms per statement."""
    from outbox_relay.relay.store import _mark_delivered

    target = env.open_target("postgresql", tempfile.gettempdir())
    try:
        if not index:
            with target.engine.begin() as conn:
                conn.execute(text("DROP INDEX ix_outbox_events_delivered"))
        target.reset(partitions)
        target.seed(events, partitions)
        with target.engine.connect() as conn:
            rows = conn.execute(text(
                "SELECT partition, seq FROM outbox_events ORDER BY partition, seq")).all()
        batches: list[tuple[int, list[tuple[int, str]]]] = []
        now = now_ms()
        for p in range(partitions):
            seqs = [seq for part, seq in rows if part == p]
            batches += [(p, [(s, f"{now}-{s}") for s in seqs[i : i + batch]])
                        for i in range(0, len(seqs), batch)]
        t0 = time.perf_counter()
        for p, pairs in batches:
            with target.engine.begin() as conn:
                _mark_delivered(conn, p, pairs, now)
        elapsed = time.perf_counter() - t0
        return {"mode": "index" if index else "no_index",
                "ms_per_settle": round(elapsed * 1000 / len(batches), 3),
                "rows_per_s": round(events / elapsed)}
    finally:
        target.close()


def _time_retention(relay: Any) -> list[float]:
    """Wrap the relay's retention task (if any) to add up the loop time its passes take."""
    spent = [0.0]
    for task in relay.periodic:
        if task.name == "retention":
            inner = task.run

            def timed(inner: Any = inner) -> None:
                t0 = time.perf_counter()
                try:
                    inner()
                finally:
                    spent[0] += time.perf_counter() - t0

            task.run = timed
    return spent


def summarize(
    reps: list[dict[str, dict[str, Any]]], reference: str, metric: str
) -> dict[str, Any]:
    """Per mode: median [min-max] of ``metric``, and of its per-repetition ratio to
    ``reference``."""
    out: dict[str, Any] = {}
    for mode in reps[0]:
        values = [rep[mode][metric] for rep in reps]
        ratios = [rep[mode][metric] / rep[reference][metric] for rep in reps]
        out[mode] = {"median": statistics.median(values), "min": min(values),
                     "max": max(values), "ratio_median": round(statistics.median(ratios), 3),
                     "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prune_cost", description=__doc__)
    parser.add_argument("--events", type=int, default=100_000, help="backlog to drain")
    parser.add_argument("--old", type=int, default=800_000, help="old delivered rows")
    parser.add_argument("--runs", type=int, default=5, help="repetitions (>= 3)")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--batch", type=int, default=500, help="relay batch size")
    parser.add_argument("--only", default="prune,index", help="prune, index or both")
    args = parser.parse_args(argv)
    parts = args.only.split(",")
    prune_reps: list[dict[str, dict[str, Any]]] = []
    index_reps: list[dict[str, dict[str, Any]]] = []
    for i in range(args.runs):
        order = -1 if i % 2 else 1  # alternate the order: no mode always runs first
        if "prune" in parts:
            rep = {}
            for mode in ["none", "concurrent", "in_loop"][::order]:
                rep[mode] = drain(mode, args.events, args.old, args.partitions, args.batch)
                print(json.dumps(rep[mode]), flush=True)
            prune_reps.append(rep)
        if "index" in parts:
            rep = {}
            for with_index in [True, False][::order]:
                run = settle_ab(with_index, args.events, args.partitions, args.batch)
                rep[run["mode"]] = run
                print(json.dumps(run), flush=True)
            index_reps.append(rep)
    result: dict[str, Any] = {"events": args.events, "old": args.old, "runs": args.runs}
    if prune_reps:
        result["prune"] = summarize(prune_reps, "none", "events_per_s")
        shares = [rep["in_loop"]["loop_share"] for rep in prune_reps]
        result["prune"]["in_loop"]["loop_share"] = {
            "median": statistics.median(shares), "min": min(shares), "max": max(shares)}
        outlasted = [rep["concurrent"]["pruner_outlasted_drain"] for rep in prune_reps]
        result["prune"]["concurrent"]["pruner_outlasted_drain"] = sum(outlasted)
    if index_reps:
        result["index"] = summarize(index_reps, "no_index", "ms_per_settle")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
