"""The agent: pluggable stage code a run worker calls, one stage at a time.

An agent is anything with ``run_stage(stage, context) -> StageResult``. The worker calls it
outside any database transaction, with the run's original request, the outputs of the stages
already finished (the checkpoint) and the answers given so far. A stage must be safe to run
again after a crash (its output is saved only once it returns), and must not assume it ran
before. Raising :class:`AgentError` fails the run with its code; any other exception stops the
worker without writing, so the lease expires and the sweeper retries the run.

The application supplies the agent, with its :class:`~outbox_relay.runs.pipeline.Pipeline`
(the demo's is :mod:`outbox_relay.cli.demo_app`). Only a stage the pipeline lists as asking may
return questions; any other stage's questions fail the run (``unexpected_questions``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from outbox_relay.runs.snapshot import Question
from outbox_relay.shared.errors import OutboxError


@dataclass(frozen=True)
class StageContext:
    """What a stage may read: never the stored record itself."""

    run_id: str
    request: Mapping[str, Any]
    checkpoint: Mapping[str, Any]
    answers: Mapping[str, str]


@dataclass(frozen=True)
class StageResult:
    """A stage's JSON-serializable output, and the questions it asks (asking stages only)."""

    output: Any = None
    questions: list[Question] = field(default_factory=list)


class AgentError(OutboxError):
    """The stage failed for good (bad input, refused request): the run fails with ``code``."""

    code = "stage_failed"


class Agent(Protocol):
    """Stage code: run ``stage`` of a run and return its result."""

    def run_stage(self, stage: str, context: StageContext, /) -> StageResult: ...
