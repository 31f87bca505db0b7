"""``python -m bench`` (``make bench``): every benchmark of issues 5 and 12, its table, JSON, plots.

Full mode follows the issues' sizes (50,000-event backlogs, batch sizes 100/500/2,000, a
10-minute memory run) and runs the whole suite **twice** (``--passes 2``): each figure is
printed with both passes' medians and their spread, and a spread above 15 % is flagged, so
only figures a rerun reproduces get published. ``--quick`` shrinks everything so the code is
exercised in a few minutes (one pass unless ``--passes`` says otherwise); ``--tiny`` is the
smoke run of the test suite.

Results go to ``bench/results.json`` and PNG plots to ``bench/out/``; ``--publish`` also copies
the plots to ``docs/perf/`` for docs/performance.md. Two separate runs' JSON files compare
with ``python -m bench.compare a.json b.json``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import consumer_loop, env, producers, report, scenarios, topologies
from bench.baseline import PHASES, redis_ceiling
from outbox_relay.shared import gc_pace
from torture.redis_sets import TopologyError, TopologyUnsupported

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("baseline", "relay", "consumer", "cluster", "latency", "capacity", "producer",
             "ceiling", "memory")


@dataclass(frozen=True)
class Config:
    """Sizes of one benchmark run."""

    runs: int
    relay_events: int
    batches: tuple[int, ...]
    partitions: tuple[int, ...]
    consumer_events: int
    consumer_procs: tuple[int, ...]
    consumer_batch: int
    rates: tuple[int, ...]
    rate_seconds: float
    producer_txns: int
    memory_seconds: float
    memory_rate: int
    passes: int = 1
    cluster_partitions: int = 6  # {bench:0..5} fall 2/2/2 on the 3 masters' slot ranges
    cluster_relays: int = 2
    cluster_consumers: int = 2
    one_relay_row: bool = True  # the "1 relay x n partitions" row
    # The consumer's handler rows (scenarios.consumer_handlers): one consumer in this process,
    # one partition stream of this many entries, batch consumer_batch, the rows alternated
    # this many rounds.
    handler_events: int = 20_000
    handler_rounds: int = 2
    # Issue 24, PostgreSQL: bare / enqueue / enqueue without NOTIFY at these writer thread
    # counts, in interleaved blocks of producer_block_s, producer_rounds rounds.
    producer_threads: tuple[int, ...] = (1, 4, 16)
    producer_block_s: float = 3.0
    producer_rounds: int = 3
    # Issue 24, the sustained-rate sweep (:func:`capacity`): these offered rates, each for
    # capacity_seconds, by capacity_threads writer threads (one event per transaction),
    # through one relay and one consumer whose handler writes one row per event.
    capacity_rates: tuple[int, ...] = (1000, 2000, 5000, 10000)
    capacity_seconds: float = 10.0
    capacity_threads: int = 8
    # ...and the same sweep again with writers that commit the events due by then, at most
    # this many per transaction (what the pipeline carries when the writers are not the limit).
    capacity_batch: int = 10


FULL = Config(2, 50_000, (100, 500, 2000), (1, 2, 4), 20_000, (1, 2), 500,
              (100, 1000, 5000), 10.0, 1000, 600.0, 1000, passes=2)
QUICK = Config(1, 3_000, (500,), (1, 2), 2_000, (1, 2), 500, (100, 1000), 2.0, 200, 6.0, 500,
               handler_events=5_000, producer_block_s=1.5, capacity_rates=(1000, 2000, 5000),
               capacity_seconds=3.0)
TINY = Config(1, 600, (100,), (2,), 400, (1,), 100, (200,), 1.0, 100, 2.0, 200,
              cluster_relays=1, cluster_consumers=1, one_relay_row=False,
              handler_events=400, handler_rounds=1, producer_threads=(1, 4),
              producer_block_s=0.2, producer_rounds=1, capacity_rates=(200,),
              capacity_seconds=1.0, capacity_threads=2)
# The tiny smoke run (a test with a 180 s limit) leaves the cluster rows out unless asked.
TINY_SCENARIOS = tuple(s for s in SCENARIOS if s != "cluster")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="small sizes, one run each")
    p.add_argument("--tiny", action="store_true", help="smallest sizes (the pytest smoke run)")
    p.add_argument("--databases", default="postgresql,sqlite", help="comma-separated kinds")
    p.add_argument("--only", help="comma-separated scenarios (default: all; " +
                   ",".join(SCENARIOS) + ")")
    p.add_argument("--runs", type=int, help="repetitions of each figure per pass")
    p.add_argument("--passes", type=int,
                   help="times the whole suite runs, for the spread (default 2 / quick 1)")
    p.add_argument("--memory-seconds", type=float, help="length of the memory run")
    p.add_argument("--events", type=int, help="backlog size of the relay runs")
    p.add_argument("--consumer-events", type=int, help="stream backlog of the consumer runs")
    p.add_argument("--handler-events", type=int,
                   help="stream backlog of the consumer handler rows (one-row, batch, no-op "
                   "handler and the hand-written loop)")
    p.add_argument("--handler-rounds", type=int,
                   help="rounds of the consumer handler rows per pass (order reversed each)")
    p.add_argument("--rate-seconds", type=float, help="length of each latency run")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results.json")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    p.add_argument("--publish", action="store_true", help="copy the plots to docs/perf/")
    return p.parse_args(argv)


def configure(args: argparse.Namespace) -> Config:
    base = TINY if args.tiny else QUICK if args.quick else FULL
    changes: dict[str, Any] = {}
    if args.runs:
        changes["runs"] = args.runs
    if args.passes:
        changes["passes"] = args.passes
    if args.memory_seconds:
        changes["memory_seconds"] = args.memory_seconds
    if args.events:
        changes["relay_events"] = args.events
    if args.consumer_events:
        changes["consumer_events"] = args.consumer_events
    if args.rate_seconds:
        changes["rate_seconds"] = args.rate_seconds
    if args.handler_events:
        changes["handler_events"] = args.handler_events
    if args.handler_rounds:
        changes["handler_rounds"] = args.handler_rounds
    return Config(**{**asdict(base), **changes})


def repeat(runs: int, measure: Any) -> report.Summary:
    return report.summary([measure() for _ in range(runs)])


def repeat_runs(runs: int, measure: Any) -> report.Summary:
    """A summary of the rates, with the median CPU use (CPU-seconds per second) per side."""
    return runs_summary([measure() for _ in range(runs)])


def runs_summary(done: list[scenarios.Run]) -> report.Summary:
    """:func:`repeat_runs`'s summary of runs already measured."""
    s = report.summary([r.rate for r in done])
    s["cpu"] = {k: statistics.median(r.cpu[k] / r.wall for r in done) for k in done[0].cpu}
    return s


def single_batch(cfg: Config) -> int:
    """The batch size of the rows measured at one batch size only (the middle one)."""
    return cfg.batches[len(cfg.batches) // 2]


def bench_database(
    target: env.Target, cfg: Config, only: set[str], cdfs: dict[str, Any], workdir: Path
) -> dict[str, Any]:
    """Every per-database scenario on one target (one pass)."""
    out: dict[str, Any] = {}
    n = cfg.runs
    say = _say(target.kind)
    alternated: dict[str, list[scenarios.Run]] = {}
    if only & {"baseline", "relay"}:
        alternated = baseline_rows(target, cfg, "relay" in only and 1 in cfg.partitions, out,
                                   say)
    if "relay" in only:
        out["relay"] = relay_rows(target, cfg, say, alternated)
    if "consumer" in only:
        out["consumer"] = {}
        for procs in cfg.consumer_procs:
            say(f"consumer {procs} proc")
            out["consumer"][f"{procs} proc"] = repeat_runs(n, lambda p=procs: (
                scenarios.consumer_throughput(target, cfg.consumer_events, p,
                                              cfg.consumer_batch, 4)))
        say(f"consumer handlers: {', '.join(consumer_loop.VARIANTS)} x {cfg.handler_rounds} "
            f"rounds of {cfg.handler_events} entries")
        out["consumer_handlers"] = handler_rows(target, cfg)
    if "cluster" in only:
        out["cluster"] = cluster_rows(target, cfg, workdir, say)
    if "latency" in only:
        out["latency"] = latency(target, cfg, cdfs, say)
    if "capacity" in only:
        out["capacity"] = capacity(target, cfg, say)
    if "producer" in only:
        out["producer"] = producer_rows(target, cfg, say)
    if "ceiling" in only:
        out["ceiling"] = {}
        for b in cfg.batches:
            say(f"redis ceiling batch {b}")
            out["ceiling"][str(b)] = repeat(
                n, lambda b=b: redis_ceiling(target, cfg.relay_events, b))
    report.add_ratios(out, target.kind)
    return out


def baseline_rows(
    target: env.Target, cfg: Config, pair: bool, out: dict[str, Any],
    say: Callable[[str], None],
) -> dict[str, list[scenarios.Run]]:
    """The strong baseline at each batch size (``out["baseline"]``, its phases in
    ``out["baseline_phases_ms"]``); with ``pair``, each run paired with a run of one relay on
    one partition at the same batch size (the loop first in even rounds, the relay first in
    odd ones, so what one run leaves behind — vacuum, checkpoints — does not always land on
    the same side), whose runs are returned (``b<batch> p1``) for :func:`relay_rows`: the
    ratio the targets name is then taken between runs seconds apart."""
    out["baseline"], out["baseline_phases_ms"] = {}, {}
    alternated: dict[str, list[scenarios.Run]] = {}
    for b in cfg.batches:
        say(f"baseline batch {b}" + (f", alternated with relay batch {b} x 1" if pair else ""))
        phases: dict[str, float] = {}
        rates: list[float] = []
        relays: list[scenarios.Run] = []
        for number in range(cfg.runs):
            if pair and number % 2:
                relays.append(scenarios.relay_throughput(target, cfg.relay_events, 1, b))
            rates.append(scenarios.baseline(target, cfg.relay_events, b, phases))
            if pair and not number % 2:
                relays.append(scenarios.relay_throughput(target, cfg.relay_events, 1, b))
        out["baseline"][str(b)] = report.summary(rates)
        if pair:
            alternated[f"b{b} p1"] = relays
        batches = cfg.runs * -(-cfg.relay_events // b)
        out["baseline_phases_ms"][str(b)] = {k: phases.get(k, 0.0) * 1000 / batches
                                             for k in PHASES}
    return alternated


def producer_rows(
    target: env.Target, cfg: Config, say: Callable[[str], None]
) -> dict[str, Any]:
    """One transaction with and without ``enqueue``; on PostgreSQL also bare / enqueue / no
    notify at several writer thread counts (:func:`producers.concurrent`)."""
    say("producer overhead")
    pairs = [scenarios.producer_overhead(target, cfg.producer_txns) for _ in range(cfg.runs)]
    out: dict[str, Any] = {
        "bare_ms": report.summary([a for a, _ in pairs]),
        "enqueue_ms": report.summary([b for _, b in pairs]),
        "ratio": report.summary([b / a for a, b in pairs]),
    }
    if target.kind == "postgresql":
        say(f"producers at {', '.join(map(str, cfg.producer_threads))} threads: bare / "
            f"enqueue / no notify, {cfg.producer_rounds} rounds of "
            f"{cfg.producer_block_s:g} s blocks")
        out["threads"] = producers.concurrent(
            target, cfg.producer_threads, cfg.producer_block_s, cfg.producer_rounds)
    return out


def handler_rows(target: env.Target, cfg: Config) -> dict[str, Any]:
    """One consumer with the no-op, one-row and batch handler, and the hand-written loop
    (:mod:`bench.consumer_loop`), alternated: claims/s, CPU µs per event; the ratios to the
    loop are added by :func:`report.add_ratios`."""
    runs = scenarios.consumer_handlers(target, cfg.handler_events, cfg.consumer_batch,
                                       cfg.handler_rounds)
    out: dict[str, Any] = {}
    for variant, done in runs.items():
        s = report.summary([r.rate for r in done])
        s["cpu_us_per_event"] = {k: statistics.median(r.cpu[k] / (r.rate * r.wall) * 1e6
                                                      for r in done) for k in done[0].cpu}
        out[variant] = s
    return {"events": cfg.handler_events, "batch": cfg.consumer_batch,
            "rounds": cfg.handler_rounds, "partitions": 1, "rows": out}


def relay_rows(
    target: env.Target, cfg: Config, say: Callable[[str], None],
    alternated: dict[str, list[scenarios.Run]] | None = None,
) -> dict[str, Any]:
    """``b<batch> p<n>``: n relay processes, one partition each; ``b<batch> p<n> r1``: one
    relay process owning all n partitions (it must not be slower than with one).

    ``alternated``: the rows already measured run for run with the strong baseline of their
    batch size (:func:`baseline_rows`, the 1 x 1 rows), marked so: their ratio to the loop
    is also taken run by run (``paired_ratios``, :func:`report.add_ratios`). Measured minutes
    apart, a machine whose speed drifts moved the ratio the targets are read from."""
    out: dict[str, Any] = {}
    for b in cfg.batches:
        for p in cfg.partitions:
            done = (alternated or {}).get(f"b{b} p{p}")
            if done:
                out[f"b{b} p{p}"] = {**runs_summary(done), "alternated_with_baseline": True}
                continue
            say(f"relay batch {b} x {p} partitions/relays")
            out[f"b{b} p{p}"] = repeat_runs(cfg.runs, lambda b=b, p=p: (
                scenarios.relay_throughput(target, cfg.relay_events, p, b)))
    most = max(cfg.partitions)
    if most > 1 and cfg.one_relay_row:
        b = single_batch(cfg)
        say(f"relay batch {b}: 1 relay x {most} partitions")
        out[f"b{b} p{most} r1"] = repeat_runs(cfg.runs, lambda: (
            scenarios.relay_throughput(target, cfg.relay_events, most, b, relays=1)))
    return out


def latency(
    target: env.Target, cfg: Config, cdfs: dict[str, Any], say: Callable[[str], None]
) -> dict[str, Any]:
    """End-to-end percentiles per rate, and the same per stage (:data:`scenarios.STAGES`);
    on PostgreSQL also ``<rate> no notify`` rows, the producer made with ``notify=False``
    (the relay finds its rows by polling), for rates up to 1,000 ev/s."""
    out: dict[str, Any] = {}
    middle = cfg.rates[len(cfg.rates) // 2]
    quiet = [r for r in cfg.rates if r <= 1000] if target.kind == "postgresql" else []
    for rate, notify in [(r, True) for r in cfg.rates] + [(r, False) for r in quiet]:
        name = str(rate) if notify else f"{rate} no notify"
        say(f"latency at {rate} ev/s" + ("" if notify else ", producer without NOTIFY"))
        runs = [scenarios.pipeline(target, rate, cfg.rate_seconds, 4, notify=notify)
                for _ in range(cfg.runs)]
        cdfs.setdefault("end_to_end", {})[name] = runs[0].latencies_ms
        if rate == middle and notify:
            cdfs["stages"] = {"rate": rate, **runs[0].stages_ms}
        row: dict[str, Any] = {
            q: report.summary([report.percentile(r.latencies_ms, f) for r in runs])
            for q, f in report.QUANTILES
        }
        # Events still unclaimed at the deadline (seconds x 3 + 60): the offered rate was
        # more than the pipeline could take; their latency is not in the percentiles.
        row["missing"] = max(r.missing for r in runs)
        row["stages"] = {
            stage: {q: report.summary([report.percentile(r.stages_ms[stage], f) for r in runs])
                    for q, f in report.QUANTILES}
            for stage in scenarios.STAGES
        }
        row["stages_measured"] = min(len(r.stages_ms[scenarios.STAGES[0]]) for r in runs)
        row["stage_histogram"] = {stage: report.histogram(runs[0].stages_ms[stage])
                                  for stage in scenarios.STAGES}
        out[name] = row
    return out


CAPACITY_P99_MS = 100.0
"""The sweep's bar: the capacity is the highest offered rate claimed whole with p99 under it."""
CAPACITY_SHARE = 0.9
"""...and claimed at no less than this share of the offered rate (see :func:`capacity`)."""


def capacity(
    target: env.Target, cfg: Config, say: Callable[[str], None]
) -> dict[str, Any]:
    """The sustained-rate sweep: each offered rate of ``cfg.capacity_rates`` for
    ``capacity_seconds`` by ``capacity_threads`` writer threads, one event per transaction,
    through one relay and one consumer whose handler writes one row per event (4 partitions);
    then, under ``batched``, the same sweep by writers that commit the events due by then, up
    to ``capacity_batch`` per transaction. One event per transaction is what a service's
    request handlers do, and on a small machine those writers are the limit (their commits,
    not the pipeline); the batched sweep shows what the relay and the consumer carry.
    Per rate: the rate the writers committed (``produced``: below the offered one when they
    could not offer it), the rate claimed end to end (``achieved``), the end-to-end
    percentiles and what was left unclaimed at the deadline. ``capacity``: the highest
    offered rate with nothing left unclaimed, p99 at most :data:`CAPACITY_P99_MS` and at
    least :data:`CAPACITY_SHARE` of it claimed per second (0 when none is): a rate the
    writers could not offer is not one the pipeline was shown to carry."""
    rows = _sweep(target, cfg, say, 1)
    batched = _sweep(target, cfg, say, cfg.capacity_batch)
    return {"threads": cfg.capacity_threads, "seconds": cfg.capacity_seconds,
            "p99_bar_ms": CAPACITY_P99_MS, "rows": rows, "capacity": capacity_of(rows),
            "batched": {"per_txn": cfg.capacity_batch, "rows": batched,
                        "capacity": capacity_of(batched)}}


def _sweep(
    target: env.Target, cfg: Config, say: Callable[[str], None], per_txn: int
) -> dict[str, Any]:
    """One sweep of :func:`capacity`: its rows by offered rate."""
    rows: dict[str, Any] = {}
    for rate in cfg.capacity_rates:
        say(f"capacity: {rate} ev/s offered by {cfg.capacity_threads} writer threads, "
            f"up to {per_txn} event(s) per transaction, one-row handler")
        runs = [scenarios.pipeline(target, rate, cfg.capacity_seconds, 4,
                                   producer_threads=cfg.capacity_threads, one_row=True,
                                   per_txn=per_txn)
                for _ in range(cfg.runs)]
        row: dict[str, Any] = {
            q: report.summary([report.percentile(r.latencies_ms, f) for r in runs])
            for q, f in report.QUANTILES
        }
        row["achieved"] = report.summary([r.achieved for r in runs])
        row["produced"] = report.summary([r.produced for r in runs])
        row["missing"] = max(r.missing for r in runs)
        rows[str(rate)] = row
    return rows


def capacity_of(rows: dict[str, Any]) -> int:
    """The highest offered rate of a sweep's ``rows`` that was claimed whole (see
    :func:`capacity`); run again on the rows merged over the passes (a median of two passes'
    capacities would be a rate nobody offered)."""
    kept_up = [int(rate) for rate, row in rows.items()
               if not row["missing"] and row["p99"]["median"] <= CAPACITY_P99_MS
               and row["achieved"]["median"] >= CAPACITY_SHARE * int(rate)]
    return max(kept_up, default=0)


def cluster_rows(
    target: env.Target, cfg: Config, workdir: Path, say: Callable[[str], None]
) -> dict[str, Any]:
    """Relay and consumer throughput against a 1-master and a 3-master Redis Cluster, same
    partitions, processes and data, runs alternating between the two, and where the time
    went (CPU seconds per second of the relay/consumer processes, their database backends
    and the Redis masters)."""
    p, b = cfg.cluster_partitions, single_batch(cfg)
    out: dict[str, Any] = {"partitions": p, "batch": b, "relays": cfg.cluster_relays,
                           "consumers": cfg.cluster_consumers, "cores": os.cpu_count()}
    specs = [("1 master", 1), ("3 masters", 3)]
    try:
        with topologies.started(specs, workdir / f"cluster-{target.kind}") as tops:
            runs: dict[str, dict[str, list[scenarios.Run]]] = {
                t.name: {"relay": [], "consumer": []} for t in tops}
            for _ in range(cfg.runs):
                for t in tops:
                    say(f"cluster {t.name}: {cfg.cluster_relays} relays x {p} partitions")
                    runs[t.name]["relay"].append(scenarios.relay_throughput(
                        target, cfg.relay_events, p, b, cfg.cluster_relays, t))
                for t in tops:
                    say(f"cluster {t.name}: {cfg.cluster_consumers} consumers")
                    runs[t.name]["consumer"].append(scenarios.consumer_throughput(
                        target, cfg.consumer_events, cfg.cluster_consumers, cfg.consumer_batch,
                        p, t))
            for t in tops:
                row: dict[str, Any] = {"masters": len(t.masters),
                                       "partitions_per_master": t.partitions_per_master(
                                           env.STREAM, p),
                                       "redis_commands": report.top_commands(t.commandstats())}
                for side, done in runs[t.name].items():
                    s = report.summary([r.rate for r in done])
                    s["cpu"] = {k: statistics.median(r.cpu[k] / r.wall for r in done)
                                for k in done[0].cpu}
                    row[side] = s
                out[t.name] = row
    except (TopologyUnsupported, TopologyError) as err:
        say(f"cluster rows skipped: {err}")
        out["skipped"] = str(err)
    return out


def memory(target: env.Target, cfg: Config) -> dict[str, Any]:
    """RSS of relay and consumer over a steady run; growth is measured after a warm-up."""
    _say(target.kind)(f"memory: {cfg.memory_seconds:.0f} s at {cfg.memory_rate} ev/s")
    every = max(cfg.memory_seconds / 60, 0.5)
    run = scenarios.pipeline(target, cfg.memory_rate, cfg.memory_seconds, 4, sample_every=every,
                             record=False)
    procs = {}
    for name, samples in run.rss_kb.items():
        warm_index = max(1, len(samples) // 10)
        warm, end = samples[warm_index][1], samples[-1][1]
        procs[name] = {"start_kb": samples[0][1], "warm_kb": warm, "end_kb": end,
                       "growth_pct": (end - warm) / warm * 100, "samples": samples}
    return {"database": target.kind, "rate": cfg.memory_rate,
            "seconds": cfg.memory_seconds, "processes": procs}


HANDLER_TARGETS = {"one-row": 0.6, "batch": 0.85, "no-op": 0.8, "async one-row": 0.5}
"""Issue 23: each handler row's claims/s over the hand-written loop's, on PostgreSQL."""


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issues' targets, each with the measured value and whether it is met."""
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, goal: str, met: bool) -> None:
        if value is not None:
            out.append({"name": name, "value": value, "goal": goal, "met": met})

    for kind, r in results["databases"].items():
        out += relay_targets(kind, r.get("relay", {}))
        if kind == "postgresql":
            out += postgresql_targets(r)
        lat = r.get("latency", {}).get("1000")
        if lat:
            goal = 20.0 if kind == "postgresql" else 100.0
            add(f"{kind} p99 at 1000 ev/s (ms)", lat["p99"]["median"], f"<= {goal:g}",
                lat["p99"]["median"] <= goal)
        if "producer" in r:
            ratio = r["producer"]["ratio"]["median"]
            add(f"{kind} producer overhead ratio", ratio, "<= 1.1", ratio <= 1.1)
            out += producers.targets(kind, r["producer"])
    for name, v in results.get("memory", {}).get("processes", {}).items():
        add(f"RSS growth of {name} (%)", v["growth_pct"], "< 10", v["growth_pct"] < 10)
    return out


def postgresql_targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The consumer's claims/s and its handler rows against the hand-written loop (issue 23),
    and the sustained-rate capacity (issue 24), on PostgreSQL."""
    out: list[dict[str, Any]] = []
    for name, s in r.get("consumer", {}).items():
        if name.startswith("1 proc"):
            out.append({"name": f"postgresql consumer {name} claims/s", "value": s["median"],
                        "goal": ">= 10000", "met": s["median"] >= 10_000})
    rows = r.get("consumer_handlers", {}).get("rows", {})
    for variant, goal in HANDLER_TARGETS.items():
        ratio = rows.get(variant, {}).get("ratio")
        if ratio is not None:
            out.append({"name": f"postgresql consumer, {variant} handler / hand-written loop",
                        "value": ratio, "goal": f">= {goal}", "met": ratio >= goal})
    cap = r.get("capacity")
    if cap:
        sweeps = [("one event per transaction", cap)]
        if "batched" in cap:
            sweeps.append((f"writers committing what is due (<= {cap['batched']['per_txn']} "
                           "per transaction)", cap["batched"]))
        for shape, sweep in sweeps:
            value = float(sweep["capacity"])
            out.append({"name": f"postgresql capacity, ev/s with p99 <= "
                                f"{cap['p99_bar_ms']:g} ms, {shape}",
                        "value": value, "goal": ">= 5000", "met": value >= 5000})
    return out


def relay_targets(kind: str, relay: dict[str, Any]) -> list[dict[str, Any]]:
    """Relay / strong baseline (one relay, and the best configuration) >= 1.3; one relay
    process with n partitions not slower than with one."""
    out: list[dict[str, Any]] = []
    if not relay or not all("ratio" in s for s in relay.values()):
        return out
    best = max(s["ratio"] for s in relay.values())
    out.append({"name": f"{kind} relay (best config) / strong baseline", "value": best,
                "goal": ">= 1.3", "met": best >= 1.3})
    one = [s["ratio"] for k, s in relay.items() if k.endswith(" p1")]
    if one:
        out.insert(0, {"name": f"{kind} relay (1 relay) / strong baseline", "value": max(one),
                       "goal": ">= 1.3", "met": max(one) >= 1.3})
    for name, s in relay.items():
        alone = relay.get(name.split(" ")[0] + " p1")
        if name.endswith(" r1") and alone:
            ratio = s["median"] / alone["median"]
            out.append({"name": f"{kind} 1 relay x {name.split(' ')[1][1:]} partitions / x 1",
                        "value": ratio, "goal": ">= 1.0", "met": ratio >= 1.0})
    return out


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "load_before": os.getloadavg()}


def _say(kind: str) -> Callable[[str], None]:
    def say(text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {kind}: {text}", file=sys.stderr, flush=True)

    return say


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cfg = configure(args)
    # The in-process rows (the baselines, the relay, the consumers and their loop) run with
    # the collector paced as `outbox relay` and `outbox consume` pace it (shared/gc_pace.py).
    gc_pace.pace()
    default = TINY_SCENARIOS if args.tiny else SCENARIOS
    only = set(args.only.split(",")) if args.only else set(default)
    if unknown := only - set(SCENARIOS):
        raise SystemExit(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    kinds = [k.strip() for k in args.databases.split(",") if k.strip()]
    results: dict[str, Any] = {"mode": mode, "machine": machine(), "config": asdict(cfg),
                               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "databases": {}}
    cdfs: dict[str, dict[str, Any]] = {}
    passes: list[dict[str, Any]] = []
    began = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
    try:
        for number in range(cfg.passes):
            if cfg.passes > 1:
                print(f"[{time.strftime('%H:%M:%S')}] pass {number + 1} of {cfg.passes}",
                      file=sys.stderr, flush=True)
            databases: dict[str, Any] = {}
            for kind in kinds:
                target = env.open_target(kind, str(workdir))
                try:
                    databases[kind] = bench_database(
                        target, cfg, only, cdfs.setdefault(kind, {}) if number == 0 else {},
                        workdir)
                finally:
                    target.close()
            passes.append(databases)
        if "memory" in only and kinds:
            target = env.open_target(kinds[0], str(workdir))
            try:
                results["memory"] = memory(target, cfg)
            finally:
                target.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["databases"] = report.merge_passes(passes)
    for figures in results["databases"].values():
        if "capacity" in figures:
            figures["capacity"]["capacity"] = capacity_of(figures["capacity"]["rows"])
            if "batched" in figures["capacity"]:
                batched = figures["capacity"]["batched"]
                batched["capacity"] = capacity_of(batched["rows"])
    if len(passes) > 1:
        results["passes"] = passes
        results["spread"] = report.spread_rows(passes)
    results["seconds"] = round(time.monotonic() - began, 1)
    results["targets"] = targets(results)
    report.write_json(results, args.results)
    written = report.plots(results, {k: v for k, v in cdfs.items() if v}, args.out)
    if args.publish:
        docs = ROOT / "docs" / "perf"
        docs.mkdir(parents=True, exist_ok=True)
        for path in written:
            shutil.copy(path, docs / path.name)
    print(report.table(results))
    print(f"wrote {args.results} and {len(written)} plots under {args.out} "
          f"({results['seconds'] / 60:.1f} min)")
    return 0
