"""The unknowns pool: ``unknowns`` and ``unknown_clusters``, and each collection's
``unknowns_days`` (0: keep none, the default).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07

New tables and a column with a default, so it runs on a live database; every collection
starts with the pool off. A downgrade drops them (the kept unknowns' rows go; their image
bytes are then unreferenced and the start-up sweep removes them).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_BYTES = sa.LargeBinary().with_variant(postgresql.BYTEA(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("collections") as batch:
        batch.add_column(sa.Column("unknowns_days", sa.Integer(), nullable=False,
                                   server_default="0"))
    op.create_table(
        "unknown_clusters",
        sa.Column("collection_id", sa.Integer(), nullable=False),
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("model_version_id", sa.Integer(), nullable=False),
        sa.Column("vector_sum", _BYTES, nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["collection_id"], ["collections.id"],
                                name=op.f("fk_unknown_clusters_collection_id_collections"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["model_version_id"], ["model_versions.id"],
                                name=op.f("fk_unknown_clusters_model_version_id_model_versions"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_unknown_clusters")),
        sqlite_autoincrement=True,
    )
    op.create_index(op.f("ix_unknown_clusters_collection_id"), "unknown_clusters",
                    ["collection_id"], unique=False)
    op.create_index(op.f("ix_unknown_clusters_model_version_id"), "unknown_clusters",
                    ["model_version_id"], unique=False)
    op.create_table(
        "unknowns",
        sa.Column("collection_id", sa.Integer(), nullable=False),
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("media_path", sa.String(length=255), nullable=False),
        sa.Column("content_type", sa.String(length=64), nullable=False),
        sa.Column("model_version_id", sa.Integer(), nullable=False),
        sa.Column("dim", sa.Integer(), nullable=False),
        sa.Column("vector", _BYTES, nullable=False),
        sa.Column("score", sa.Float(), nullable=True),
        sa.Column("cluster_id", _ID, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["collection_id"], ["collections.id"],
                                name=op.f("fk_unknowns_collection_id_collections"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["model_version_id"], ["model_versions.id"],
                                name=op.f("fk_unknowns_model_version_id_model_versions"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["cluster_id"], ["unknown_clusters.id"],
                                name=op.f("fk_unknowns_cluster_id_unknown_clusters"),
                                ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_unknowns")),
        sqlite_autoincrement=True,
    )
    for column in ("collection_id", "model_version_id", "cluster_id", "created_at"):
        op.create_index(op.f(f"ix_unknowns_{column}"), "unknowns", [column], unique=False)


def downgrade() -> None:
    for column in ("collection_id", "model_version_id", "cluster_id", "created_at"):
        op.drop_index(op.f(f"ix_unknowns_{column}"), table_name="unknowns")
    op.drop_table("unknowns")
    op.drop_index(op.f("ix_unknown_clusters_model_version_id"), table_name="unknown_clusters")
    op.drop_index(op.f("ix_unknown_clusters_collection_id"), table_name="unknown_clusters")
    op.drop_table("unknown_clusters")
    with op.batch_alter_table("collections") as batch:
        batch.drop_column("unknowns_days")
