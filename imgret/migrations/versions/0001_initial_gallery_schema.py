"""Initial gallery schema: model versions, gallery items, embeddings, change log, query sets.

Revision ID: 0001
Revises:
Create Date: 2026-11-22

Runs unchanged on SQLite and PostgreSQL. Ids are 64-bit on PostgreSQL and SQLite's
``INTEGER PRIMARY KEY AUTOINCREMENT`` (never reused) on SQLite; JSON is JSONB on PostgreSQL.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
VECTOR = sa.LargeBinary().with_variant(postgresql.BYTEA(), "postgresql")


def _timestamp(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "model_versions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("version", sa.String(length=128), nullable=False),
        sa.Column("dim", sa.Integer(), nullable=False),
        sa.Column("config", JSON, nullable=False),
        sa.Column("is_active", sa.Boolean(), nullable=False),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_versions")),
        sa.UniqueConstraint("version", name=op.f("uq_model_versions_version")),
        sqlite_autoincrement=True,
    )
    op.create_index(
        "uq_model_versions_one_active", "model_versions", ["is_active"], unique=True,
        sqlite_where=sa.text("is_active"), postgresql_where=sa.text("is_active"),
    )

    op.create_table(
        "gallery_items",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("media_path", sa.String(length=255), nullable=False),
        sa.Column("content_type", sa.String(length=64), nullable=False),
        sa.Column("label", sa.String(length=255), nullable=False),
        sa.Column("camera", sa.Integer(), nullable=True),
        sa.Column("metadata", JSON, nullable=False),
        sa.Column("source", sa.Text(), nullable=True),
        _timestamp("created_at"),
        _timestamp("deleted_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gallery_items")),
        sqlite_autoincrement=True,
    )
    op.create_index(op.f("ix_gallery_items_label"), "gallery_items", ["label"])
    op.create_index(
        "uq_gallery_items_live_sha256", "gallery_items", ["sha256"], unique=True,
        sqlite_where=sa.text("deleted_at IS NULL"),
        postgresql_where=sa.text("deleted_at IS NULL"),
    )

    op.create_table(
        "embeddings",
        sa.Column("model_version_id", sa.Integer(), nullable=False),
        sa.Column("item_id", ID, nullable=False),
        sa.Column("dim", sa.Integer(), nullable=False),
        sa.Column("vector", VECTOR, nullable=False),
        _timestamp("created_at"),
        sa.ForeignKeyConstraint(
            ["item_id"], ["gallery_items.id"],
            name=op.f("fk_embeddings_item_id_gallery_items"), ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["model_version_id"], ["model_versions.id"],
            name=op.f("fk_embeddings_model_version_id_model_versions"), ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("model_version_id", "item_id", name=op.f("pk_embeddings")),
    )
    op.create_index(op.f("ix_embeddings_item_id"), "embeddings", ["item_id"])

    op.create_table(
        "gallery_changes",
        sa.Column("seq", ID, autoincrement=True, nullable=False),
        sa.Column("item_id", ID, nullable=False),
        sa.Column("op", sa.String(length=8), nullable=False),
        _timestamp("created_at"),
        sa.CheckConstraint("op IN ('add', 'delete')", name=op.f("ck_gallery_changes_op")),
        sa.ForeignKeyConstraint(
            ["item_id"], ["gallery_items.id"],
            name=op.f("fk_gallery_changes_item_id_gallery_items"), ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_gallery_changes")),
        sqlite_autoincrement=True,
    )
    op.create_index(op.f("ix_gallery_changes_item_id"), "gallery_changes", ["item_id"])

    op.create_table(
        "query_sets",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_query_sets")),
        sa.UniqueConstraint("name", name=op.f("uq_query_sets_name")),
        sqlite_autoincrement=True,
    )

    op.create_table(
        "query_items",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("query_set_id", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("media_path", sa.String(length=255), nullable=False),
        sa.Column("content_type", sa.String(length=64), nullable=False),
        sa.Column("label", sa.String(length=255), nullable=False),
        sa.Column("camera", sa.Integer(), nullable=True),
        sa.Column("metadata", JSON, nullable=False),
        sa.Column("source", sa.Text(), nullable=True),
        _timestamp("created_at"),
        sa.ForeignKeyConstraint(
            ["query_set_id"], ["query_sets.id"],
            name=op.f("fk_query_items_query_set_id_query_sets"), ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_query_items")),
        sqlite_autoincrement=True,
    )
    op.create_index(op.f("ix_query_items_query_set_id"), "query_items", ["query_set_id"])
    op.create_index(
        "uq_query_items_set_sha256", "query_items", ["query_set_id", "sha256"], unique=True
    )

    op.create_table(
        "query_embeddings",
        sa.Column("model_version_id", sa.Integer(), nullable=False),
        sa.Column("query_item_id", ID, nullable=False),
        sa.Column("dim", sa.Integer(), nullable=False),
        sa.Column("vector", VECTOR, nullable=False),
        _timestamp("created_at"),
        sa.ForeignKeyConstraint(
            ["model_version_id"], ["model_versions.id"],
            name=op.f("fk_query_embeddings_model_version_id_model_versions"), ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["query_item_id"], ["query_items.id"],
            name=op.f("fk_query_embeddings_query_item_id_query_items"), ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint(
            "model_version_id", "query_item_id", name=op.f("pk_query_embeddings")
        ),
    )
    op.create_index(
        op.f("ix_query_embeddings_query_item_id"), "query_embeddings", ["query_item_id"]
    )


def downgrade() -> None:
    # Children before parents, so foreign keys never point at a dropped table.
    for table in (
        "query_embeddings", "query_items", "query_sets",
        "gallery_changes", "embeddings", "gallery_items", "model_versions",
    ):
        op.drop_table(table)
