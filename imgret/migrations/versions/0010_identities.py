"""The identities audit log (``label_changes``) and how far each serving process has
followed the change log (``serving_positions``).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07

New tables only, so it runs on a live database. A downgrade drops them (the audit log of
merges, moves and undos is lost; the items keep their labels).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "label_changes",
        sa.Column("collection_id", sa.Integer(), nullable=False),
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("action", sa.String(length=8), nullable=False),
        sa.Column("from_label", sa.String(length=255), nullable=True),
        sa.Column("to_label", sa.String(length=255), nullable=True),
        sa.Column("moves", _JSON, nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("undo_of", _ID, nullable=True),
        sa.Column("undone_by", _ID, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["collection_id"], ["collections.id"],
                                name=op.f("fk_label_changes_collection_id_collections"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_label_changes")),
        sqlite_autoincrement=True,
    )
    op.create_index(op.f("ix_label_changes_collection_id"), "label_changes",
                    ["collection_id"], unique=False)
    op.create_table(
        "serving_positions",
        sa.Column("process", sa.String(length=128), nullable=False),
        sa.Column("collection_id", sa.Integer(), nullable=False),
        sa.Column("change_seq", _ID, nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["collection_id"], ["collections.id"],
                                name=op.f("fk_serving_positions_collection_id_collections"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("process", "collection_id", name=op.f("pk_serving_positions")),
    )
    op.create_index(op.f("ix_serving_positions_collection_id"), "serving_positions",
                    ["collection_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_serving_positions_collection_id"), table_name="serving_positions")
    op.drop_table("serving_positions")
    op.drop_index(op.f("ix_label_changes_collection_id"), table_name="label_changes")
    op.drop_table("label_changes")
