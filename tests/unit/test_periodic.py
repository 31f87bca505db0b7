"""Housekeeping tasks: on the loop thread, or (background) on a thread of their own, one run at
a time, failures logged instead of lost."""

from __future__ import annotations

import logging
import threading

import pytest

from outbox_relay.shared.errors import UnavailableError
from outbox_relay.shared.periodic import Periodic, run_due, shutdown


def test_a_foreground_task_runs_on_the_caller_thread_and_raises() -> None:
    seen: list[str] = []
    task = Periodic("fg", 60.0, lambda: seen.append(threading.current_thread().name))
    assert task.maybe_run(now=1.0) and not task.maybe_run(now=2.0)  # not due again yet
    assert seen == [threading.current_thread().name]

    def boom() -> None:
        raise RuntimeError("bug")

    with pytest.raises(RuntimeError):
        Periodic("fg", 1.0, boom).maybe_run()


def test_a_background_task_runs_once_at_a_time_off_the_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    started, release = threading.Event(), threading.Event()
    threads: list[str] = []

    def slow() -> None:
        threads.append(threading.current_thread().name)
        started.set()
        release.wait(10)

    task = Periodic("bg", 0.0, slow, background=True)
    assert task.maybe_run()
    assert started.wait(10)
    assert not task.maybe_run()  # due, but its previous run is still going
    release.set()
    shutdown([task])
    assert threads == ["outbox-bg_0"] and task.runs == 1

    def failing() -> None:
        raise RuntimeError("bug in a housekeeping task")

    def unavailable() -> None:
        raise UnavailableError("database down")

    with caplog.at_level(logging.WARNING, logger="outbox_relay.shared.periodic"):
        for run in (failing, unavailable):
            bad = Periodic("bad", 0.0, run, background=True)
            run_due([bad])
            shutdown([bad])
            assert bad.failures == 1 and bad.runs == 0
    assert "bad failed; retrying" in caplog.text and "database down" in caplog.text
