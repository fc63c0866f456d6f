"""Collections: the ``collections`` table, and ``collection_id`` on every row a gallery owns.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29

The existing gallery becomes collection 1, ``default``: items, query sets, change-log rows,
model versions and activations all get ``collection_id = 1``, so every item is still found
where it was. Uniqueness moves inside a collection: a version name, a query-set name and a
live item's content hash are unique per collection, and at most one version per collection
is active. SQLite rebuilds the altered tables (batch mode; foreign keys are not enforced
during the copy, see ``env.py``); the partial unique indexes are dropped before the copy and
made again after it, so their WHERE clauses survive.

A downgrade keeps only the ``default`` collection: the rows of any other collection are
deleted first (a single-gallery schema has nowhere to put them), then the columns go.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SCOPED = ("model_versions", "model_activations", "gallery_items", "gallery_changes",
           "query_sets")
# Table constraints that become per-collection indexes (table, constraint, columns).
_UNIQUE_BEFORE = (("model_versions", "uq_model_versions_version", ["version"]),
                  ("query_sets", "uq_query_sets_name", ["name"]))
_UNIQUE_AFTER = (("model_versions", "uq_model_versions_collection_version",
                  ["collection_id", "version"]),
                 ("query_sets", "uq_query_sets_collection_name", ["collection_id", "name"]))


def _partial_indexes(scoped: bool) -> list[tuple[str, str, list[str], str]]:
    prefix = ["collection_id"] if scoped else []
    return [
        ("uq_model_versions_one_active", "model_versions",
         prefix or ["is_active"], "is_active"),
        ("uq_gallery_items_live_sha256", "gallery_items", [*prefix, "sha256"],
         "deleted_at IS NULL"),
    ]


def _sqlite_sequences() -> dict[str, int]:
    """SQLite's AUTOINCREMENT positions: a rebuilt table's restarts at its largest id, which
    would hand out again the ids of rows deleted at the top (ids are never reused)."""
    bind = op.get_bind()
    if bind.dialect.name != "sqlite":
        return {}
    return dict(bind.execute(sa.text("SELECT name, seq FROM sqlite_sequence")).all())


def _restore_sequences(before: dict[str, int]) -> None:
    bind = op.get_bind()
    for name, seq in before.items():
        now = bind.execute(sa.text("SELECT seq FROM sqlite_sequence WHERE name = :n"),
                           {"n": name}).scalar()
        if now is None:
            bind.execute(sa.text("INSERT INTO sqlite_sequence (name, seq) VALUES (:n, :s)"),
                         {"n": name, "s": seq})
        elif now < seq:
            bind.execute(sa.text("UPDATE sqlite_sequence SET seq = :s WHERE name = :n"),
                         {"n": name, "s": seq})


def _batch(table: str):
    # The rebuilt table keeps AUTOINCREMENT (every scoped table has it; batch mode would
    # otherwise drop it and ids could be reused).
    return op.batch_alter_table(table, table_kwargs={"sqlite_autoincrement": True})


def _create_partial(name: str, table: str, columns: list[str], where: str) -> None:
    op.create_index(name, table, columns, unique=True, sqlite_where=sa.text(where),
                    postgresql_where=sa.text(where))


def upgrade() -> None:
    op.create_table(
        "collections",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("public", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_collections")),
        sa.UniqueConstraint("name", name=op.f("uq_collections_name")),
        sqlite_autoincrement=True,
    )
    op.execute(sa.text("INSERT INTO collections (id, name, public, created_at) "
                       "VALUES (1, 'default', true, CURRENT_TIMESTAMP)"))
    if op.get_bind().dialect.name == "postgresql":
        # The row above was given its id: move the sequence past it.
        op.execute(sa.text("SELECT setval(pg_get_serial_sequence('collections', 'id'), 1)"))
    for name, table, _columns, _where in _partial_indexes(scoped=False):
        op.drop_index(name, table_name=table)
    sequences = _sqlite_sequences()
    for table in _SCOPED:
        with _batch(table) as batch:
            # The server default fills the existing rows; it goes again below, so an insert
            # that forgets its collection fails instead of landing in ``default``.
            batch.add_column(sa.Column("collection_id", sa.Integer(), nullable=False,
                                       server_default=sa.text("1")))
            batch.create_foreign_key(op.f(f"fk_{table}_collection_id_collections"),
                                     "collections", ["collection_id"], ["id"],
                                     ondelete="CASCADE")
            batch.create_index(op.f(f"ix_{table}_collection_id"), ["collection_id"])
            for constraint_table, constraint, _ in _UNIQUE_BEFORE:
                if constraint_table == table:
                    batch.drop_constraint(constraint, type_="unique")
        with _batch(table) as batch:
            batch.alter_column("collection_id", server_default=None)
    _restore_sequences(sequences)
    for table, name, columns in _UNIQUE_AFTER:
        op.create_index(name, table, columns, unique=True)
    for name, table, columns, where in _partial_indexes(scoped=True):
        _create_partial(name, table, columns, where)


# The rows hanging off other collections' rows (SQLite enforces no cascades while migrating).
_OTHER_VERSIONS = "SELECT id FROM model_versions WHERE collection_id <> 1"
_OTHER_QUERY_ITEMS = ("SELECT id FROM query_items WHERE query_set_id IN "
                      "(SELECT id FROM query_sets WHERE collection_id <> 1)")
_CHILDREN = (
    f"DELETE FROM embeddings WHERE model_version_id IN ({_OTHER_VERSIONS}) OR item_id IN "
    "(SELECT id FROM gallery_items WHERE collection_id <> 1)",
    f"DELETE FROM query_embeddings WHERE model_version_id IN ({_OTHER_VERSIONS}) OR "
    f"query_item_id IN ({_OTHER_QUERY_ITEMS})",
    f"DELETE FROM query_items WHERE id IN ({_OTHER_QUERY_ITEMS})",
    f"DELETE FROM model_checkpoints WHERE model_version_id IN ({_OTHER_VERSIONS})",
    f"DELETE FROM model_calibrations WHERE model_version_id IN ({_OTHER_VERSIONS})",
)


def downgrade() -> None:
    # Their image bytes are left to the next start's media sweep (nothing refers to them).
    for statement in _CHILDREN:
        op.execute(sa.text(statement))
    for table in ("gallery_changes", "model_activations", "gallery_items", "query_sets",
                  "model_versions"):
        op.execute(sa.text(f"DELETE FROM {table} WHERE collection_id <> 1"))
    for name, table, _columns, _where in _partial_indexes(scoped=True):
        op.drop_index(name, table_name=table)
    for table, name, _columns in _UNIQUE_AFTER:
        op.drop_index(name, table_name=table)
    sequences = _sqlite_sequences()
    for table in _SCOPED:
        with _batch(table) as batch:
            batch.drop_index(op.f(f"ix_{table}_collection_id"))
            batch.drop_constraint(op.f(f"fk_{table}_collection_id_collections"),
                                  type_="foreignkey")
            batch.drop_column("collection_id")
            for constraint_table, constraint, columns in _UNIQUE_BEFORE:
                if constraint_table == table:
                    batch.create_unique_constraint(constraint, columns)
    _restore_sequences(sequences)
    for name, table, columns, where in _partial_indexes(scoped=False):
        _create_partial(name, table, columns, where)
    op.drop_table("collections")
