"""The default consumer app: the run worker with the deterministic demo agent.

``outbox consume`` loads :func:`handlers`, which starts the worker in the daemon's startup order
(schema checked → one recovery sweep → consume; see :mod:`consumer.worker`). The worker and
sweeper run on daemon threads; at exit the worker lets unfinished leases expire at once.

The demo agent is configured by ``OUTBOX_DEMO_*`` environment variables (:class:`AgentSettings`),
the worker by ``OUTBOX_RUN_*`` and ``OUTBOX_SWEEP_*`` (:class:`shared.runstate.RunSettings`).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from outbox_relay.consumer import Handlers
from outbox_relay.consumer.agent import DemoAgent
from outbox_relay.consumer.worker import WorkerSettings, start_worker
from outbox_relay.shared import runstate as rs
from outbox_relay.shared.settings import ConsumerSettings


class AgentSettings(BaseSettings):
    """The demo agent (``OUTBOX_DEMO_<NAME>``)."""

    model_config = SettingsConfigDict(env_prefix="OUTBOX_DEMO_", extra="ignore", frozen=True)

    stage_ms: int = Field(default=0, ge=0, description="Duration of every stage.")
    durations_ms: str = Field(default="{}", description='Per-stage durations, {"drafting": 500}.')
    ask_stage: str = Field(default=rs.NORMALIZING_CANDIDATE, description="The stage that may ask.")
    journal: str = Field(default="", description="File getting a line per stage run and question.")

    def agent(self) -> DemoAgent:
        """The configured agent."""
        durations = {str(k): int(v) for k, v in json.loads(self.durations_ms).items()}
        return DemoAgent(stage_ms=self.stage_ms, durations_ms=durations, ask_stage=self.ask_stage,
                         journal=Path(self.journal) if self.journal else None)


def handlers(settings: ConsumerSettings) -> Handlers:
    """Build the registry: every ``run.*`` event goes to a started run worker."""
    worker_settings = WorkerSettings(**settings.model_dump())
    registry = Handlers()
    owner = settings.consumer or f"{socket.gethostname()}:{os.getpid()}"
    worker, sweeper = start_worker(worker_settings, AgentSettings().agent(), registry,
                                   owner=owner)
    atexit.register(worker.close)
    atexit.register(sweeper.stop)
    registry.observed.update(run_worker=worker.stats, run_sweeper=sweeper.total)  # metrics
    return registry
