"""Query vectors only within their collection: drop those made across collections.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07

A re-embedding job used to pick the query items of every collection, so a version of one
collection could hold vectors of another collection's (possibly private) query images. A
query item is now reached only through its own collection's query sets; this removes the
vectors stored before, whose version and query set belong to different collections. Data
only, so it runs on a live database; the downgrade has nothing to restore (the vectors were
never meant to exist).
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        "DELETE FROM query_embeddings WHERE EXISTS ("
        " SELECT 1 FROM query_items qi"
        " JOIN query_sets qs ON qs.id = qi.query_set_id"
        " JOIN model_versions mv ON mv.id = query_embeddings.model_version_id"
        " WHERE qi.id = query_embeddings.query_item_id"
        " AND qs.collection_id <> mv.collection_id)"
    )


def downgrade() -> None:
    pass
