"""The gallery: SQL as the source of truth, image bytes beside it, and the FAISS indexes
derived from it; model versions; what the commands run on them.

No module here knows HTTP: ``service`` calls these, and ``imgret`` (the core) is below.

The database:

- ``db``: engines, sessions, and the Alembic migrations brought to head;
- ``models``: the SQLAlchemy tables (items, embeddings per model version, model versions,
  query sets, the change log, stored checkpoints and image bytes);
- ``store``: the repository functions, the gallery's SQL (``session`` keyword-only, never
  commit: the caller frames the transaction), the active version among it;
- ``version_store``: a model version's own records: lookups, checkpoint bytes, the
  activation history, coverage, and the claims and heartbeats of re-embedding jobs;
- ``notify``: PostgreSQL LISTEN wake-ups, so replicas follow writes at once;
- ``serving``: the database lock that running servers share and maintenance takes alone.

Image bytes:

- ``media``: the content-addressed folder of image files;
- ``media_db``: the ``media_blobs`` store in the database, the choice between the two, and
  moving a gallery from one to the other;
- ``gc``: removing bytes no row refers to, after a delete and at start-up.

Writing and searching:

- ``ingest``: image bytes -> media + rows + embeddings, for uploads and bulk sources (a
  package: its ``__init__`` lists the parts);
- ``faiss_index``: factory checks, index creation, query-time knobs, GPU placement, the file;
- ``build``: an index from the stored embeddings of a model version;
- ``manifest``: what a saved index was built from, checked against SQL on load;
- ``search``: the ``Searcher``, one version's index with filters, live updates and
  re-ranking (a package: its ``__init__`` lists the parts);
- ``evaluation``: a labelled query set ranked through the Searcher and scored, and the
  paired comparison of two versions (``POST /evaluate``, ``imgret evaluate``).

Model versions and operations:

- ``versions``: register a checkpoint, describe, compare and delete versions, switch the
  served one (gated on a paired verdict), roll back (``/models`` and ``imgret models``);
- ``reembed``: the background job that embeds the stored gallery for a new version,
  resumable and throttled;
- ``backup``: a consistent backup of database, media, checkpoints and indexes while
  serving, and its restore;
- ``commands``: what ``imgret db``, ``ingest``, ``index build``, ``evaluate`` and
  ``media migrate`` run, one function each;
- ``model_commands``: what ``imgret models ...`` runs, one function each.
"""
