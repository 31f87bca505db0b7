"""Summaries, the printed table, ``results.json`` and the PNG plots.

Every figure is a :func:`summary` of repeated runs: the median with min and max, because the
machine is shared and noisy. Ratios are taken within one benchmark run (same minute, same
noise), which is what the targets compare.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

Summary = dict[str, Any]


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


def fmt(s: Summary, unit: str = "", digits: int = 0) -> str:
    """``median [min-max] unit`` for the table."""
    return f"{s['median']:,.{digits}f} [{s['min']:,.{digits}f}-{s['max']:,.{digits}f}]{unit}"


def table(results: dict[str, Any]) -> str:
    """The human-readable table printed at the end of a run."""
    lines: list[str] = []
    for kind, r in results["databases"].items():
        lines.append(f"== {kind} ==")
        for batch, s in r.get("baseline", {}).items():
            lines.append(f"  baseline  batch {batch:>5}: {fmt(s, ' ev/s')}")
        for name, s in r.get("relay", {}).items():
            lines.append(f"  relay {name:>13}: {fmt(s, ' ev/s')}  x{s['ratio']:.2f} baseline")
        for name, s in r.get("consumer", {}).items():
            lines.append(f"  consumer {name:>10}: {fmt(s, ' claims/s')}  x{s['ratio']:.2f}")
        for rate, lat in r.get("latency", {}).items():
            cells = "  ".join(f"{q} {fmt(lat[q], '', 1)}" for q in ("p50", "p95", "p99", "max"))
            behind = f"  (fell behind: {lat['missing']} unclaimed)" if lat.get("missing") else ""
            lines.append(f"  latency {rate:>6}/s (ms): {cells}{behind}")
        if "producer" in r:
            p = r["producer"]
            lines.append(
                f"  producer: bare {fmt(p['bare_ms'], ' ms', 3)}  +enqueue "
                f"{fmt(p['enqueue_ms'], ' ms', 3)}  x{p['ratio']['median']:.2f}"
            )
        for batch, s in r.get("ceiling", {}).items():
            lines.append(f"  redis ceiling batch {batch:>5}: {fmt(s, ' ev/s')}")
    if "memory" in results:
        m = results["memory"]
        for name, v in m["processes"].items():
            lines.append(
                f"memory {name}: start {v['start_kb']:,} kB, warm {v['warm_kb']:,} kB, "
                f"end {v['end_kb']:,} kB, growth after warm-up {v['growth_pct']:+.1f}%"
            )
    lines.append("targets:")
    for t in results.get("targets", []):
        mark = "MET " if t["met"] else "MISS"
        lines.append(f"  [{mark}] {t['name']}: {t['value']:.2f} (goal {t['goal']})")
    return "\n".join(lines)


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


def _cdf_plot(plt: Any, cdfs: dict[str, dict[str, list[float]]], out: Path) -> Path:
    fig, axes = plt.subplots(1, len(cdfs), figsize=(6 * len(cdfs), 4), squeeze=False)
    for ax, (kind, by_rate) in zip(axes[0], cdfs.items(), strict=True):
        for rate, samples in by_rate.items():
            ordered = sorted(samples)
            ys = [(i + 1) / len(ordered) for i in range(len(ordered))]
            ax.plot(ordered, ys, label=f"{rate} ev/s")
        ax.set_xscale("log")
        ax.set_xlabel("commit → consumer claim commit (ms)")
        ax.set_ylabel("fraction of events")
        ax.set_title(f"end-to-end latency CDF, {kind}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return _save(fig, out / "latency_cdf.png")


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
