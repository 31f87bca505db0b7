"""Group commit: many small compare-and-set writes from worker threads, one transaction.

On SQLite with ``synchronous=FULL`` every commit is an ``fsync``; a worker saving a checkpoint
after each of seven short stages would spend most of its time waiting for the disk. Writes that
arrive while a commit is in progress are gathered and committed together. Each write runs in its
own savepoint, so one that fails (lost lease, conflict) rolls back alone and reports its own
error; a caller learns its result only after the shared commit, and if that commit fails every
caller of the group gets the error. Semantics per write are exactly those of a transaction of
its own: it becomes durable before its caller goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

from sqlalchemy import Connection, Engine

from outbox_relay.shared.db_errors import translate_errors

log = logging.getLogger(__name__)

T = TypeVar("T")
Write = Callable[[Connection], T]


class GroupCommit(Generic[T]):
    """A writer thread committing queued writes in groups of up to ``max_group``."""

    def __init__(self, engine: Engine, *, max_group: int = 64) -> None:
        self.engine, self.max_group = engine, max_group
        self._queue: queue.Queue[tuple[Write[T], Future[T]]] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def write(self, write: Write[T]) -> T:
        """Run ``write`` in a transaction (shared with others) and return its result once
        committed; re-raise its own error, or the commit's."""
        if self._thread is None:
            with translate_errors(), self.engine.begin() as conn:
                return write(conn)
        future: Future[T] = Future()
        self._queue.put((write, future))
        return future.result()

    def start(self) -> None:
        """Start the writer thread (a daemon thread)."""
        self._thread = threading.Thread(target=self._loop, name="group-commit", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Commit what is queued, then stop."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not (self._stop.is_set() and self._queue.empty()):
            try:
                group = [self._queue.get(timeout=0.1)]
            except queue.Empty:
                continue
            while len(group) < self.max_group:
                try:
                    group.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._commit(group)

    def _commit(self, group: list[tuple[Write[T], Future[T]]]) -> None:
        outcomes: list[tuple[Future[T], T | None, BaseException | None]] = []
        try:
            with translate_errors(), self.engine.begin() as conn:
                for write, future in group:
                    try:
                        with conn.begin_nested():
                            outcomes.append((future, write(conn), None))
                    except Exception as err:  # this write's own failure, rolled back alone
                        outcomes.append((future, None, err))
        except Exception as err:  # the commit failed: nobody's write is durable
            for _write, future in group:
                future.set_exception(err)
            return
        for future, result, error in outcomes:
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)  # type: ignore[arg-type]
