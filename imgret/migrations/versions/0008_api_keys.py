"""API keys with roles per collection: the ``api_keys`` and ``api_key_roles`` tables.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-29

New tables only, so it runs on a live database. Keys are stored as salted scrypt digests;
``IMGRET_API_KEY`` stays a global admin key from the environment and needs no row. A
downgrade drops both tables (every stored key stops working).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BYTES = sa.LargeBinary().with_variant(postgresql.BYTEA(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("salt", _BYTES, nullable=False),
        sa.Column("digest", _BYTES, nullable=False),
        sa.Column("kdf", sa.String(length=64), nullable=False),
        sa.Column("is_admin", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sqlite_autoincrement=True,
    )
    op.create_table(
        "api_key_roles",
        sa.Column("key_id", sa.Integer(), nullable=False),
        sa.Column("collection_id", sa.Integer(), nullable=False),
        sa.Column("role", sa.String(length=8), nullable=False),
        sa.CheckConstraint("role IN ('read', 'write', 'admin')",
                           name=op.f("ck_api_key_roles_role")),
        sa.ForeignKeyConstraint(["key_id"], ["api_keys.id"],
                                name=op.f("fk_api_key_roles_key_id_api_keys"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["collection_id"], ["collections.id"],
                                name=op.f("fk_api_key_roles_collection_id_collections"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("key_id", "collection_id", name=op.f("pk_api_key_roles")),
    )
    op.create_index(op.f("ix_api_key_roles_collection_id"), "api_key_roles",
                    ["collection_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_api_key_roles_collection_id"), table_name="api_key_roles")
    op.drop_table("api_key_roles")
    op.drop_table("api_keys")
