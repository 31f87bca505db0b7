"""A/B of one consumer's claims, in process, for comparing two trees of the code.

``python bench/ab_consumer.py <sqlite|postgresql> <events> <handlers>`` fills one partition
stream with ``events`` entries (untimed), then claims them with one consumer in this process
for each handler of ``handlers`` (comma-separated rows of :data:`bench.consumer_loop.VARIANTS`:
``no-op``, ``one-row`` …; batch 500, each on a fresh group and emptied claim tables, as
:func:`bench.scenarios.consumer_handlers` runs them, the collector paced as ``outbox
consume`` paces it) and prints one JSON line: per handler,
claims/s and this process's CPU µs per claim (every thread; on SQLite the database's work
too). CPU per claim moves much less than claims/s with the load of a shared machine.

``python bench/ab_consumer.py ab <kind> <events> <handlers> <runs> <tree> <tree>...``
alternates the trees ``runs`` times (a fresh process per run) and prints each tree's runs and
medians per handler.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any


def claim(kind: str, events: int, handlers: list[str]) -> dict[str, dict[str, float]]:
    """One run of each handler in this process, with whatever code the path imports."""
    from bench import consumer_loop, env, scenarios
    from outbox_relay.consumer import streams
    from outbox_relay.shared import gc_pace

    gc_pace.pace()  # as `outbox consume` runs (and `python -m bench`)

    with tempfile.TemporaryDirectory() as workdir:
        target = env.open_target(kind, workdir)
        try:
            target.reset(1)
            consumer_loop.create_effects(target)
            env.fill_streams(target.redis, target.prefix, events, 1)
            keys = streams.partition_keys(target.prefix, [env.STREAM], 1)
            out = {}
            for number, handler in enumerate(handlers):
                group = f"ab-{number}"
                scenarios._empty_claim_tables(target)
                streams.ensure_groups(target.redis, keys, group)
                if handler == "loop":  # the hand-written loop, as the bench runs it
                    run = scenarios._loop_run(target, keys, group, 500, events)
                else:
                    run = scenarios._handler_run(target, handler, group, 500, events, 1)
                out[handler] = {"claims_per_s": round(run.rate),
                                "cpu_us_per_claim": round(run.cpu["python"] * 1e6 / events, 1)}
            return out
        finally:
            target.close()


def ab(trees: list[str], kind: str, events: int, handlers: list[str], runs: int) -> Any:
    """Alternate the trees ``runs`` times each; per tree and handler, the runs and medians."""
    got: dict[str, list[dict[str, dict[str, float]]]] = {tree: [] for tree in trees}
    for _ in range(runs):
        for tree in trees:
            code = f"exec(open({__file__!r}).read())"  # not the script's folder on the path
            line = subprocess.run(
                [sys.executable, "-c", code, kind, str(events), ",".join(handlers)],
                env={**os.environ, "PYTHONPATH": f"{tree}/src{os.pathsep}{tree}"},
                cwd=tree, check=True, capture_output=True, text=True,
            ).stdout.strip().splitlines()[-1]
            got[tree].append(json.loads(line))
    return {
        tree: {
            handler: {
                figure: {"runs": [r[handler][figure] for r in results],
                         "median": statistics.median(r[handler][figure] for r in results)}
                for figure in ("claims_per_s", "cpu_us_per_claim")
            }
            for handler in handlers
        }
        for tree, results in got.items()
    }


if __name__ == "__main__":
    if sys.argv[1] == "ab":  # ab <kind> <events> <handlers> <runs> <tree> <tree>...
        _, _, kind, n, names, r, *trees = sys.argv
        print(json.dumps(ab(trees, kind, int(n), names.split(","), int(r)), indent=1))
    else:
        kind, n, names = sys.argv[1:4]
        print(json.dumps(claim(kind, int(n), names.split(","))))
