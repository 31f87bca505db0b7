"""The fault loop: restart the dead (armed with a fault point), kill at random, break the broker
and the database on a schedule, and count every kill by where it happened."""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import Engine, text

from torture.brokers import Broker
from torture.procs import Child

log = logging.getLogger("torture")

POINTS_BY_KIND: dict[str, tuple[str, ...]] = {
    "producer": ("producer.before_commit",),
    "relay": ("relay.after_take", "relay.after_xadd", "relay.after_mark"),
    "consumer": ("consumer.after_commit", "consumer.after_ack"),
    "worker": ("worker.mid_stage", "worker.after_checkpoint"),
}
DB_FAULT = "db.terminate_backends"


@dataclass
class Plan:
    """How hard to hit: rates per kind, mean seconds between random kills and infra faults."""

    duration_s: float
    kills: int
    max_s: float
    rates: dict[str, float]
    random_kill_every_s: float
    broker_every_s: float
    db_every_s: float
    stall_s: tuple[float, float] = (1.0, 3.0)
    unarmed_share: float = 0.25
    # Odds of each kind being the random kill's victim, relative to 1 for the others:
    # consumers die twice as often (two of them share a group and hand partitions over).
    victim_weights: dict[str, float] = field(default_factory=lambda: {"consumer": 2.0})


@dataclass
class Tally:
    """Kills per fault point (``random.<kind>`` for harness SIGKILLs) and infra faults."""

    kills: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    unexpected_exits: list[str] = field(default_factory=list)
    unavailable_exits: Counter[str] = field(default_factory=Counter)  # per kind, see _record_death

    def total_kills(self) -> int:
        return sum(self.kills.values())


class Chaos:
    """Drives one database's torture run until the plan is met."""

    def __init__(
        self,
        plan: Plan,
        children: list[Child],
        broker: Broker,
        *,
        seed: int,
        terminate_backends: Callable[[], int] | None,
    ) -> None:
        self.plan = plan
        self.children = children
        self.broker = broker
        self.rng = random.Random(seed)
        self.terminate_backends = terminate_backends
        self.tally = Tally()
        self._next_point: Counter[str] = Counter()
        kinds = {c.kind for c in children}
        self.points = [p for k in sorted(kinds) for p in POINTS_BY_KIND.get(k, ())]

    def arm(self, child: Child) -> str:
        """A point of this kind among those with the fewest kills so far, round robin among
        equals (``unarmed_share`` of incarnations run unarmed, dying only by a harness kill).

        Fewest kills first: a point that fires rarely (``relay.after_mark`` needs a whole
        round to finish) is armed again and again until it fired, so coverage does not wait
        on luck."""
        points = POINTS_BY_KIND.get(child.kind, ())
        if not points or self.rng.random() < self.plan.unarmed_share:
            return ""
        least = min(self.tally.kills[p] for p in points)
        candidates = [p for p in points if self.tally.kills[p] == least]
        i = self._next_point[child.kind]
        self._next_point[child.kind] += 1
        rate = self.plan.rates.get(child.kind, 0.05) * self.rng.uniform(0.5, 1.5)
        return f"{candidates[i % len(candidates)]}:{min(rate, 1.0):.4f}"

    def run(self) -> Tally:
        """Loop until duration, kill count and coverage are met (or the hard cap)."""
        started = time.monotonic()
        next_random = started + self.rng.expovariate(1 / self.plan.random_kill_every_s)
        next_broker = started + self.plan.broker_every_s / 2
        next_db = started + self.plan.db_every_s / 2
        broker_i = 0
        while True:
            now = time.monotonic()
            if self._done(now - started):
                return self.tally
            self._reap_and_restart()
            if now >= next_random:
                self._random_kill()
                next_random = now + self.rng.expovariate(1 / self.plan.random_kill_every_s)
            if now >= next_broker:
                faults = self.broker.faults
                if self._broker_fault(faults[broker_i % len(faults)]):
                    broker_i += 1
                    next_broker = time.monotonic() + self.plan.broker_every_s
                else:  # nothing to lose yet: try again soon
                    next_broker = time.monotonic() + 1.0
            if self.terminate_backends is not None and now >= next_db:
                n = self.terminate_backends()
                self.tally.faults[DB_FAULT] += 1
                log.info("terminated %d database connections", n)
                next_db = time.monotonic() + self.plan.db_every_s
            time.sleep(0.05)

    def _done(self, elapsed: float) -> bool:
        if elapsed >= self.plan.max_s:
            return True
        covered = bool(all(self.tally.kills[p] for p in self.points) and all(
            self.tally.faults[f] for f in self.broker.faults
        ) and (self.terminate_backends is None or self.tally.faults[DB_FAULT]))
        return (
            elapsed >= self.plan.duration_s
            and self.tally.total_kills() >= self.plan.kills
            and covered
        )

    def _reap_and_restart(self) -> None:
        for child in self.children:
            if child.alive():
                continue
            if child.proc is not None:
                self._record_death(child)
            child.start(self.arm(child))

    def _record_death(self, child: Child) -> None:
        code = child.returncode()
        point = child.fault_fired()
        if point is not None:
            self.tally.kills[point] += 1
        elif child.gave_up_unavailable():  # while starting, during a broker or database fault
            self.tally.unavailable_exits[child.kind] += 1
            log.info("%s gave up starting: unavailable (log %s)", child.name, child.logs[-1])
        elif code != -9:
            self.tally.unexpected_exits.append(f"{child.name}#{child.incarnation}: exit {code}")
            log.warning("%s exited with %s (log %s)", child.name, code, child.logs[-1])

    def _random_kill(self) -> None:
        alive = [c for c in self.children if c.alive()]
        if not alive:
            return
        weights = [self.plan.victim_weights.get(c.kind, 1.0) for c in alive]
        victim = self.rng.choices(alive, weights)[0]
        victim.kill()
        if victim.fault_fired() is None:  # not already dying at a point
            self.tally.kills[f"random.{victim.kind}"] += 1
            victim.proc = None  # recorded here; restart without recording again
            victim.start(self.arm(victim))

    def _broker_fault(self, fault: str) -> bool:
        """Inflict ``fault`` (:meth:`torture.brokers.Broker.inflict`); False if nothing was
        done (try again soon)."""
        if not self.broker.inflict(fault, self.rng, self._reap_and_restart):
            return False
        self.tally.faults[fault] += 1
        return True


def terminate_backends_by_app_name(admin: Engine, application_name: str) -> Callable[[], int]:
    """A function that kills only our children's PostgreSQL sessions (by application_name)."""

    def terminate() -> int:
        with admin.begin() as conn:
            rows = conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = :name AND pid <> pg_backend_pid()"
                ),
                {"name": application_name},
            ).all()
        return len(rows)

    return terminate
