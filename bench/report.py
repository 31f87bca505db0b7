"""Summaries, ratios, the spread between passes, the printed table, ``results.json``, plots.

Every figure is a :func:`summary` of repeated runs: the median with min and max, because the
machine is shared and noisy. Ratios are taken within one benchmark run (same minute, same
noise), which is what the targets compare. When the suite ran more than once (``--passes``),
each figure also carries every pass's median and their spread, ``(max - min) / min``; a spread
above :data:`SPREAD_LIMIT_PCT` means a rerun did not reproduce the figure, and it is flagged.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

Summary = dict[str, Any]
SPREAD_LIMIT_PCT = 15.0
QUANTILES = (("p50", 0.5), ("p95", 0.95), ("p99", 0.99), ("max", 1.0))
HISTOGRAM_EDGES_MS = (0.0, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


def summary(values: list[float]) -> Summary:
    """Median, min, max and the raw runs."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "runs": [round(v, 3) for v in values],
    }


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank on sorted values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))
    return ordered[index]


def histogram(values: list[float]) -> dict[str, int]:
    """Counts per bucket of :data:`HISTOGRAM_EDGES_MS` (``"<0"`` for negative stage times:
    clocks read in two processes, millisecond resolution of the take stamp)."""
    edges = HISTOGRAM_EDGES_MS
    labels = ["<0"] + [f"{a:g}-{b:g}" for a, b in itertools.pairwise(edges)] + [
        f">={edges[-1]:g}"]
    counts = dict.fromkeys(labels, 0)
    for v in values:
        if v < 0:
            counts["<0"] += 1
            continue
        for i, edge in enumerate(edges[1:]):
            if v < edge:
                counts[labels[i + 1]] += 1
                break
        else:
            counts[labels[-1]] += 1
    return counts


def spread_pct(values: list[float]) -> float:
    """``(max - min) / min`` in percent (0 for one value; inf when min is 0)."""
    low, high = min(values), max(values)
    if len(values) < 2 or high == low:
        return 0.0
    return (high - low) / abs(low) * 100 if low else math.inf


def fmt(s: Summary, unit: str = "", digits: int = 0) -> str:
    """``median [min-max] unit`` for the table; with passes, ``(passes a / b, spread %)``."""
    text = f"{s['median']:,.{digits}f} [{s['min']:,.{digits}f}-{s['max']:,.{digits}f}]{unit}"
    if "pass_medians" in s:
        text += _passes(s["pass_medians"], s["spread_pct"], digits)
    return text


def _passes(medians: list[float], spread: float, digits: int) -> str:
    shown = " / ".join(f"{m:,.{digits}f}" for m in medians)
    return f" (passes {shown}, spread {spread:.0f}%)"


# -- ratios, passes and their spread -----------------------------------------------------------


def add_ratios(r: dict[str, Any], kind: str) -> None:
    """The ratios of one database's figures, from their medians: each relay row to the strong
    baseline of its batch size, each consumer row to the first, each cluster side 3 masters
    to 1 master; and the cluster rows' bottleneck sentences."""
    base = r.get("baseline", {})
    for name, s in r.get("relay", {}).items():
        batch = name.split(" ")[0].removeprefix("b")
        if batch in base:
            s["ratio"] = s["median"] / base[batch]["median"]
            loops = base[batch]["runs"]
            if s.get("alternated_with_baseline") and len(loops) == len(s["runs"]):
                # Each run to the loop's run of the same round (bench/run.py baseline_rows).
                s["paired_ratios"] = [round(a / b, 3) for a, b in zip(s["runs"], loops,
                                                                      strict=True)]
    first = None
    for s in r.get("consumer", {}).values():
        first = first or s["median"]
        s["ratio"] = s["median"] / first
    rows = r.get("consumer_handlers", {}).get("rows", {})
    loop = rows.get("loop")
    if loop:
        for s in rows.values():
            s["ratio"] = s["median"] / loop["median"]
            # Each run to the loop's run of the same round (the rows alternate per round).
            s["paired_ratios"] = [round(a / b, 3) for a, b in zip(s["runs"], loop["runs"],
                                                                  strict=False)]
    c = r.get("cluster", {})
    if "1 master" in c and "3 masters" in c:
        c["ratio"] = {side: c["3 masters"][side]["median"] / c["1 master"][side]["median"]
                      for side in ("relay", "consumer")}
        for name in ("1 master", "3 masters"):
            for side in ("relay", "consumer"):
                c[name][side]["bottleneck"] = bottleneck(
                    c[name][side]["cpu"], c.get("cores") or 1, side, sqlite=kind == "sqlite")


def bottleneck(cpu: dict[str, float], cores: int, side: str, *, sqlite: bool = False) -> str:
    """Where the next bottleneck is, from CPU-seconds per wall second of each side."""
    python, busiest = cpu.get("python", 0.0), cpu.get("python_max", 0.0)
    db, redis_all, redis_max = cpu.get("db", 0.0), cpu.get("redis", 0.0), cpu.get("redis_max", 0.0)
    total = python + db + redis_all
    machine = max(cpu.get("machine", 0.0), total)
    shares = {"Python": python, "the database": db, "Redis": redis_all}
    largest = max(shares, key=lambda k: shares[k])
    db_text = "in-process (SQLite)" if sqlite else f"{db:.2f}"
    measured = (f"{side} processes {python:.2f} CPU-s/s (busiest {busiest:.2f}), database "
                f"backends {db_text}, Redis {redis_all:.2f} (busiest master {redis_max:.2f}); "
                f"ours {total:.2f}, whole machine {machine:.2f} of {cores} cores")
    if redis_max >= 0.8:
        verdict = "Redis: the busiest master's one thread is nearly full"
    elif busiest >= 0.85:
        verdict = f"Python: one {side} process is nearly a full core (its interpreter lock)"
    elif machine >= 0.85 * cores:
        other = "" if total >= 0.7 * machine else " (much of it other load than ours)"
        verdict = (f"the machine's {cores} cores are nearly all busy{other}; of ours, most is "
                   f"{largest}")
    else:
        verdict = (f"no side is near its limit (round trips and waits); the largest share is "
                   f"{largest}")
    return f"{verdict} — {measured}"


def top_commands(stats: dict[str, dict[str, float]], count: int = 6) -> dict[str, Any]:
    """The Redis commands with the most server time (``INFO commandstats``)."""
    ordered = sorted(stats.items(), key=lambda kv: -kv[1]["usec"])[:count]
    return {name: {"calls": int(v["calls"]), "usec": int(v["usec"]),
                   "usec_per_call": round(v["usec"] / v["calls"], 2) if v["calls"] else 0.0}
            for name, v in ordered}


def _is_summary(node: Any) -> bool:
    return isinstance(node, dict) and "median" in node and "runs" in node


def merge_passes(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``databases`` dict from several passes: every summary over all runs of all passes,
    with ``pass_medians`` and ``spread_pct``; ratios recomputed from the merged medians."""
    if len(passes) == 1:
        return passes[0]

    def walk(nodes: list[Any]) -> Any:
        first = nodes[0]
        if _is_summary(first):
            merged = summary([v for n in nodes for v in n["runs"]])
            medians = [n["median"] for n in nodes]
            merged["pass_medians"] = medians
            merged["spread_pct"] = spread_pct(medians)
            for key in first:
                if key not in merged and key not in ("ratio",):
                    merged[key] = walk([n[key] for n in nodes if key in n])
            return merged
        if isinstance(first, dict):
            return {k: walk([n[k] for n in nodes if isinstance(n, dict) and k in n])
                    for k in first}
        if isinstance(first, int | float) and not isinstance(first, bool) and any(
                n != first for n in nodes):
            return statistics.median(nodes)
        return first

    merged: dict[str, Any] = walk(passes)
    for kind, r in merged.items():
        add_ratios(r, kind)
    for kind, r in merged.items():  # each ratio's value in every pass, for its spread
        _ratio_passes_of(r.get("relay", {}), [p[kind].get("relay", {}) for p in passes])
        _ratio_passes_of(r.get("consumer_handlers", {}).get("rows", {}),
                         [p[kind].get("consumer_handlers", {}).get("rows", {}) for p in passes])
    return merged


def _ratio_passes_of(rows: dict[str, Any], per_pass: list[dict[str, Any]]) -> None:
    for name, s in rows.items():
        if "ratio" in s:
            s["ratio_passes"] = [p[name]["ratio"] for p in per_pass if "ratio" in p.get(name, {})]


def figures(databases: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """Every figure of a ``databases`` dict as ``(path, value)``: summary medians, relay
    ratios and the cluster's 3-masters/1-master ratios."""

    def walk(node: Any, path: list[str]) -> Iterator[tuple[str, float]]:
        if _is_summary(node):
            yield " / ".join(path), float(node["median"])
            if isinstance(node.get("ratio"), float) and path[1] in ("relay",
                                                                   "consumer_handlers"):
                yield " / ".join([*path, "ratio"]), node["ratio"]
            return
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("runs", "stage_histogram", "cpu", "redis_commands", "baseline_phases_ms",
                         "cpu_us_per_event", "paired_ratios"):
                    continue
                if k == "ratio" and isinstance(v, dict) and path[-1:] == ["cluster"]:
                    for side, value in v.items():
                        yield " / ".join([*path, f"3/1 masters {side}"]), float(value)
                    continue
                yield from walk(v, [*path, str(k)])

    yield from walk(databases, [])


LATENCY_TOLERANCE_MS = 1.0
"""A latency figure whose passes differ by at most this much counts as reproduced whatever
the percentage (stage times near 0 ms; the take stamp has millisecond resolution)."""


def spread_rows(passes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For every figure present in all passes: each pass's value, the spread, and whether
    it is over :data:`SPREAD_LIMIT_PCT` (latency figures: and over
    :data:`LATENCY_TOLERANCE_MS` apart)."""
    tables = [dict(figures(p)) for p in passes]
    rows = []
    for path in tables[0]:
        values = [t[path] for t in tables if path in t]
        if len(values) != len(tables):
            continue
        spread = spread_pct(values)
        over = spread > SPREAD_LIMIT_PCT
        if " / latency / " in f" {path} / " and max(values) - min(values) <= LATENCY_TOLERANCE_MS:
            over = False
        rows.append({"figure": path, "passes": values, "spread_pct": spread, "over": over})
    return rows


def table(results: dict[str, Any]) -> str:
    """The human-readable table printed at the end of a run."""
    lines: list[str] = []
    for kind, r in results["databases"].items():
        lines.append(f"== {kind} ==")
        lines += _database_lines(r)
    if "memory" in results:
        m = results["memory"]
        for name, v in m["processes"].items():
            lines.append(
                f"memory {name}: start {v['start_kb']:,} kB, warm {v['warm_kb']:,} kB, "
                f"end {v['end_kb']:,} kB, growth after warm-up {v['growth_pct']:+.1f}%"
            )
    spread = results.get("spread")
    if spread:
        over = [row for row in spread if row["over"]]
        lines.append(f"spread between the {len(spread[0]['passes'])} passes: "
                     f"{len(spread) - len(over)} of {len(spread)} figures within "
                     f"{SPREAD_LIMIT_PCT:.0f}%; over it (not to be published):")
        lines += [f"  {row['figure']}: " + " / ".join(f"{v:,.2f}" for v in row["passes"])
                  + f" ({row['spread_pct']:.0f}%)" for row in over] or ["  none"]
    lines.append("targets:")
    for t in results.get("targets", []):
        mark = "MET " if t["met"] else "MISS"
        lines.append(f"  [{mark}] {t['name']}: {t['value']:.2f} (goal {t['goal']})")
    return "\n".join(lines)


def _database_lines(r: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for batch, s in r.get("baseline", {}).items():
        phases = r.get("baseline_phases_ms", {}).get(batch, {})
        per = ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
        lines.append(f"  strong baseline batch {batch:>5}: {fmt(s, ' ev/s')}")
        if per:
            lines.append(f"      ms per batch: {per}")
    for name, s in r.get("relay", {}).items():
        lines.append(f"  relay {_relay_name(name):>24}: {fmt(s, ' ev/s')}  "
                     f"x{s.get('ratio', math.nan):.2f} strong baseline{_ratio_passes(s)}"
                     f"{_paired_text(s)}{_cpu_text(s)}")
    for name, s in r.get("consumer", {}).items():
        lines.append(f"  consumer {name:>10}: {fmt(s, ' claims/s')}  x{s['ratio']:.2f}"
                     f"{_cpu_text(s)}")
    lines += _handler_lines(r.get("consumer_handlers", {}))
    lines += _cluster_lines(r.get("cluster", {}))
    for rate, lat in r.get("latency", {}).items():
        lines += _latency_lines(rate, lat)
    lines += _capacity_lines(r.get("capacity", {}))
    if "producer" in r:
        p = r["producer"]
        lines.append(
            f"  producer: bare {fmt(p['bare_ms'], ' ms', 3)}  +enqueue "
            f"{fmt(p['enqueue_ms'], ' ms', 3)}  x{p['ratio']['median']:.2f}"
        )
        for name, row in p.get("threads", {}).items():  # issue 24: tx/s, ratio to bare
            cells = "  ".join(f"{v} {fmt(row[v], '')}" + (
                f" x{row[v + ' / bare']['median']:.2f}" if v + " / bare" in row else "")
                for v in ("bare", "enqueue", "no notify"))
            cpu = " / ".join(f"{v:.0f}" for v in row.get("python_cpu_us_per_tx", {}).values())
            lines.append(f"  producers {name:>10} (tx/s): {cells}  [python µs/tx {cpu}]")
    for batch, s in r.get("ceiling", {}).items():
        lines.append(f"  redis ceiling batch {batch:>5}: {fmt(s, ' ev/s')}")
    return lines


HANDLER_NAMES = {"loop": "hand-written loop", "no-op": "ours, no-op handler",
                 "one-row": "ours, one-row handler",
                 "one-row unpipelined": "ours, one-row, pipeline=False",
                 "batch": "ours, batch handler", "async one-row": "ours, async one-row handler"}


def _handler_lines(h: dict[str, Any]) -> list[str]:
    """The consumer handler rows: claims/s, ratio to the hand-written loop (each round's
    paired ratio), CPU µs per event of the process and of its database backend."""
    rows = h.get("rows")
    if not rows:
        return []
    lines = [f"  consumer handlers (one consumer in the bench process, {h['partitions']} "
             f"partition, batch {h['batch']}, {h['events']:,} entries, {h['rounds']} rounds "
             "alternated):"]
    for name, s in rows.items():
        cpu = s.get("cpu_us_per_event", {})
        db = f", db {cpu['db']:.1f}" if cpu.get("db") else ""
        paired = " / ".join(f"{x:.2f}" for x in s.get("paired_ratios", []))
        lines.append(f"    {HANDLER_NAMES.get(name, name):>22}: {fmt(s, ' claims/s')}  "
                     f"x{s.get('ratio', math.nan):.2f} loop (runs {paired})"
                     f"{_ratio_passes(s)}  [CPU µs/event: python {cpu.get('python', 0):.1f}"
                     f"{db}]")
    return lines


def _capacity_lines(c: dict[str, Any]) -> list[str]:
    """The sustained-rate sweeps (``run.capacity``): per offered rate, achieved and latency."""
    if not c:
        return []
    lines = _sweep_lines(c, c, "one event per transaction")
    if "batched" in c:
        lines += _sweep_lines(c, c["batched"], f"the events due, up to {c['batched']['per_txn']}"
                              " per transaction")
    return lines


def _sweep_lines(c: dict[str, Any], sweep: dict[str, Any], shape: str) -> list[str]:
    lines = [f"  capacity sweep ({c['threads']} writer threads, {shape}, "
             f"{c['seconds']:g} s per rate, one-row handler):"]
    for rate, row in sweep["rows"].items():
        cells = "  ".join(f"{q} {fmt(row[q], '', 1)}" for q in ("p50", "p99"))
        behind = f"  (fell behind: {row['missing']} unclaimed)" if row.get("missing") else ""
        lines.append(f"    offered {int(rate):>6}/s: committed {fmt(row['produced'], '/s')}  "
                     f"claimed {fmt(row['achieved'], '/s')}  latency (ms) {cells}{behind}")
    lines.append(f"    capacity (p99 <= {c['p99_bar_ms']:g} ms, >= 90 % of the offered rate "
                 "claimed, nothing left behind): "
                 f"{sweep['capacity']:,.0f} ev/s")
    return lines


def _latency_lines(rate: str, lat: dict[str, Any]) -> list[str]:
    cells = "  ".join(f"{q} {fmt(lat[q], '', 1)}" for q, _ in QUANTILES)
    behind = f"  (fell behind: {lat['missing']} unclaimed)" if lat.get("missing") else ""
    lines = [f"  latency {rate:>6}/s (ms): {cells}{behind}"]
    stages = lat.get("stages", {})
    if stages:
        lines.append(f"      stages p50 / p95 / p99 (ms), {lat.get('stages_measured', 0)}"
                     " events with every stamp:")
        for stage, qs in stages.items():
            cells = " / ".join(f"{qs[q]['median']:.1f}" for q in ("p50", "p95", "p99"))
            extra = ""
            if "pass_medians" in qs["p50"]:
                apart = max(max(qs[q]["pass_medians"]) - min(qs[q]["pass_medians"])
                            for q in ("p50", "p95", "p99"))
                extra = f"  (passes up to {apart:.1f} ms apart)"
            lines.append(f"        {stage:<24} {cells}{extra}")
    return lines


def _paired_text(s: dict[str, Any]) -> str:
    """A row alternated with the baseline: its run-by-run ratios and their median."""
    paired = s.get("paired_ratios")
    if not paired:
        return ""
    runs = " / ".join(f"{x:.2f}" for x in paired)
    return f" (run by run {runs}, median {statistics.median(paired):.2f})"


def _relay_name(name: str) -> str:
    """``b500 p2`` → ``b500 2 relays x 2 part``; ``b500 p4 r1`` → ``b500 1 relay x 4 part``."""
    parts = name.split(" ")
    partitions = int(parts[1][1:])
    relays = int(parts[2][1:]) if len(parts) > 2 else partitions
    noun = "relay" if relays == 1 else "relays"
    return f"{parts[0]} {relays} {noun} x {partitions} part"


def _ratio_passes(s: Summary) -> str:
    ratios = s.get("ratio_passes")
    if not ratios:
        return ""
    return f" (passes {' / '.join(f'{x:.2f}' for x in ratios)})"


def _cpu_text(s: Summary) -> str:
    cpu = s.get("cpu")
    if not cpu:
        return ""
    db = f", db {cpu['db']:.2f}" if cpu.get("db") else ""
    machine = f", machine {cpu['machine']:.2f}" if "machine" in cpu else ""
    return (f"  [CPU-s/s: processes {cpu['python']:.2f}, busiest {cpu['python_max']:.2f}{db}"
            f"{machine}]")


def _cluster_lines(c: dict[str, Any]) -> list[str]:
    if not c:
        return []
    if "skipped" in c:
        return [f"  cluster rows skipped: {c['skipped']}"]
    lines = [f"  cluster: {c['partitions']} partitions, batch {c['batch']}, {c['relays']} relay / "
             f"{c['consumers']} consumer processes, no replicas, no AOF"]
    for name in ("1 master", "3 masters"):
        row = c.get(name)
        if not row:
            continue
        lines.append(f"    {name} (partitions per master {row['partitions_per_master']}):")
        for side, unit in (("relay", "ev/s"), ("consumer", "claims/s")):
            s = row[side]
            lines.append(f"      {side:<8} {fmt(s, ' ' + unit)}")
            if "bottleneck" in s:
                lines.append(f"        next bottleneck: {s['bottleneck']}")
    if "ratio" in c:
        lines.append("    3 masters / 1 master: " + ", ".join(
            f"{side} x{v:.2f}" for side, v in c["ratio"].items()))
    return lines


def write_json(results: dict[str, Any], path: Path) -> None:
    """``results.json`` (latency samples are not included, only their percentiles)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, sort_keys=False) + "\n")


def plots(
    results: dict[str, Any], cdfs: dict[str, dict[str, list[float]]], out: Path
) -> list[Path]:
    """Relay throughput bars, latency CDFs, consumer bars and RSS over time, as PNG files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    dbs = {k: r for k, r in results["databases"].items() if r.get("relay")}
    if dbs:
        written.append(_relay_plot(plt, dbs, out))
    if cdfs:
        written.append(_cdf_plot(plt, cdfs, out))
    consumers = {k: r for k, r in results["databases"].items() if r.get("consumer")}
    if consumers:
        written.append(_consumer_plot(plt, consumers, out))
    if "memory" in results:
        written.append(_memory_plot(plt, results["memory"], out))
    return written


def _relay_plot(plt: Any, dbs: dict[str, Any], out: Path) -> Path:
    fig, axes = plt.subplots(1, len(dbs), figsize=(6 * len(dbs), 4), squeeze=False)
    for ax, (kind, r) in zip(axes[0], dbs.items(), strict=True):
        names = list(r.get("relay", {}))
        ax.bar(names, [r["relay"][n]["median"] for n in names], color="tab:blue")
        ax.errorbar(names, [r["relay"][n]["median"] for n in names], yerr=[
            [r["relay"][n]["median"] - r["relay"][n]["min"] for n in names],
            [r["relay"][n]["max"] - r["relay"][n]["median"] for n in names]],
            fmt="none", ecolor="black", capsize=3)
        for batch, s in r.get("baseline", {}).items():
            ax.axhline(s["median"], linestyle="--", linewidth=1, label=f"baseline b{batch}")
        ax.set_title(f"relay drain, {kind}")
        ax.set_ylabel("events/s")
        ax.tick_params(axis="x", rotation=45)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, out / "relay_throughput.png")


def _cdf_plot(plt: Any, cdfs: dict[str, dict[str, Any]], out: Path) -> Path:
    """End-to-end CDFs per rate (top row) and per stage at the middle rate (bottom row)."""
    fig, axes = plt.subplots(2, len(cdfs), figsize=(6 * len(cdfs), 8), squeeze=False)
    for column, (kind, data) in enumerate(cdfs.items()):
        ax = axes[0][column]
        for rate, samples in data.get("end_to_end", {}).items():
            _cdf(ax, samples, f"{rate} ev/s")
        ax.set_xlabel("commit → consumer claim commit (ms)")
        ax.set_title(f"end-to-end latency CDF, {kind}")
        stages = dict(data.get("stages", {}))
        rate = stages.pop("rate", "?")
        ax = axes[1][column]
        for stage, samples in stages.items():
            _cdf(ax, samples, stage)
        ax.set_xlabel("stage time (ms; below 0.01 drawn at 0.01)")
        ax.set_title(f"per stage at {rate} ev/s, {kind}")
    fig.tight_layout()
    return _save(fig, out / "latency_cdf.png")


def _cdf(ax: Any, samples: list[float], label: str) -> None:
    ordered = sorted(max(v, 0.01) for v in samples)
    if ordered:
        ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)
    ax.set_xscale("log")
    ax.set_ylabel("fraction of events")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def _consumer_plot(plt: Any, dbs: dict[str, Any], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, values = [], []
    for kind, r in dbs.items():
        for name, s in r.get("consumer", {}).items():
            labels.append(f"{kind}\n{name}")
            values.append(s["median"])
    ax.bar(labels, values, color="tab:green")
    ax.set_ylabel("claims/s")
    ax.set_title("consumer claims/s, no-op handler")
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    return _save(fig, out / "consumer_throughput.png")


def _memory_plot(plt: Any, memory: dict[str, Any], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, v in memory["processes"].items():
        ax.plot([t for t, _ in v["samples"]], [kb / 1024 for _, kb in v["samples"]], label=name)
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title(f"RSS at {memory['rate']} ev/s, {memory['database']}")
    ax.legend()
    fig.tight_layout()
    return _save(fig, out / "memory_rss.png")


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
