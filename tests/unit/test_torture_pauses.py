"""The torture's pauses and downstream outage (torture/chaos.py) on real processes, and the
verdict on what the plan promised (``torture.harness.plan_violations``)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, cast

from torture import harness
from torture.chaos import Chaos, Plan, Tally
from torture.ghost import GHOST_CLAIM
from torture.procs import Child


def stopped(child: Child) -> bool:
    """Whether the process is stopped now (``T`` in ``/proc/<pid>/stat``)."""
    assert child.proc is not None
    stat = Path(f"/proc/{child.proc.pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def becomes(child: Child, want: bool) -> bool:
    """Whether the process is (or within 2 s gets) stopped (``want``) or running: a signal
    just sent takes a moment to arrive."""
    deadline = time.monotonic() + 2
    while stopped(child) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return stopped(child) == want


def sleeper(tmp_path: Path, name: str = "consumer-0", kind: str = "consumer") -> Child:
    child = Child(name, kind, [sys.executable, "-c", "import time; time.sleep(60)"], {},
                  tmp_path)
    child.start()
    return child


def plan(**overrides: Any) -> Plan:
    fields: dict[str, Any] = dict(
        duration_s=0, kills=0, max_s=10, rates={}, random_kill_every_s=1.0,
        broker_every_s=100.0, db_every_s=100.0, pause_every_s=1.0, pause_long_s=(0.3, 0.3),
        pause_short_s=(0.05, 0.05), lease_s=0.2)
    return Plan(**{**fields, **overrides})


def chaos(p: Plan, kids: list[Child], outage_file: Path | None = None) -> Chaos:
    broker = cast(Any, type("NoBroker", (), {"faults": []})())
    return Chaos(p, kids, broker, seed=1, terminate_backends=None, outage_file=outage_file)


def test_pauses_outlast_the_lease_two_times_in_three_and_are_counted(tmp_path: Path) -> None:
    child = sleeper(tmp_path)
    c = chaos(plan(), [child])
    try:
        c._pause(time.monotonic())  # the first pause is a long one
        assert becomes(child, True)
        time.sleep(0.25)  # past the 0.2 s lease
        c._resume_paused(0.0)  # not due yet: still stopped
        assert stopped(child)
        c._resume_paused(float("inf"))  # due: woken, counted past the lease (stopped 0.25 s)
        assert becomes(child, False)
        c._pause(time.monotonic())  # the second, a short one
        c._resume_paused(float("inf"))
        assert becomes(child, False)
        c._pause(time.monotonic())
        child.kill()  # killed while stopped: never woken
        c._resume_paused(float("inf"))
    finally:
        child.stop()
    t = c.tally
    assert (t.pauses, t.pauses_past_lease, t.pauses_short, t.pauses_killed) == (3, 1, 1, 1)
    assert t.paused_by_kind == {"consumer": 3}


def test_only_consumers_and_workers_are_paused_and_stop_wakes_a_paused_child(
    tmp_path: Path,
) -> None:
    relay = sleeper(tmp_path, "relay-0", "relay")
    worker = sleeper(tmp_path, "worker-0", "worker")
    c = chaos(plan(), [relay, worker])
    try:
        c._pause(time.monotonic())
        c._pause(time.monotonic())  # the worker is stopped already: nobody else to pause
        assert becomes(worker, True) and not stopped(relay)
        assert c.tally.pauses == 1
        assert worker.stop(timeout=5) == -15  # SIGTERM reaches it: SIGCONT went with it
    finally:
        relay.stop()
        worker.stop()


def test_paused_processes_are_woken_before_a_broker_fault_that_uses_the_database(
    tmp_path: Path,
) -> None:
    child = sleeper(tmp_path)
    seen: list[tuple[str, bool]] = []

    class Broker:
        faults = ["redis.stall", "redis.restart_empty"]

        def inflict(self, fault: str, _rng: Any, _tend: Any) -> bool:
            seen.append((fault, stopped(child)))
            return True

    c = Chaos(plan(pause_long_s=(30, 30)), [child], cast(Any, Broker()), seed=1,
              terminate_backends=None)
    try:
        c._pause(time.monotonic())
        assert becomes(child, True)
        c._broker_fault("redis.stall")  # no database: the pause goes on
        c._broker_fault("redis.restart_empty")  # counts marked entries: woken first
    finally:
        child.stop()
    assert seen == [("redis.stall", True), ("redis.restart_empty", False)]
    assert c.tally.pauses_short == 1  # counted by how long it was stopped, not as planned


def test_the_outage_file_exists_for_its_window_and_run_ends_it(tmp_path: Path) -> None:
    marker = tmp_path / "down"
    c = chaos(plan(outage_at_s=1.0, outage_s=0.2), [], marker)
    c._outage(0.5)
    assert not marker.exists()
    c._outage(1.0)
    assert marker.exists() and not c._done(5)  # the run waits for the downstream
    time.sleep(0.2)
    c._outage(1.3)
    assert not marker.exists() and c.tally.outage_seconds >= 0.2
    c._outage(5.0)  # once only
    assert not marker.exists()
    cut = chaos(plan(outage_at_s=0.0, outage_s=60), [], tmp_path / "cut")
    cut.plan.max_s = 0.2
    tally = cut.run()  # the hard cap ends the run: the downstream is back anyway
    assert not (tmp_path / "cut").exists() and 0 < tally.outage_seconds < 60


def test_the_outage_waits_for_events_to_flow(tmp_path: Path) -> None:
    marker = tmp_path / "down"
    flowing = [False]
    c = chaos(plan(outage_at_s=0.0, outage_s=5), [], marker)
    c.flowing = lambda: flowing[0]
    c._outage(1.0)
    assert not marker.exists()  # nothing received yet: the downstream stays up
    flowing[0] = True
    c._outage(1.1)
    assert not marker.exists()  # asked twice a second at most
    time.sleep(0.5)
    c._outage(1.6)
    assert marker.exists()
    c._outage(0, end=True)
    assert not marker.exists()


def test_the_outage_lasts_until_a_call_failed_for_it(tmp_path: Path) -> None:
    marker = tmp_path / "down"
    felt = [False]
    c = chaos(plan(outage_at_s=0.0, outage_s=0.5), [], marker)  # at most 2 s
    c.felt = lambda: felt[0]
    c._outage(0.0)
    assert marker.exists()
    time.sleep(0.6)
    c._outage(0.6)
    assert marker.exists()  # its time is up, but no handler call failed yet
    felt[0] = True
    time.sleep(0.5)
    c._outage(1.1)
    assert not marker.exists() and 1.0 <= c.tally.outage_seconds < 2


def test_the_plan_promises_are_violations_when_unmet() -> None:
    p = plan(outage_s=18)
    ok = Tally(pauses=3, pauses_past_lease=2, pauses_short=1, outage_seconds=18.0)
    assert harness.plan_violations(p, ok, outage_failures=5, chained_applied=3) == []
    assert harness.plan_violations(p, Tally(outage_seconds=10.0), 0, 0) == [
        "never_paused_past_lease", "never_paused_briefly", "outage_cut_short:10.0s",
        "outage_failed_no_call", "nothing_chained"]
    off = plan(pause_every_s=0.0, outage_s=0.0)
    assert harness.plan_violations(off, Tally(), 0, 1) == []
    haunted = plan(pause_every_s=0.0, outage_s=0.0, ghost_every_s=4.0)
    assert harness.plan_violations(haunted, Tally(), 0, 1) == ["ghost_never_claimed"]
    claimed = Tally()
    claimed.faults[GHOST_CLAIM] = 1
    assert harness.plan_violations(haunted, claimed, 0, 1) == []


def test_a_broker_fault_called_off_and_retried_cuts_no_pause_short(tmp_path: Path) -> None:
    """A failover called off (no burst marked in time) is retried a second later, and each
    try wakes the paused processes first: on a loaded machine every pause was cut short and
    the run never paused past the lease (``never_paused_past_lease`` in CI). Now no pause
    runs when a try comes: every pause is planned past the lease, and none is counted
    short at any try (the old code woke the first, 0.1 s old, at the first try)."""
    child = sleeper(tmp_path)
    short_at_try: list[int] = []

    class CalledOff:
        faults = ["redis.failover"]

        def inflict(self, fault: str, _rng: Any, _tend: Any) -> bool:
            short_at_try.append(c.tally.pauses_short)
            if len(short_at_try) == 2:
                c.plan.max_s = 0.0  # the loop ends before its next pause
            return False  # called off: tried again a second later

    # The first pause due at 0.1 s (0.5 s long, past the 0.2 s lease), the fault at 0.2 s.
    p = plan(pause_every_s=0.2, pause_long_s=(0.5, 0.5), pause_short_s=(0.5, 0.5),
             broker_every_s=0.4, random_kill_every_s=1e9, max_s=30)
    c = Chaos(p, [child], cast(Any, CalledOff()), seed=1, terminate_backends=None)
    try:
        tally = c.run()
    finally:
        child.stop()
    assert short_at_try == [0, 0]
    assert tally.pauses_past_lease >= 1 and tally.pauses_short == 0


def test_a_pause_starts_only_if_it_ends_before_the_next_fault_that_would_wake_it(
    tmp_path: Path,
) -> None:
    """``Chaos._pause(now, before)``: a pause that cannot end by ``before`` (a broker fault
    that uses the database) does not start, so that fault is neither held up by it nor
    cuts it short; a long one that cannot is a short one if that can; one that starts is
    stopped until ``before`` at the latest."""
    child = sleeper(tmp_path)
    c = chaos(plan(pause_long_s=(0.3, 5.0), pause_short_s=(0.2, 0.25)), [child])
    try:
        now = time.monotonic()
        assert c._pause(now, now + 0.1) is False  # neither 0.3 s nor 0.2 s would end in time
        assert not stopped(child) and c.tally.pauses == 0
        assert c._pause(now, now + 0.4) is True  # the first pause, long
        assert becomes(child, True)
        (pause,) = c._paused
        assert 0.3 <= pause.until - now <= 0.4
        c._resume_paused(float("inf"))
        assert becomes(child, False)
        c.tally.pauses = 3  # the next is a long one again
        assert c._pause(now, now + 0.22) is True  # no room for a long one: a short one
        (pause,) = c._paused
        assert 0.2 <= pause.until - now <= 0.22
    finally:
        child.stop()
