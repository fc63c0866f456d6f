"""Model lifecycle: stored checkpoints, activation history, re-embedding job state, last
evaluation.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23

Only adds nullable columns and a table, so it runs on a live database (old processes ignore
them). SQLite adds columns in place (no batch copy needed for nullable columns without
constraints).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
_COLUMNS = (
    ("checkpoint_sha256", sa.String(length=64)),
    ("activated_at", sa.DateTime(timezone=True)),
    ("embed_state", sa.String(length=16)),
    ("embed_heartbeat_at", sa.DateTime(timezone=True)),
    ("embed_error", sa.Text()),
    ("covered_through", sa.BigInteger().with_variant(sa.Integer(), "sqlite")),
    ("last_evaluation", JSON),
)


def upgrade() -> None:
    for name, type_ in _COLUMNS:
        op.add_column("model_versions", sa.Column(name, type_, nullable=True))
    op.create_table(
        "model_activations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model_version_id", sa.Integer(), nullable=False),
        sa.Column("previous_version_id", sa.Integer(), nullable=True),
        sa.Column("reason", sa.String(length=16), nullable=False),
        sa.Column("gate", JSON, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_version_id"], ["model_versions.id"],
            name=op.f("fk_model_activations_model_version_id_model_versions"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["previous_version_id"], ["model_versions.id"],
            name=op.f("fk_model_activations_previous_version_id_model_versions"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_activations")),
        sqlite_autoincrement=True,
    )


def downgrade() -> None:
    op.drop_table("model_activations")
    with op.batch_alter_table("model_versions") as batch:
        for name, _ in reversed(_COLUMNS):
            batch.drop_column(name)
