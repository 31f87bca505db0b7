"""What leaves the service about a run: :class:`RunSnapshot`, and the :class:`Question` a stage
asks.

Only the snapshot leaves the service: revision, request, checkpoint, answers, receipts and the
lease stay inside the stored record.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from outbox_relay.runs.pipeline import COMPLETED, FAILED


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
