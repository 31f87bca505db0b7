"""An application's durable runs: its :class:`Pipeline` and its agent, as one consumer app.

``Runs`` is what ``outbox consume --app`` loads for runs: called with the consumer's settings
it checks the schema (core and runs), recovers (one sweep), starts the run worker and its
sweeper, and returns the :class:`Handlers` that lease runs from ``run.*`` events (see
:mod:`runs.worker` for the order and why). An application that also consumes events of its own
passes its registry to :meth:`Runs.handlers`::

    runs = Runs(Pipeline(["fetch", "summarize", "publish"], asking=["summarize"]), MyAgent)

    def handlers(settings: ConsumerSettings) -> Handlers:
        registry = Handlers()
        registry.register("order.placed", on_order_placed)
        return runs.handlers(settings, registry)

The worker and sweeper run on daemon threads. When the consumer daemon stops (or at exit) the
worker finishes the stages it runs, saves their checkpoints and lets unfinished leases expire at
once, so the next sweep anywhere resumes them.
"""

from __future__ import annotations

import atexit
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

from outbox_relay.consumer.handlers import Handlers
from outbox_relay.runs.agent import Agent
from outbox_relay.runs.metrics import SWEEPER_NAMES, WORKER_NAMES, RunsCollector
from outbox_relay.runs.pipeline import Pipeline
from outbox_relay.runs.settings import WorkerSettings
from outbox_relay.runs.worker import start_worker
from outbox_relay.shared.settings import ConsumerSettings


@dataclass(frozen=True)
class Runs:
    """The stages (``pipeline``) and the code that runs them (``agent``: a factory, called once
    per consumer daemon, so the agent is built where it runs)."""

    pipeline: Pipeline
    agent: Callable[[], Agent]

    def __call__(self, settings: ConsumerSettings) -> Handlers:
        """``outbox consume --app module:runs``: a registry of the run worker alone."""
        return self.handlers(settings)

    def handlers(self, settings: ConsumerSettings, registry: Handlers | None = None) -> Handlers:
        """Start the run worker and register it for every ``run.*`` type in ``registry`` (a new
        one by default); run settings come from ``OUTBOX_RUN_*``/``OUTBOX_SWEEP_*``."""
        registry = Handlers() if registry is None else registry
        worker_settings = WorkerSettings(**settings.model_dump())
        owner = settings.consumer or f"{socket.gethostname()}:{os.getpid()}"
        worker, sweeper = start_worker(worker_settings, self.pipeline, self.agent(), registry,
                                       owner=owner)
        registry.on_stop(worker.close)  # when the consumer daemon stops (sweeper first)
        registry.on_stop(sweeper.stop)
        atexit.register(worker.close)  # embedded without our daemon: at exit at the latest
        atexit.register(sweeper.stop)
        registry.observe("run_worker", worker.stats, WORKER_NAMES)  # the daemon's metrics
        registry.observe("run_sweeper", sweeper.total, SWEEPER_NAMES)
        registry.collectors.append(RunsCollector(worker.engine, self.pipeline))
        return registry
