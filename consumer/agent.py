"""The agent: pluggable stage code a run worker calls, one stage at a time.

An agent is anything with ``run_stage(stage, context) -> StageResult``. The worker calls it
outside any database transaction, with the run's original request, the outputs of the stages
already finished (the checkpoint) and the answers given so far. A stage must be safe to run
again after a crash (its output is saved only once it returns), and must not assume it ran
before. Raising :class:`AgentError` fails the run with its code; any other exception stops the
worker without writing, so the lease expires and the sweeper retries the run.

:class:`DemoAgent` is deterministic: every stage sleeps a configurable time and returns a small
output built from its inputs; one stage may ask a question when the request says ``"ask"``.
An optional journal file gets one line per stage execution and per question asked, which is how
tests and the demo count work done.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from outbox_relay.shared import runstate as rs
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
    questions: list[rs.Question] = field(default_factory=list)


class AgentError(OutboxError):
    """The stage failed for good (bad input, refused request): the run fails with ``code``."""

    code = "stage_failed"


class Agent(Protocol):
    """Stage code: run ``stage`` of a run and return its result."""

    def run_stage(self, stage: str, context: StageContext, /) -> StageResult: ...


QUESTION_ID = "confirm-dates"


@dataclass
class DemoAgent:
    """A deterministic stand-in for a model-backed agent.

    ``stage_ms`` is every stage's duration, ``durations_ms`` overrides it per stage. When the
    request has a truthy ``"ask"``, ``ask_stage`` asks one question (``confirm-dates``) unless
    it was answered. ``journal`` (a file path) receives ``<run_id> stage <stage>`` when a stage
    starts and ``<run_id> ask <interaction_id>`` when a question is asked.
    """

    stage_ms: int = 0
    durations_ms: Mapping[str, int] = field(default_factory=dict)
    ask_stage: str = rs.NORMALIZING_CANDIDATE
    journal: Path | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.ask_stage not in rs.ASKING_STAGES:
            raise ValueError(f"{self.ask_stage!r} is not a stage that may ask")

    def run_stage(self, stage: str, context: StageContext, /) -> StageResult:
        """Sleep the stage's duration and return ``{"stage", "inputs"}``; maybe ask."""
        self._note(f"{context.run_id} stage {stage}")
        duration = self.durations_ms.get(stage, self.stage_ms)
        if duration > 0:
            time.sleep(duration / 1000)
        output = {"stage": stage, "inputs": sorted(context.checkpoint)}
        if stage == rs.RENDERING:
            output["document"] = f"run {context.run_id}: {len(context.answers)} answer(s) used"
        if (stage == self.ask_stage and context.request.get("ask")
                and QUESTION_ID not in context.answers):
            self._note(f"{context.run_id} ask {QUESTION_ID}")
            question = rs.Question(interaction_id=QUESTION_ID, stage=stage,
                                   prompt="Are the dates of your last position correct?")
            return StageResult(output, [question])
        return StageResult(output)

    def _note(self, line: str) -> None:
        if self.journal is None:
            return
        with self._lock, self.journal.open("a", encoding="utf-8") as out:
            out.write(line + "\n")
            out.flush()
            os.fsync(out.fileno())
