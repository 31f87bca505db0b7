"""Durable runs: long, multi-stage jobs that survive crashes (revisions, checkpoints, leases,
heartbeats), built on the outbox. The application supplies the stages and the code::

    from outbox_relay.runs import Pipeline, Runs

    runs = Runs(Pipeline(["fetch", "summarize", "publish"], asking=["summarize"]), MyAgent)

``outbox db upgrade --runs`` creates the runs table; ``outbox consume --app module:runs`` runs
the worker; ``outbox serve`` the HTTP API. See docs/runs.md.
"""

from outbox_relay.runs.agent import Agent, AgentError, StageContext, StageResult
from outbox_relay.runs.app import Runs
from outbox_relay.runs.errors import IdempotencyConflictError, InvalidTransitionError
from outbox_relay.runs.pipeline import Pipeline
from outbox_relay.runs.schema import check_schema, upgrade
from outbox_relay.runs.settings import RunSettings, ServeSettings, WorkerSettings
from outbox_relay.runs.snapshot import Question, RunSnapshot
from outbox_relay.runs.store import RunRow, RunStore, store_for

__all__ = [
    "Agent",
    "AgentError",
    "IdempotencyConflictError",
    "InvalidTransitionError",
    "Pipeline",
    "Question",
    "RunRow",
    "RunSettings",
    "RunSnapshot",
    "RunStore",
    "Runs",
    "ServeSettings",
    "StageContext",
    "StageResult",
    "WorkerSettings",
    "check_schema",
    "store_for",
    "upgrade",
]
