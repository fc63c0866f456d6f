"""Checkpoints in the database: the ``model_checkpoints`` table and
``model_versions.content_digest``.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27

Adds a table and a nullable column, so it runs on a live database. The bytes of existing
versions are not read here (a migration does not know the data dir): a starting server
imports ``<data_dir>/models/<version>/model.pt`` for every version whose bytes are missing
(``index.versions.import_checkpoint_files``). A downgrade drops the table, so the bytes then
live only in the local copies a server writes beside it at registration
(``<data_dir>/models/<version>/model.pt``).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("model_versions",
                  sa.Column("content_digest", sa.String(length=64), nullable=True))
    op.create_table(
        "model_checkpoints",
        sa.Column("model_version_id", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("data", sa.LargeBinary().with_variant(postgresql.BYTEA(), "postgresql"),
                  nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_version_id"], ["model_versions.id"],
            name=op.f("fk_model_checkpoints_model_version_id_model_versions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("model_version_id", name=op.f("pk_model_checkpoints")),
    )


def downgrade() -> None:
    op.drop_table("model_checkpoints")
    with op.batch_alter_table("model_versions") as batch:
        batch.drop_column("content_digest")
