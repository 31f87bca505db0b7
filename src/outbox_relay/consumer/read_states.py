"""Whether a consumer may read new entries (``XREADGROUP >``) from each stream it owns.

The read rule (docs/guarantees.md, "What is ordered"): **no ``>`` read on a stream while any
pending entry of that stream in this group, this consumer's own included, from any earlier
epoch, has not been processed in the current epoch.** A pending pass re-reads every pending
entry of the stream in id order (after taking over other consumers' entries) and rebuilds the
set of blocked aggregates; only then may newer entries be read behind them.

Each owned stream is in one of two states:

- ``draining``: a pending pass over all its pending entries is due before anything new is
  read. A stream starts here, and comes back here whenever that may no longer hold: it is
  (re)acquired or its epoch changes (a renewal gave it back after a rebalance, an expired lease
  taken again after a pause), a pending pass over it starts (the pass clears the blocked set
  it rebuilds), a batch of it did not complete (lease lost, database or Redis unavailable), a
  read of it had an unknown outcome, or another consumer holds pending entries on it.
- ``readable``: a pending pass over all its pending entries completed under the epoch the
  stream still holds, and nothing since sent it back.

Every state is recorded with the epoch it was reached under, so a stream held under another
epoch reads as ``draining`` whichever path changed the epoch. :meth:`ReadStates.move` is the
one function that changes a state; moving to ``readable`` takes the :class:`PassStart` of the
pass that drained the stream and refuses when the epoch or anything else changed since that
pass began: a renewal during a pass cannot let the next read race it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger(__name__)

State = Literal["draining", "readable"]
DRAINING: State = "draining"
READABLE: State = "readable"


@dataclass(frozen=True)
class PassStart:
    """What a pending pass began from: each stream's epoch and its count of moves to
    ``draining`` (which the pass's own start made)."""

    marks: Mapping[str, tuple[int, int]]


class ReadStates:
    """The read state of each stream one consumer holds (see the module docstring)."""

    def __init__(self) -> None:
        self._states: dict[str, tuple[State, int]] = {}  # key -> (state, epoch reached under)
        self._drains: dict[str, int] = {}  # key -> moves to draining so far

    def state(self, key: str, held: Mapping[str, int]) -> State | None:
        """``readable``, ``draining``, or None when the stream is not held."""
        epoch = held.get(key)
        if epoch is None:
            return None
        state, at = self._states.get(key, (DRAINING, epoch))
        return state if at == epoch else DRAINING

    def readable(self, keys: Iterable[str], held: Mapping[str, int]) -> list[str]:
        """Those of ``keys`` that are ``readable`` (in the given order): the only streams a
        ``>`` read may name."""
        return [k for k in keys if self.state(k, held) == READABLE]

    def draining(self, keys: Iterable[str], held: Mapping[str, int]) -> list[str]:
        """Those of ``keys`` held and ``draining``: they call for a pending pass."""
        return [k for k in keys if self.state(k, held) == DRAINING]

    def begin_pass(self, keys: Iterable[str], held: Mapping[str, int]) -> PassStart:
        """A pending pass over ``keys`` starts: they are ``draining`` until it completes."""
        keys = [k for k in keys if k in held]
        self.move(keys, DRAINING, held, why="pending pass")
        return PassStart({k: (held[k], self._drains[k]) for k in keys})

    def covers(self, started: PassStart, key: str, held: Mapping[str, int]) -> bool:
        """Whether the pass that began at ``started`` can still drain ``key``: it covered it,
        and since then the key kept its epoch and nothing sent it back to draining."""
        epoch = held.get(key)
        return epoch is not None and started.marks.get(key) == (epoch, self._drains.get(key))

    def move(
        self, keys: Iterable[str], to: State, held: Mapping[str, int], *,
        started: PassStart | None = None, why: str = "",
    ) -> list[str]:
        """Move the held ones of ``keys`` to state ``to``; return the keys moved.

        To ``readable`` only with ``started``, the pass that drained them, and only those it
        covered whose epoch and drain count are still what they were when it began (the
        re-check after the pass, before any ``>`` read)."""
        moved = []
        for key in keys:
            epoch = held.get(key)
            if epoch is None:
                continue
            if to == READABLE:
                if started is None or not self.covers(started, key, held):
                    continue
            else:
                self._drains[key] = self._drains.get(key, 0) + 1
            self._states[key] = (to, epoch)
            moved.append(key)
        if moved and why:
            log.debug("streams %s now %s (%s)", moved, to, why)
        return moved
