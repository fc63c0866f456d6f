"""PostgreSQL wakes the replicas: a NOTIFY on every gallery change and every model switch.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23

Statement-level triggers on ``gallery_changes`` (every add and delete writes one row there),
``model_activations`` (every activate and rollback) and ``model_versions.is_active`` call
``pg_notify('imgret_changes', <table>)``. PostgreSQL delivers a notification only when its
transaction commits, and folds identical ones of a transaction into one, so a listener is woken
once per committed write and never for a rolled-back one. A trigger rather than a call in the
write paths: every writer (the service, ``imgret ingest``, re-embedding jobs, an old process
that knows nothing of notifications) wakes the replicas. SQLite has no notifications: nothing
to do there (its replicas keep polling).
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CHANNEL = "imgret_changes"  # index.notify.CHANNEL (a migration must not import the app)
_TRIGGERS = (
    ("gallery_changes", "AFTER INSERT"),
    ("model_activations", "AFTER INSERT"),
    ("model_versions", "AFTER UPDATE OF is_active"),
)


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        f"""
        CREATE OR REPLACE FUNCTION imgret_notify_change() RETURNS trigger AS $$
        BEGIN
            PERFORM pg_notify('{CHANNEL}', TG_TABLE_NAME);
            RETURN NULL;
        END;
        $$ LANGUAGE plpgsql
        """
    )
    for table, when in _TRIGGERS:
        op.execute(
            f"CREATE TRIGGER {table}_notify {when} ON {table} "
            "FOR EACH STATEMENT EXECUTE FUNCTION imgret_notify_change()"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, _ in _TRIGGERS:
        op.execute(f"DROP TRIGGER IF EXISTS {table}_notify ON {table}")
    op.execute("DROP FUNCTION IF EXISTS imgret_notify_change()")
