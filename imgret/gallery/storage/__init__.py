"""The gallery's database: the one place that speaks SQL.

- ``db``: engines, sessions, and the Alembic migrations brought to head;
- ``tables``: the SQLAlchemy tables (collections, items, embeddings per model version,
  model versions, query sets, the change log, checkpoints, calibrations, image blobs, keys);
- ``scope``: one collection per session, the filter that keeps collections apart;
- ``store``: the repository functions over items, embeddings, the change log and query sets
  (``session`` keyword-only, never commit: the caller frames the transaction);
- ``notify``: PostgreSQL LISTEN wake-ups, so replicas follow writes at once;
- ``holders``: the database lock that serving processes share and maintenance takes alone.

A model version's own records (checkpoint bytes, activations, coverage, job claims) are in
:mod:`imgret.gallery.versions.records`.
"""
