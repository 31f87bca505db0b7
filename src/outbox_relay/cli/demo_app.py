"""The demo application's durable runs: a job-application pipeline and a deterministic agent.

``outbox consume --app outbox_relay.cli.demo_app:handlers`` (what ``make demo`` runs) starts the
run worker with these stages; any application supplies its own the same way
(:class:`outbox_relay.runs.Runs`). The stages::

    ingesting_inputs → normalizing_candidate → analyzing_jd → matching_evidence
                     → drafting → validating → rendering

of which ``normalizing_candidate``, ``analyzing_jd`` and ``matching_evidence`` may ask.

The demo agent is configured by ``OUTBOX_DEMO_*`` environment variables (:class:`AgentSettings`),
the worker by ``OUTBOX_RUN_*`` and ``OUTBOX_SWEEP_*`` (:class:`outbox_relay.runs.RunSettings`).

The demo's second group, ``billing`` (``--app outbox_relay.cli.demo_app:billing``, stream
``invoices``), exists so that ``make demo`` leaves dead letters worth replaying in the console:
see :data:`billing`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy import Column, Connection, Engine, Integer, MetaData, String, Table, insert, select

from outbox_relay.consumer import Handlers, PermanentError
from outbox_relay.runs import Pipeline, Question, Runs, StageContext, StageResult
from outbox_relay.shared.envelope import Event

INGESTING_INPUTS = "ingesting_inputs"
NORMALIZING_CANDIDATE = "normalizing_candidate"
ANALYZING_JD = "analyzing_jd"
MATCHING_EVIDENCE = "matching_evidence"
DRAFTING = "drafting"
VALIDATING = "validating"
RENDERING = "rendering"

PIPELINE = Pipeline(
    (INGESTING_INPUTS, NORMALIZING_CANDIDATE, ANALYZING_JD, MATCHING_EVIDENCE, DRAFTING,
     VALIDATING, RENDERING),
    asking=(NORMALIZING_CANDIDATE, ANALYZING_JD, MATCHING_EVIDENCE),
)
"""The demo's stages, in order, and those that may ask the user."""

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
    ask_stage: str = NORMALIZING_CANDIDATE
    journal: Path | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.ask_stage not in PIPELINE.asking:
            raise ValueError(f"{self.ask_stage!r} is not a stage that may ask")

    def run_stage(self, stage: str, context: StageContext, /) -> StageResult:
        """Sleep the stage's duration and return ``{"stage", "inputs"}``; maybe ask."""
        self._note(f"{context.run_id} stage {stage}")
        duration = self.durations_ms.get(stage, self.stage_ms)
        if duration > 0:
            time.sleep(duration / 1000)
        output = {"stage": stage, "inputs": sorted(context.checkpoint)}
        if stage == RENDERING:
            output["document"] = f"run {context.run_id}: {len(context.answers)} answer(s) used"
        if (stage == self.ask_stage and context.request.get("ask")
                and QUESTION_ID not in context.answers):
            self._note(f"{context.run_id} ask {QUESTION_ID}")
            question = Question(interaction_id=QUESTION_ID, stage=stage,
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


class AgentSettings(BaseSettings):
    """The demo agent (``OUTBOX_DEMO_<NAME>``)."""

    model_config = SettingsConfigDict(env_prefix="OUTBOX_DEMO_", extra="ignore", frozen=True)

    stage_ms: int = Field(default=0, ge=0, description="Duration of every stage.")
    durations_ms: str = Field(default="{}", description='Per-stage durations, {"drafting": 500}.')
    ask_stage: str = Field(default=NORMALIZING_CANDIDATE, description="The stage that may ask.")
    journal: str = Field(default="", description="File getting a line per stage run and question.")

    def agent(self) -> DemoAgent:
        """The configured agent."""
        durations = {str(k): int(v) for k, v in json.loads(self.durations_ms).items()}
        return DemoAgent(stage_ms=self.stage_ms, durations_ms=durations, ask_stage=self.ask_stage,
                         journal=Path(self.journal) if self.journal else None)


def _agent() -> DemoAgent:
    return AgentSettings().agent()


handlers = Runs(PIPELINE, _agent)
"""The consumer app: called with the consumer's settings, it starts the run worker."""


# -- the billing group: invoices, and the dead letters the console walkthrough replays --------

BILLING_GROUP = "billing"
INVOICES = "invoices"
INVOICE_ISSUED = "invoice.issued"

billing_tables = MetaData()
customers = Table(
    "demo_customers", billing_tables,
    Column("id", String(128), primary_key=True),
    Column("name", String(128), nullable=False),
)
"""The billing service's own copy of the customers it may invoice (its reference data)."""
invoices = Table(
    "demo_invoices", billing_tables,
    Column("id", String(128), primary_key=True),  # the invoice: one row, whatever is replayed
    Column("customer_id", String(128), nullable=False),
    Column("amount_cents", Integer, nullable=False),
    Column("event_id", String(512), nullable=False),
)
"""What the billing handler writes: one row per applied ``invoice.issued`` event."""


def create_billing_tables(engine: Engine) -> None:
    """The billing tables, in the demo's database (the consumer's database is the outbox's)."""
    billing_tables.create_all(engine, checkfirst=True)


billing = Handlers()
"""The ``billing`` group's handlers (``outbox consume --group billing --streams invoices --app
outbox_relay.cli.demo_app:billing``, and ``OUTBOX_CONSOLE_APPS=billing=…`` for the console)."""


@billing.on(INVOICE_ISSUED)
def record_invoice(conn: Connection, event: Event) -> None:
    """Book the invoice against its customer, in the claim transaction (applied at most once).

    An invoice for a customer billing does not know is refused with :class:`PermanentError`,
    not retried: billing treats it as a producer's mistake an operator must look at, and
    retrying for up to the horizon would only hold the invoice back in silence. The event is
    dead-lettered (``rejected``) with the customer's id; once the customer row exists, a replay
    of the letter (``outbox dlq replay`` or the console) applies it through this same handler.
    That is the story ``make demo`` tells: its late customer arrives after its invoices."""
    data = event.data if isinstance(event.data, dict) else {}
    customer = str(data.get("customer_id", ""))
    known = conn.execute(select(customers.c.id).where(customers.c.id == customer)).first()
    if known is None:
        raise PermanentError(f"unknown customer {customer!r}: no such row in demo_customers")
    conn.execute(insert(invoices).values(
        id=event.aggregateid or event.id, customer_id=customer,
        amount_cents=int(data.get("amount_cents", 0)), event_id=event.id))
