"""The run state machine: four generic statuses, the application's stages, forward-only rules.

The application names its stages, in execution order, and which of them may ask the user
(:class:`Pipeline`). A run's status is ``queued``, one of those stages (the one it runs, or
will run, next), ``needs_input``, ``completed`` or ``failed``::

    queued → stage 1 → stage 2 → … → stage n → completed
                 ↘ needs_input ↗  (an asking stage; answered: the stage after it)
    any active status → failed

Two rules refuse every backward move, so a late callback or a replayed event can never reopen a
finished run or re-enter a finished stage: a change of status must be one the pipeline allows,
and the run's position (:meth:`Pipeline.rank`; ``needs_input`` sits just above the stage that
asked) must grow. Staying in the same active status is allowed (a lease or an attempt counter
changes without moving the run). Terminal runs accept no write at all.

Some writers do not run stages and need no pipeline: the HTTP API (create, answer), the sweeper
and ``outbox reconcile`` (resume, fail). For them :func:`check_transition` without a pipeline
allows exactly what cannot move a run along its stages: staying, failing, and leaving
``needs_input`` for the stage the worker recorded when the question was asked (``resume_at``,
computed from the pipeline). Everything else needs the pipeline.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from outbox_relay.runs.errors import InvalidTransitionError
from outbox_relay.shared.errors import ConfigError

QUEUED = "queued"
NEEDS_INPUT = "needs_input"
COMPLETED = "completed"
FAILED = "failed"

GENERIC = frozenset({QUEUED, NEEDS_INPUT, COMPLETED, FAILED})
"""The statuses every run has, whatever its stages; a stage may not take one of these names."""
TERMINAL = frozenset({COMPLETED, FAILED})
STAGE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
"""A stage name: it is stored as the run's status (32 characters) and shown in metrics."""


def is_terminal(status: str) -> bool:
    """``completed`` or ``failed``: the run accepts no further write."""
    return status in TERMINAL


def in_stage(status: str) -> bool:
    """True when ``status`` names a stage (any status that is not one of the four generic)."""
    return status not in GENERIC


def is_runnable(status: str) -> bool:
    """True when a worker has a stage to run (queued, or in a stage)."""
    return status == QUEUED or in_stage(status)


@dataclass(frozen=True, init=False)
class Pipeline:
    """The application's stages in execution order, and those that may ask the user.

    Refuses (:class:`ConfigError`, ``invalid_config``) an empty or repeated stage list, a name
    that is not ``[a-z][a-z0-9_]{0,31}`` or is one of the generic statuses, an asking stage that
    is not a stage, and an asking last stage (the answers must have a stage to use them).
    """

    stages: tuple[str, ...]
    asking: frozenset[str]

    def __init__(self, stages: Iterable[str], asking: Iterable[str] = ()) -> None:
        if isinstance(stages, str) or isinstance(asking, str):
            raise ConfigError("stages and asking are lists of stage names, not one string")
        stages, asking = tuple(stages), frozenset(asking)
        bad = [s for s in stages if not isinstance(s, str) or not STAGE_NAME.match(s)]
        if not stages or bad or len(set(stages)) != len(stages) or set(stages) & GENERIC:
            raise ConfigError(
                "a pipeline needs one or more distinct stage names matching "
                f"[a-z][a-z0-9_]{{0,31}}, none of {sorted(GENERIC)}; got {list(stages)!r}")
        if not asking <= set(stages):
            raise ConfigError(f"asking stages {sorted(asking - set(stages))} are not stages")
        if stages[-1] in asking:
            raise ConfigError(f"the last stage ({stages[-1]}) cannot ask: no stage would use "
                              "the answers")
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "asking", asking)

    @property
    def first(self) -> str:
        """The stage a queued run starts with."""
        return self.stages[0]

    @property
    def statuses(self) -> frozenset[str]:
        """Every status a run of this pipeline can have."""
        return GENERIC | set(self.stages)

    def next_stage(self, stage: str) -> str:
        """The status after ``stage`` finished: the next stage, or ``completed`` after the last."""
        index = self._index(stage)
        return self.stages[index + 1] if index + 1 < len(self.stages) else COMPLETED

    def rank(self, status: str, asked_by: str | None = None) -> int:
        """A run's place on the forward-only scale; ``needs_input`` sits just above ``asked_by``."""
        if status == QUEUED:
            return 0
        if status in TERMINAL:
            return 10 * (len(self.stages) + 2)
        if status == NEEDS_INPUT:
            if asked_by not in self.asking:
                raise InvalidTransitionError(
                    f"needs_input must name the stage that asked, not {asked_by!r}")
            return 10 * (self._index(asked_by) + 1) + 5
        return 10 * (self._index(status) + 1)

    def allowed(self, current: str) -> frozenset[str]:
        """Every status ``current`` may change to (staying put aside)."""
        if current in TERMINAL:
            return frozenset()
        if current == QUEUED:
            return frozenset({self.first, FAILED})
        if current == NEEDS_INPUT:
            return frozenset({self.next_stage(s) for s in self.asking} | {FAILED})
        asks = {NEEDS_INPUT} if current in self.asking else set()
        return frozenset({self.next_stage(current), FAILED, *asks})

    def check_transition(
        self, current: str, new: str, *, asked_by: str | None = None,
        new_asked_by: str | None = None,
    ) -> None:
        """Raise :class:`InvalidTransitionError` unless ``current → new`` is allowed and forward.

        ``asked_by`` is the stage that asked while the run is (or was) in ``needs_input``;
        ``new_asked_by`` the one named when entering ``needs_input`` (it must be ``current``).
        Leaving ``needs_input`` is allowed only to the stage right after ``asked_by``.
        """
        _check_common(current, new, asked_by, new_asked_by)
        if new == FAILED:  # from any active status, even a stage this pipeline no longer has
            return
        for status in (current, new):
            if status not in self.statuses:
                raise InvalidTransitionError(f"{status!r} is not a status of this pipeline")
        if new == current:
            return
        if new not in self.allowed(current):
            raise InvalidTransitionError(f"{current} → {new} is not an allowed transition")
        if new == NEEDS_INPUT and new_asked_by != current:
            raise InvalidTransitionError("needs_input must name the stage that asked")
        if current == NEEDS_INPUT and new != FAILED and new != self.next_stage(str(asked_by)):
            raise InvalidTransitionError(f"an answered run resumes after {asked_by}, not at {new}")
        if self.rank(new, new_asked_by) <= self.rank(current, asked_by):
            raise InvalidTransitionError(f"{current} → {new} would move the run backward")

    def _index(self, stage: str | None) -> int:
        try:
            return self.stages.index(str(stage))
        except ValueError:
            raise InvalidTransitionError(f"{stage!r} is not a stage of this pipeline") from None


def check_transition(
    pipeline: Pipeline | None, current: str, new: str, before: dict[str, Any],
    after: dict[str, Any],
) -> None:
    """The one check every write of a run goes through (``before``/``after``: its records).

    With a pipeline, :meth:`Pipeline.check_transition`. Without one (see the module docstring),
    only staying, failing, and leaving ``needs_input`` for the recorded ``resume_at``. Either
    way a waiting run keeps where it resumes, and leaves ``needs_input`` (other than to
    ``failed``) only once no question is pending; entering it through a pipeline records the
    stage after the asking one.
    """
    asked_by, new_asked_by = before.get("asked_by"), after.get("asked_by")
    _check_waiting(pipeline, current, new, before, after)
    if pipeline is not None:
        pipeline.check_transition(current, new, asked_by=asked_by, new_asked_by=new_asked_by)
        return
    _check_common(current, new, asked_by, new_asked_by)
    if new in (current, FAILED):
        return
    if current == NEEDS_INPUT and in_stage(new) and new == before.get("resume_at"):
        return
    raise InvalidTransitionError(
        f"{current} → {new} moves the run along its stages: only a worker with the pipeline may")


def _check_waiting(
    pipeline: Pipeline | None, current: str, new: str, before: dict[str, Any],
    after: dict[str, Any],
) -> None:
    if current == new == NEEDS_INPUT and after.get("resume_at") != before.get("resume_at"):
        raise InvalidTransitionError("a waiting run cannot change where it resumes")
    if current == NEEDS_INPUT and new not in (NEEDS_INPUT, FAILED) and after.get("questions"):
        raise InvalidTransitionError("a run with pending questions cannot go on")
    if (new == NEEDS_INPUT != current and pipeline is not None and current in pipeline.stages
            and after.get("resume_at") != pipeline.next_stage(current)):
        raise InvalidTransitionError("a run that asks must record the stage after the asking one")


def _check_common(current: str, new: str, asked_by: str | None, new_asked_by: str | None) -> None:
    for status in (current, new):
        if status not in GENERIC and not STAGE_NAME.match(status):
            raise InvalidTransitionError(f"{status!r} is not a run status")
    if current in TERMINAL:
        raise InvalidTransitionError(f"the run is {current}; it accepts no further change")
    if new == current == NEEDS_INPUT and new_asked_by not in (None, asked_by):
        raise InvalidTransitionError("a waiting run cannot change the stage that asked")
