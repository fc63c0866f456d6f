"""Decision thresholds kept with their version: the ``model_calibrations`` table.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02

One row per calibration of a version (``POST /models/{v}/calibrate``); the newest one is
served with the version. A new table only, so it runs on a live database. On PostgreSQL an
insert notifies ``imgret_changes`` like a switch does (the function of migration 0003), so
replicas pick up a new threshold for the served version at once rather than at their next
poll. A downgrade drops the table: versions then serve no decisions.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "model_calibrations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model_version_id", sa.Integer(), nullable=False),
        sa.Column("query_set", sa.String(length=255), nullable=False),
        sa.Column("query_set_sha256", sa.String(length=64), nullable=False),
        sa.Column("target_fpir", sa.Float(), nullable=False),
        sa.Column("threshold", sa.Float(), nullable=False),
        sa.Column("threshold_low", sa.Float(), nullable=True),
        sa.Column("threshold_high", sa.Float(), nullable=True),
        sa.Column("fpir", sa.Float(), nullable=False),
        sa.Column("fnir", sa.Float(), nullable=False),
        sa.Column("rerank", _JSON, nullable=True),
        sa.Column("details", _JSON, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_version_id"], ["model_versions.id"],
            name=op.f("fk_model_calibrations_model_version_id_model_versions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_calibrations")),
        sqlite_autoincrement=True,
    )
    op.create_index(op.f("ix_model_calibrations_model_version_id"), "model_calibrations",
                    ["model_version_id"], unique=False)
    if op.get_bind().dialect.name == "postgresql":
        op.execute("CREATE TRIGGER model_calibrations_notify AFTER INSERT ON "
                   "model_calibrations FOR EACH STATEMENT EXECUTE FUNCTION "
                   "imgret_notify_change()")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS model_calibrations_notify ON model_calibrations")
    op.drop_index(op.f("ix_model_calibrations_model_version_id"),
                  table_name="model_calibrations")
    op.drop_table("model_calibrations")
