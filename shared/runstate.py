"""The run state machine: statuses, the one transition table, the forward-only rank, the snapshot.

A run walks its stages in a fixed order::

    queued → ingesting_inputs → normalizing_candidate → analyzing_jd → matching_evidence
           → drafting → validating → rendering → completed

A stage that may ask the user (``ASKING_STAGES``) can move the run to ``needs_input``; once every
question is answered the run goes on with the stage *after* the one that asked (its result is
already in the checkpoint). ``failed`` is reachable from every active status. ``completed`` and
``failed`` are terminal.

Two rules refuse every backward move, so a late callback or a replayed event can never reopen a
finished run or re-enter a finished stage:

* :data:`TRANSITIONS` lists, once, every status change that is allowed;
* :data:`ACTIVE_STATUS_RANK` orders the statuses; ``needs_input`` ranks just above the stage that
  asked (the ``asked_by`` stage), so the run's position never decreases.

Staying in the same active status is allowed (a lease or attempt counter changes without moving
the run). Terminal runs accept no write at all.

Only :class:`RunSnapshot` leaves the service: revision, request, checkpoint, answers and receipts
stay inside the stored record.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from outbox_relay.shared.errors import InvalidTransitionError
from outbox_relay.shared.settings import CommonSettings

QUEUED = "queued"
INGESTING_INPUTS = "ingesting_inputs"
NORMALIZING_CANDIDATE = "normalizing_candidate"
ANALYZING_JD = "analyzing_jd"
MATCHING_EVIDENCE = "matching_evidence"
DRAFTING = "drafting"
VALIDATING = "validating"
RENDERING = "rendering"
NEEDS_INPUT = "needs_input"
COMPLETED = "completed"
FAILED = "failed"

STAGES: tuple[str, ...] = (
    INGESTING_INPUTS, NORMALIZING_CANDIDATE, ANALYZING_JD, MATCHING_EVIDENCE,
    DRAFTING, VALIDATING, RENDERING,
)
"""Work stages in execution order; a run's status is the stage it runs (or will run) next."""

ASKING_STAGES = frozenset({NORMALIZING_CANDIDATE, ANALYZING_JD, MATCHING_EVIDENCE})
"""Stages whose result may carry questions for the user."""

TERMINAL = frozenset({COMPLETED, FAILED})
STATUSES = frozenset({QUEUED, *STAGES, NEEDS_INPUT, COMPLETED, FAILED})

TRANSITIONS: dict[str, frozenset[str]] = {
    QUEUED: frozenset({INGESTING_INPUTS, FAILED}),
    INGESTING_INPUTS: frozenset({NORMALIZING_CANDIDATE, FAILED}),
    NORMALIZING_CANDIDATE: frozenset({ANALYZING_JD, NEEDS_INPUT, FAILED}),
    ANALYZING_JD: frozenset({MATCHING_EVIDENCE, NEEDS_INPUT, FAILED}),
    MATCHING_EVIDENCE: frozenset({DRAFTING, NEEDS_INPUT, FAILED}),
    DRAFTING: frozenset({VALIDATING, FAILED}),
    VALIDATING: frozenset({RENDERING, FAILED}),
    RENDERING: frozenset({COMPLETED, FAILED}),
    NEEDS_INPUT: frozenset({ANALYZING_JD, MATCHING_EVIDENCE, DRAFTING, FAILED}),
    COMPLETED: frozenset(),
    FAILED: frozenset(),
}
"""Every allowed change of status (staying in an active status is allowed besides)."""

ACTIVE_STATUS_RANK: dict[str, int] = {
    QUEUED: 0,
    **{stage: 10 * (i + 1) for i, stage in enumerate(STAGES)},
    COMPLETED: 1000,
    FAILED: 1000,
}
"""Forward-only order. ``needs_input`` is ranked by :func:`position` from the stage that asked."""


def next_stage(stage: str) -> str:
    """The status after ``stage`` finished: the next stage, or ``completed`` after the last."""
    index = STAGES.index(stage)
    return STAGES[index + 1] if index + 1 < len(STAGES) else COMPLETED


def position(status: str, asked_by: str | None = None) -> int:
    """A run's place on the forward-only scale; ``needs_input`` sits just above ``asked_by``."""
    if status == NEEDS_INPUT:
        if asked_by not in ASKING_STAGES:
            raise InvalidTransitionError(f"needs_input must name the stage that asked, not "
                                         f"{asked_by!r}")
        return ACTIVE_STATUS_RANK[asked_by] + 5
    if status not in ACTIVE_STATUS_RANK:
        raise InvalidTransitionError(f"unknown status {status!r}")
    return ACTIVE_STATUS_RANK[status]


def check_transition(
    current: str, new: str, *, asked_by: str | None = None, new_asked_by: str | None = None
) -> None:
    """Raise :class:`InvalidTransitionError` unless ``current → new`` is allowed and forward.

    ``asked_by`` is the stage that asked while the run is (or was) in ``needs_input``;
    ``new_asked_by`` the one named when entering ``needs_input`` (it must be ``current``).
    Leaving ``needs_input`` is allowed only to the stage right after ``asked_by``.
    """
    if current not in STATUSES or new not in STATUSES:
        raise InvalidTransitionError(f"unknown status in {current!r} → {new!r}")
    if current in TERMINAL:
        raise InvalidTransitionError(f"the run is {current}; it accepts no further change")
    if new == current:
        if new == NEEDS_INPUT and new_asked_by not in (None, asked_by):
            raise InvalidTransitionError("a waiting run cannot change the stage that asked")
        return
    if new not in TRANSITIONS[current]:
        raise InvalidTransitionError(f"{current} → {new} is not an allowed transition")
    if new == NEEDS_INPUT and new_asked_by != current:
        raise InvalidTransitionError("needs_input must name the stage that asked")
    if current == NEEDS_INPUT and new != FAILED and new != next_stage(str(asked_by)):
        raise InvalidTransitionError(f"an answered run resumes after {asked_by}, not at {new}")
    if position(new, new_asked_by) <= position(current, asked_by) and new != FAILED:
        raise InvalidTransitionError(f"{current} → {new} would move the run backward")


def is_runnable(status: str) -> bool:
    """True when a worker has a stage to run (queued or a stage status)."""
    return status == QUEUED or status in STAGES


class Question(BaseModel):
    """A question a stage asks the user; answered by ``interaction_id``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    interaction_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$")
    prompt: str = Field(min_length=1, max_length=2_000)
    stage: str | None = None


class RunSnapshot(BaseModel):
    """The public view of a run: the only shape that ever leaves the service."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    status: str
    stage: str | None = Field(None, description="The stage the run is in, or asked from.")
    created_at: datetime
    updated_at: datetime
    questions: list[Question] = Field(default_factory=list, description="Pending questions.")
    result: Any = Field(None, description="The final stage's output, once completed.")
    error: str | None = Field(None, description="Reason code, once failed.")


def snapshot(
    run_id: str, status: str, record: dict[str, Any], created_at_ms: int, updated_at_ms: int
) -> RunSnapshot:
    """Build the public snapshot from a stored record (internal parts are left out)."""
    return RunSnapshot(
        id=run_id,
        status=status,
        stage=record.get("stage"),
        created_at=_time(created_at_ms),
        updated_at=_time(updated_at_ms),
        questions=[Question(**q) for q in record.get("questions", [])],
        result=record.get("result") if status == COMPLETED else None,
        error=record.get("error") if status == FAILED else None,
    )


def _time(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


class RunSettings(CommonSettings):
    """Run execution policy shared by workers, the sweeper and the HTTP service."""

    run_lease_ttl_ms: int = Field(
        30_000, ge=100, description="Execution lease of a claimed run; a heartbeat extends it."
    )
    run_heartbeat_ms: int = Field(
        10_000, ge=20, description="How often a worker extends the leases of the runs it holds."
    )
    run_max_attempts: int = Field(
        5, ge=1, description="Resumes after expired leases before a run fails (attempts_exhausted)."
    )
    run_concurrency: int = Field(4, ge=1, le=256, description="Runs one worker executes at once.")
    sweep_interval_ms: int = Field(
        5_000, ge=50, description="How often a consumer daemon sweeps for expired leases."
    )
    sweep_batch: int = Field(100, ge=1, le=10_000, description="Expired runs handled per sweep.")
