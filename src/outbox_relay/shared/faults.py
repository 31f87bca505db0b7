"""Named fault points: places where a crash must be survivable, and a way to crash there.

Each point is one call, ``faults.point("relay.after_xadd")``, at exactly the place the design
names (see ``POINTS``). It does nothing unless the environment variable ``OUTBOX_FAULTS`` names
it with a probability::

    OUTBOX_FAULTS=relay.after_xadd:0.01,consumer.after_commit:0.05
    OUTBOX_FAULTS=relay.after_mark            # probability 1: the first pass kills
    OUTBOX_FAULTS_SEED=42                     # reproducible draws

A hit writes one line ``outbox-fault: <point> pid=<pid>`` to stderr (so a harness can count
kills per point) and sends the process ``SIGKILL``: no ``finally``, no ``atexit``, no flush;
exactly what a power cut or the OOM killer does. The variable is parsed once, at first use,
into a dict, so an unnamed point costs one dict lookup.
"""

from __future__ import annotations

import os
import random
import signal

from outbox_relay.shared.errors import ConfigError

ENV = "OUTBOX_FAULTS"
SEED_ENV = "OUTBOX_FAULTS_SEED"

POINTS = (
    "producer.before_commit",  # the outbox row is written, the caller's transaction is open
    "relay.after_take",  # rows taken (entry ids assigned and committed), nothing appended
    "relay.after_xadd",  # Redis holds the entries, the outbox does not know it yet
    "relay.after_mark",  # delivered rows marked, before the next round
    "consumer.after_commit",  # inbox receipts and handler writes committed, no XACK yet
    "consumer.after_ack",  # XACK sent, before the consumer's batch work ends
    "worker.mid_stage",  # a run stage half done, its checkpoint not saved
    "worker.after_checkpoint",  # checkpoint saved, the next stage not started
)

_plan: dict[str, float] | None = None
_rng = random.Random()


def parse(spec: str) -> dict[str, float]:
    """``"a:0.1,b"`` → ``{"a": 0.1, "b": 1.0}``; unknown points and bad rates are errors."""
    plan: dict[str, float] = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        name, _, rate_text = item.partition(":")
        if name not in POINTS:
            raise ConfigError(f"{ENV}: unknown fault point {name!r} (known: {', '.join(POINTS)})")
        try:
            rate = float(rate_text) if rate_text else 1.0
        except ValueError:
            raise ConfigError(f"{ENV}: rate of {name!r} must be a number in (0, 1]") from None
        if not 0.0 < rate <= 1.0:
            raise ConfigError(f"{ENV}: rate of {name!r} must be a number in (0, 1]")
        plan[name] = rate
    return plan


def configure(spec: str | None = None, seed: int | None = None) -> dict[str, float]:
    """(Re)load the plan from ``spec`` (default: the environment) and seed the draws."""
    global _plan
    _plan = parse(os.environ.get(ENV, "") if spec is None else spec)
    seed_text = os.environ.get(SEED_ENV)
    if seed is None and seed_text:
        try:
            seed = int(seed_text)
        except ValueError:
            raise ConfigError(f"{SEED_ENV} must be an integer") from None
    _rng.seed(seed)
    return dict(_plan)


def point(name: str) -> None:
    """Crash here, with ``SIGKILL``, if the plan names this point and the draw says so."""
    plan = _plan if _plan is not None else _load()
    rate = plan.get(name)
    if rate is None:
        return
    if rate >= 1.0 or _rng.random() < rate:
        _kill(name)


def _load() -> dict[str, float]:
    configure()
    assert _plan is not None
    return _plan


def _kill(name: str) -> None:
    pid = os.getpid()
    os.write(2, f"outbox-fault: {name} pid={pid}\n".encode())
    os.kill(pid, signal.SIGKILL)
