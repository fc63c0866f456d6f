"""The gallery's database: the one place that speaks SQL about items.

- ``db``: engines, sessions, and the Alembic migrations brought to head;
- ``tables``: the SQLAlchemy tables (collections, items, embeddings per model version,
  model versions, query sets, the change log, checkpoints, calibrations, image blobs, keys);
- ``scope``: one collection per session, the filter that keeps collections apart;
- ``item_store``: gallery items and their vectors (the write lock, inserts, deletes that
  clear personal data, dedup lookups, reads, whether image bytes are still referenced);
- ``vector_store``: stored vectors, encoded as float32 bytes and read back in pages or by id;
- ``change_log``: one row per gallery write, in commit order, that replicas poll;
- ``query_set_store``: named, labelled query sets;
- ``bulk``: bulk inserts and chunked ``IN`` lists;
- ``notify``: PostgreSQL LISTEN wake-ups, so replicas follow writes at once;
- ``holders``: the database lock that serving processes share and maintenance takes alone.

Store functions take ``session`` keyword-only and never commit: the caller frames the
transaction. A model version's own SQL (the version rows, activation, checkpoint bytes,
coverage, job claims) is :mod:`imgret.gallery.versions.version_store`.
"""
