"""The operator console's action log (issue #26).

``outbox_console_actions``: one row per replay or purge an operator asked the console for (who,
when, what), completed when it finished; ``outbox_console_action_letters``: what each of those
did to each letter, so a repeated request for a letter already gone gets a clear answer.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_SEQ = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "outbox_console_actions",
        sa.Column("seq", _SEQ, nullable=False, autoincrement=True),
        sa.Column("at_ms", sa.BigInteger, nullable=False),
        sa.Column("caller", sa.String(64), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("target", sa.Text, nullable=False),
        sa.Column("matched", sa.Integer),
        sa.Column("changed", sa.Integer),
        sa.Column("outcomes", sa.Text),
        sa.Column("finished_at_ms", sa.BigInteger),
        sa.PrimaryKeyConstraint("seq", name="pk_outbox_console_actions"),
        sqlite_autoincrement=True,
    )
    op.create_table(
        "outbox_console_action_letters",
        sa.Column("action_seq", sa.BigInteger, nullable=False),
        sa.Column("letter_id", sa.String(160), nullable=False),
        sa.Column("outcome", sa.String(32), nullable=False),
        sa.Column("detail", sa.String(500), nullable=False, server_default=sa.text("''")),
        sa.PrimaryKeyConstraint("action_seq", "letter_id",
                                name="pk_outbox_console_action_letters"),
    )
    op.create_index("ix_outbox_console_action_letters_letter",
                    "outbox_console_action_letters", ["letter_id"])


def downgrade() -> None:
    op.drop_index("ix_outbox_console_action_letters_letter", "outbox_console_action_letters")
    op.drop_table("outbox_console_action_letters")
    op.drop_table("outbox_console_actions")
