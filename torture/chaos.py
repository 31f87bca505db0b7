"""The fault loop: restart the dead (armed with a fault point), kill at random, pause consumers
and workers (SIGSTOP, then SIGCONT; most pauses outlast their lease), send a fenced-out
consumer's late commands (torture/ghost.py), break the broker and the database on a schedule,
take the handlers' downstream down for one window, and count every kill by where it
happened."""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import Engine, text

from torture.brokers import Broker
from torture.ghost import GHOST_CLAIM, Ghost
from torture.procs import Child

log = logging.getLogger("torture")

POINTS_BY_KIND: dict[str, tuple[str, ...]] = {
    "producer": ("producer.before_commit",),
    "relay": ("relay.after_take", "relay.after_xadd", "relay.after_mark"),
    "consumer": ("consumer.after_commit", "consumer.after_ack"),
    "worker": ("worker.mid_stage", "worker.after_checkpoint"),
}
DB_FAULT = "db.terminate_backends"
# Broker faults that never read or write the database. No process is stopped while any other
# runs (an empty restart counts the marked entries, a failover commits a burst): on SQLite one
# stopped inside a transaction holds the write lock, and the loop, waiting for it inside the
# fault, could not wake it. So a pause starts only if it ends before the next such fault is
# due, and a fault due while one still runs waits for it (Chaos._pause, _waits_for_pauses).
DATABASE_FREE_FAULTS = frozenset({"redis.kill_persistent", "redis.stall"})


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
    # Pauses (0: none): mean seconds between two, and how long. Two of three outlast the lease
    # (``lease_s``, the consumers' and workers' OUTBOX_LEASE_TTL_MS): the process wakes to find
    # its streams or its run taken over or expired. Odds of each kind being paused.
    pause_every_s: float = 0.0
    pause_long_s: tuple[float, float] = (3.5, 6.0)
    pause_short_s: tuple[float, float] = (0.3, 2.0)
    lease_s: float = 3.0
    pause_weights: dict[str, float] = field(
        default_factory=lambda: {"consumer": 3.0, "worker": 1.0})
    # The handlers' downstream is down from ``outage_at_s`` into the run for ``outage_s``
    # (0: no outage); the run does not end before it is back.
    outage_at_s: float = 10.0
    outage_s: float = 0.0
    # Bursts of a fenced-out consumer's late commands (torture/ghost.py), one every this
    # many seconds on average (0: none).
    ghost_every_s: float = 0.0


@dataclass
class Tally:
    """Kills per fault point (``random.<kind>`` for harness SIGKILLs) and infra faults."""

    kills: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    unexpected_exits: list[str] = field(default_factory=list)
    unavailable_exits: Counter[str] = field(default_factory=Counter)  # per kind, see _record_death
    pauses: int = 0  # SIGSTOPs sent
    pauses_past_lease: int = 0  # woken (SIGCONT) after at least the lease
    pauses_short: int = 0  # woken before the lease
    pauses_killed: int = 0  # killed (or died) while stopped: never woken
    paused_by_kind: Counter[str] = field(default_factory=Counter)
    outage_seconds: float = 0.0  # how long the outage file existed

    def total_kills(self) -> int:
        return sum(self.kills.values())


@dataclass
class _Pause:
    child: Child
    incarnation: int
    since: float
    until: float


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
        outage_file: Path | None = None,
        flowing: Callable[[], bool] | None = None,
        felt: Callable[[], bool] | None = None,
        ghost: Ghost | None = None,
    ) -> None:
        self.plan = plan
        self.outage_file = outage_file
        self.ghost = ghost
        self.flowing = flowing
        self.felt = felt
        self._asked_at = 0.0
        self._paused: list[_Pause] = []
        self._outage_since: float | None = None
        self._outage_done = plan.outage_s <= 0 or outage_file is None
        self._started = time.monotonic()
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
        """Loop until duration, kill count and coverage are met (or the hard cap); every paused
        process is woken and the downstream is back when it returns."""
        if self.ghost is not None:
            self.ghost.start()
        try:
            return self._loop()
        finally:
            if self.ghost is not None:
                self.ghost.stop()
                self.tally.faults.update(self.ghost.counts)
            self._resume_paused(float("inf"))
            self._outage(float("inf"), end=True)

    def _loop(self) -> Tally:
        started = self._started = time.monotonic()
        next_random = started + self.rng.expovariate(1 / self.plan.random_kill_every_s)
        next_broker = started + self.plan.broker_every_s / 2
        next_db = started + self.plan.db_every_s / 2
        next_pause = started + (self.plan.pause_every_s / 2 if self.plan.pause_every_s
                                else float("inf"))
        broker_i = 0
        while True:
            now = time.monotonic()
            if self._done(now - started):
                return self.tally
            self._tend()
            faults = self.broker.faults
            fault = faults[broker_i % len(faults)] if faults else ""
            wakes = bool(fault) and fault not in DATABASE_FREE_FAULTS
            if now >= next_pause and self._pause(now, next_broker if wakes else float("inf")):
                next_pause = now + self.rng.expovariate(1 / self.plan.pause_every_s)
            if now >= next_random:
                self._random_kill()
                next_random = now + self.rng.expovariate(1 / self.plan.random_kill_every_s)
            if fault and now >= next_broker and not self._waits_for_pauses(fault):
                if self._broker_fault(fault):
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
        if self.plan.pause_every_s:
            covered = covered and bool(self.tally.pauses_past_lease and self.tally.pauses_short)
        if self.ghost is not None:
            covered = covered and bool(self.ghost.counts[GHOST_CLAIM])
        return (
            elapsed >= self.plan.duration_s
            and self.tally.total_kills() >= self.plan.kills
            and covered
            and self._outage_done
        )

    def _pause(self, now: float, before: float = float("inf")) -> bool:
        """SIGSTOP a consumer or a worker not already stopped: two of three times for longer
        than its lease; the pause ends by ``before`` (the next broker fault that would wake
        it, :data:`DATABASE_FREE_FAULTS`), and is a short one when a long one would not.
        False when not even a short one can end by then (try again later: a retried failover
        is then not held up by a pause started in between); True when one started, or when
        there is nobody to pause."""
        long_s, short_s = self.plan.pause_long_s, self.plan.pause_short_s
        long = self.tally.pauses % 3 != 1 and now + long_s[0] <= before
        low, high = long_s if long else short_s
        if now + low > before:
            return False
        stopped = {p.child.name for p in self._paused}
        among = [c for c in self.children if c.alive() and c.name not in stopped
                 and c.kind in self.plan.pause_weights]
        if not among:
            return True
        child = self.rng.choices(among, [self.plan.pause_weights[c.kind] for c in among])[0]
        child.pause()
        self.tally.pauses += 1
        self.tally.paused_by_kind[child.kind] += 1
        self._paused.append(_Pause(child, child.incarnation, now,
                                   now + self.rng.uniform(low, min(high, before - now))))
        return True

    def _resume_paused(self, now: float) -> None:
        """SIGCONT every pause that is due (all of them at ``inf``), counted by how long the
        process was stopped; one killed meanwhile is only counted."""
        due = [p for p in self._paused if p.until <= now]
        self._paused = [p for p in self._paused if p.until > now]
        for p in due:
            if p.child.incarnation != p.incarnation or not p.child.alive():
                self.tally.pauses_killed += 1
                continue
            p.child.resume()
            stopped_s = time.monotonic() - p.since
            if stopped_s >= self.plan.lease_s:
                self.tally.pauses_past_lease += 1
            else:
                self.tally.pauses_short += 1
            log.info("%s#%d woken after %.1f s", p.child.name, p.incarnation, stopped_s)

    def _outage(self, elapsed: float, *, end: bool = False) -> None:
        """Create the outage file at ``outage_at_s`` or later, once events flow (``flowing``),
        remove it ``outage_s`` later, or once a handler call has failed for it (``felt``) if
        none did by then, up to ``4 * outage_s`` (now, with ``end``). Each question is asked
        twice a second at most: on a loaded machine a daemon may take seconds to start."""
        if self.outage_file is None or self.plan.outage_s <= 0:
            return
        if self._outage_since is None:
            if end or self._outage_done or elapsed < self.plan.outage_at_s:
                return
            if not self._asked(self.flowing):
                return
            self.outage_file.touch()
            self._outage_since = time.monotonic()
            log.info("downstream down for %.0f s", self.plan.outage_s)
        elif end or self._outage_over(time.monotonic() - self._outage_since):
            self.outage_file.unlink(missing_ok=True)
            self.tally.outage_seconds = time.monotonic() - self._outage_since
            self._outage_since = None
            self._outage_done = True
            log.info("downstream back after %.1f s", self.tally.outage_seconds)

    def _tend(self) -> None:
        """Restart the dead, wake the pauses that are due, start or end the outage (also
        while a broker fault holds the loop)."""
        self._reap_and_restart()
        now = time.monotonic()
        self._resume_paused(now)
        self._outage(now - self._started)

    def _outage_over(self, down_s: float) -> bool:
        if down_s < self.plan.outage_s:
            return False
        return down_s >= 4 * self.plan.outage_s or self._asked(self.felt)

    def _asked(self, question: Callable[[], bool] | None) -> bool:
        """``question()``, True without one; False if one was asked less than 0.5 s ago."""
        if question is None:
            return True
        if time.monotonic() - self._asked_at < 0.5:
            return False
        self._asked_at = time.monotonic()
        return question()

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

    def _waits_for_pauses(self, fault: str) -> bool:
        """Whether the due broker ``fault`` waits for a process still stopped to be woken when
        its pause is due (at most ``pause_long_s[1]``). One that uses the database wakes every
        paused process first (:data:`DATABASE_FREE_FAULTS`): inflicted at once it would cut
        the pauses short, and a failover called off and retried every second (a loaded
        machine, no burst marked in time) cut every pause short, so a run could end without
        one past the lease. :meth:`_pause` starts none that would outlast the next such
        fault; this holds whatever the schedule."""
        return fault not in DATABASE_FREE_FAULTS and any(
            p.child.incarnation == p.incarnation and p.child.alive() for p in self._paused)

    def _broker_fault(self, fault: str) -> bool:
        """Inflict ``fault`` (:meth:`torture.brokers.Broker.inflict`); False if nothing was
        done (try again soon)."""
        if fault not in DATABASE_FREE_FAULTS:
            self._resume_paused(float("inf"))
        if not self.broker.inflict(fault, self.rng, self._tend):
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
