"""Image bytes in the database: the ``media_blobs`` table (``IMGRET_MEDIA_BACKEND=database``).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23

Only adds a table: old processes (files backend) ignore it.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "media_blobs",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("data", sa.LargeBinary().with_variant(postgresql.BYTEA(), "postgresql"),
                  nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("sha256", name=op.f("pk_media_blobs")),
    )


def downgrade() -> None:
    op.drop_table("media_blobs")
