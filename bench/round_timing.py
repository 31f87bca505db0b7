"""Where a relay round's time goes at a steady rate, and the pipeline's latency: the figures of
bench/PERFORMANCE.md's "session 38" section, for comparing two trees of the code.

``PYTHONPATH=<tree>/src:<tree> python bench/round_timing.py relay <db> <rate> <seconds>``: a
producer child commits ``rate`` events/s over 4 partitions; one :class:`Relay` in this process
relays them; prints the relay's CPU per event and per round, and the p50/p90/p99 of its rounds
(``Relay._relay_round``), settles (``store.settle_batches``), takes (``store.take_batches``) and
appends (``append.append_many``, or ``append.append`` in a tree without it).

``… round_timing.py pipeline <db> <rate> <seconds>``: :func:`bench.scenarios.pipeline`
(producer → relay → consumer, 4 partitions); prints p50/p99 of commit → claim and the p50/p99
of each stage.

Run the trees alternately, fresh processes each run: this machine's speed drifts within minutes.
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from bench import env, scenarios, workers
from outbox_relay.relay import append, store
from outbox_relay.relay.daemon import Relay
from outbox_relay.shared import db, gc_pace
from outbox_relay.shared.redis_conn import connect_redis
from outbox_relay.shared.settings import RelaySettings

PARTITIONS = 4


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


def _timed(owner: Any, name: str, spent: dict[str, list[float]]) -> None:
    """Wrap ``owner.name`` so each call's wall time goes to ``spent[name]``."""
    original: Callable[..., Any] = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[name].append(time.perf_counter() - started)

    setattr(owner, name, timed)


def relay(kind: str, rate: float, seconds: float) -> None:
    spent: dict[str, list[float]] = defaultdict(list)
    _timed(store, "settle_batches", spent)
    _timed(store, "take_batches", spent)
    _timed(append, "append_many" if hasattr(append, "append_many") else "append", spent)
    _timed(Relay, "_relay_round", spent)
    target = env.open_target(kind, tempfile.gettempdir())
    try:
        target.reset(PARTITIONS)
        settings = RelaySettings.model_validate({
            "database_url": target.url, "redis_url": env.REDIS_URL,
            "key_prefix": target.prefix, "partitions": PARTITIONS, "batch_size": 500,
            "node_id": "round-timing",
        })
        gc_pace.pace(settings.gc_threshold)  # as `outbox relay` runs
        engine = db.make_engine(target.url)
        daemon = Relay(settings, engine, connect_redis(env.REDIS_URL))
        with scenarios.cluster() as c:
            c.spawn(workers.producer_child, target.url, target.prefix, PARTITIONS, rate,
                    seconds, c.ready, c.start, c.results)
            c.go()
            threading.Timer(seconds + 0.5, daemon.stop).start()
            t0, cpu0 = time.perf_counter(), time.process_time()
            stats = daemon.run()
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        engine.dispose()
    finally:
        target.close()
    rounds = max(stats.rounds, 1)
    print(f"delivered {stats.delivered} in {elapsed:.1f} s, {rounds} rounds; process CPU "
          f"{cpu / elapsed * 100:.0f} %, {cpu * 1e6 / max(stats.delivered, 1):.0f} µs per "
          f"event, {cpu * 1e3 / rounds:.2f} ms per round")
    for name, values in spent.items():
        print(f"  {name}: {len(values)} calls, p50 {_pct(values, .5) * 1e3:.2f} ms, "
              f"p90 {_pct(values, .9) * 1e3:.2f}, p99 {_pct(values, .99) * 1e3:.2f}")


def pipeline(kind: str, rate: float, seconds: float) -> None:
    target = env.open_target(kind, tempfile.gettempdir())
    try:
        run = scenarios.pipeline(target, rate, seconds, PARTITIONS)
    finally:
        target.close()
    lat = run.latencies_ms
    stages = " ".join(f"{name}: {_pct(v, .5):.1f}/{_pct(v, .99):.1f}"
                      for name, v in run.stages_ms.items())
    print(f"{len(lat)} events, {run.missing} missing; commit → claim p50 {_pct(lat, .5):.1f} "
          f"p99 {_pct(lat, .99):.1f} ms; by stage p50/p99 (ms): {stages}")


if __name__ == "__main__":
    mode, database, offered, length = sys.argv[1:5]
    {"relay": relay, "pipeline": pipeline}[mode](database, float(offered), float(length))
