"""``python -m bench`` (``make bench``): every benchmark of issue 5, its table, JSON and plots.

Full mode follows the issue's sizes (50,000-event backlogs, 3 runs each, a 10-minute memory
run); ``--quick`` shrinks everything so the code is exercised in well under two minutes (CI).
Results go to ``bench/results.json`` and PNG plots to ``bench/out/``; ``--publish`` also copies
the plots to ``docs/perf/`` for docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import env, report, scenarios
from bench.baseline import redis_ceiling

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("baseline", "relay", "consumer", "latency", "producer", "ceiling", "memory")


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


FULL = Config(3, 50_000, (100, 500, 2000), (1, 2, 4), 20_000, (1, 2), 500,
              (100, 1000, 5000), 10.0, 1000, 600.0, 1000)
QUICK = Config(1, 3_000, (500,), (1, 2), 2_000, (1, 2), 500, (100, 1000), 2.0, 200, 6.0, 500)
TINY = Config(1, 600, (100,), (2,), 400, (1,), 100, (200,), 1.0, 100, 2.0, 200)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="small sizes, one run each (< 2 min)")
    p.add_argument("--tiny", action="store_true", help="smallest sizes (the pytest smoke run)")
    p.add_argument("--databases", default="postgresql,sqlite", help="comma-separated kinds")
    p.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios")
    p.add_argument("--runs", type=int, help="repetitions of each figure (default 3 / quick 1)")
    p.add_argument("--memory-seconds", type=float, help="length of the memory run")
    p.add_argument("--events", type=int, help="backlog size of the relay runs")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results.json")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    p.add_argument("--publish", action="store_true", help="copy the plots to docs/perf/")
    return p.parse_args(argv)


def configure(args: argparse.Namespace) -> Config:
    base = TINY if args.tiny else QUICK if args.quick else FULL
    changes: dict[str, Any] = {}
    if args.runs:
        changes["runs"] = args.runs
    if args.memory_seconds:
        changes["memory_seconds"] = args.memory_seconds
    if args.events:
        changes["relay_events"] = args.events
    return Config(**{**asdict(base), **changes})


def repeat(runs: int, measure: Any) -> report.Summary:
    return report.summary([measure() for _ in range(runs)])


def bench_database(
    target: env.Target, cfg: Config, only: set[str], cdfs: dict[str, list[float]]
) -> dict[str, Any]:
    """Every per-database scenario on one target."""
    out: dict[str, Any] = {}
    n = cfg.runs
    say = _say(target.kind)
    base: dict[str, report.Summary] = {}
    if only & {"baseline", "relay"}:
        for b in cfg.batches:
            say(f"baseline batch {b}")
            base[str(b)] = repeat(n, lambda b=b: scenarios.baseline(target, cfg.relay_events, b))
        out["baseline"] = base
    if "relay" in only:
        out["relay"] = {}
        for b in cfg.batches:
            for p in cfg.partitions:
                say(f"relay batch {b} x {p} partitions/relays")
                s = repeat(n, lambda b=b, p=p: scenarios.relay_throughput(
                    target, cfg.relay_events, p, b))
                s["ratio"] = s["median"] / base[str(b)]["median"]
                out["relay"][f"b{b} p{p}"] = s
    if "consumer" in only:
        out["consumer"] = _consumers(target, cfg, say)
    if "latency" in only:
        out["latency"] = {}
        for rate in cfg.rates:
            say(f"latency at {rate} ev/s")
            runs = [scenarios.pipeline(target, rate, cfg.rate_seconds, 4) for _ in range(n)]
            cdfs[str(rate)] = runs[0].latencies_ms
            out["latency"][str(rate)] = {
                q: report.summary([report.percentile(r.latencies_ms, f) for r in runs])
                for q, f in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99), ("max", 1.0))
            }
            # Events still unclaimed at the deadline (seconds x 3 + 60): the offered rate was
            # more than the pipeline could take; their latency is not in the percentiles.
            out["latency"][str(rate)]["missing"] = max(r.missing for r in runs)
    if "producer" in only:
        say("producer overhead")
        pairs = [scenarios.producer_overhead(target, cfg.producer_txns) for _ in range(n)]
        out["producer"] = {
            "bare_ms": report.summary([a for a, _ in pairs]),
            "enqueue_ms": report.summary([b for _, b in pairs]),
            "ratio": report.summary([b / a for a, b in pairs]),
        }
    if "ceiling" in only:
        out["ceiling"] = {}
        for b in cfg.batches:
            say(f"redis ceiling batch {b}")
            out["ceiling"][str(b)] = repeat(
                n, lambda b=b: redis_ceiling(target, cfg.relay_events, b))
    return out


def _consumers(target: env.Target, cfg: Config, say: Any) -> dict[str, Any]:
    results: dict[str, Any] = {}
    first = 0.0
    for procs in cfg.consumer_procs:
        name = f"{procs} proc"
        say(f"consumer {name}")
        s = repeat(cfg.runs, lambda p=procs: scenarios.consumer_throughput(
            target, cfg.consumer_events, p, cfg.consumer_batch, 4))
        first = first or s["median"]
        s["ratio"] = s["median"] / first
        results[name] = s
    return results


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


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured value and whether it is met."""
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, goal: str, met: bool) -> None:
        if value is not None:
            out.append({"name": name, "value": value, "goal": goal, "met": met})

    for kind, r in results["databases"].items():
        relay = r.get("relay", {})
        if relay:
            best = max(relay.values(), key=lambda s: s["ratio"])
            one = [s for k, s in relay.items() if k.endswith(" p1")]
            add(f"{kind} relay (1 relay) / baseline", max(s["ratio"] for s in one) if one
                else None, ">= 1.3", bool(one) and max(s["ratio"] for s in one) >= 1.3)
            add(f"{kind} relay (best config) / baseline", best["ratio"], ">= 1.3",
                best["ratio"] >= 1.3)
        if kind == "postgresql":
            for name, s in r.get("consumer", {}).items():
                if name.startswith("1 proc"):
                    add(f"postgresql consumer {name} claims/s", s["median"], ">= 10000",
                        s["median"] >= 10_000)
        lat = r.get("latency", {}).get("1000")
        if lat:
            goal = 20.0 if kind == "postgresql" else 100.0
            add(f"{kind} p99 at 1000 ev/s (ms)", lat["p99"]["median"], f"<= {goal:g}",
                lat["p99"]["median"] <= goal)
        if "producer" in r:
            ratio = r["producer"]["ratio"]["median"]
            add(f"{kind} producer overhead ratio", ratio, "<= 1.1", ratio <= 1.1)
    for name, v in results.get("memory", {}).get("processes", {}).items():
        add(f"RSS growth of {name} (%)", v["growth_pct"], "< 10", v["growth_pct"] < 10)
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
            "platform": platform.platform()}


def _say(kind: str) -> Any:
    def say(text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {kind}: {text}", file=sys.stderr, flush=True)

    return say


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cfg = configure(args)
    only = set(args.only.split(","))
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    results: dict[str, Any] = {"mode": mode, "machine": machine(), "config": asdict(cfg),
                               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "databases": {}}
    cdfs: dict[str, dict[str, list[float]]] = {}
    workdir = tempfile.mkdtemp(prefix="outbox-bench-")
    try:
        for kind in [k.strip() for k in args.databases.split(",") if k.strip()]:
            target = env.open_target(kind, workdir)
            try:
                cdfs[kind] = {}
                results["databases"][kind] = bench_database(target, cfg, only, cdfs[kind])
                if "memory" in only and not results.get("memory"):
                    results["memory"] = memory(target, cfg)
            finally:
                target.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["targets"] = targets(results)
    report.write_json(results, args.results)
    written = report.plots(results, {k: v for k, v in cdfs.items() if v}, args.out)
    if args.publish:
        docs = ROOT / "docs" / "perf"
        docs.mkdir(parents=True, exist_ok=True)
        for path in written:
            shutil.copy(path, docs / path.name)
    print(report.table(results))
    print(f"wrote {args.results} and {len(written)} plots under {args.out}")
    return 0
