"""The run store's table, ``outbox_runs``.

A database migrated by an earlier 0.1.0 development build already has this table (the core's
first migration created it then): it is adopted (and gets the sweeper's index), not created
again. Its waiting runs get the ``resume_at`` that stores without a pipeline need to move an
answered run on: those builds had one fixed pipeline, so it is the stage after ``asked_by``.

Revision ID: r0001
Revises:
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

revision = "r0001"
down_revision = None
branch_labels = None
depends_on = None

# The earlier builds' only pipeline: each asking stage and the stage an answer resumes at.
EARLIER_RESUME_AT = {"normalizing_candidate": "analyzing_jd", "analyzing_jd": "matching_evidence",
                     "matching_evidence": "drafting"}


def upgrade() -> None:
    inspector = sa.inspect(op.get_bind())
    indexes: set[str | None] = set()
    if inspector.has_table("outbox_runs"):
        indexes = {i["name"] for i in inspector.get_indexes("outbox_runs")}
        _record_where_waiting_runs_resume()
    else:
        _create_table()
    if "ix_outbox_runs_lease_expires_at_ms" not in indexes:
        op.create_index("ix_outbox_runs_lease_expires_at_ms", "outbox_runs",
                        ["lease_expires_at_ms"])


def _record_where_waiting_runs_resume() -> None:
    table = sa.table("outbox_runs", sa.column("id"), sa.column("status"), sa.column("record"))
    conn = op.get_bind()
    waiting = conn.execute(sa.select(table.c.id, table.c.record)
                           .where(table.c.status == "needs_input")).all()
    for run_id, text in waiting:
        record = json.loads(text)
        resume_at = EARLIER_RESUME_AT.get(record.get("asked_by"))
        if "resume_at" not in record and resume_at is not None:
            record["resume_at"] = resume_at
            conn.execute(sa.update(table).where(table.c.id == run_id).values(
                record=json.dumps(record, separators=(",", ":"), sort_keys=True)))


def _create_table() -> None:
    op.create_table(
        "outbox_runs",
        sa.Column("id", sa.String(128), nullable=False),
        sa.Column("revision", sa.BigInteger, nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("record", sa.Text, nullable=False),
        sa.Column("lease_owner", sa.String(128)),
        sa.Column("lease_expires_at_ms", sa.BigInteger),
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("created_at_ms", sa.BigInteger, nullable=False),
        sa.Column("updated_at_ms", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_outbox_runs"),
    )
    op.create_index(
        "ix_outbox_runs_status_lease", "outbox_runs", ["status", "lease_expires_at_ms"]
    )


def downgrade() -> None:
    op.drop_table("outbox_runs")
