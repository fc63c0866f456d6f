"""The gallery in SQL (source of truth), ingest jobs, and the FAISS index derived from it.

Modules and what the service uses from them:

- ``index.db``: ``make_engine(url)``, ``make_sessionmaker(engine)``, ``upgrade_to_head(url)``.
- ``index.models``: the SQLAlchemy tables (gallery items, embeddings per model version, model
  versions, query sets, the gallery change log).
- ``index.media``: ``MediaStore.in_data_dir(data_dir)`` — content-addressed image files.
- ``index.media_db``: ``open_media_store(settings, sessions)`` — the store of
  ``IMGRET_MEDIA_BACKEND``: those files, or the ``media_blobs`` table (``DatabaseMediaStore``).
- ``index.store``: repository functions (``session`` keyword-only, never commit).
- ``index.ingest``: ``add_items(items, *, session, media, embedder)`` for uploads and
  ``ingest_source(path, ...)`` for ``imgret ingest`` (a package: uploads, the chunk pipeline,
  the worker pool, the writer, the Ray Data variant).
- ``index.faiss_index``: factory checks, index creation, GPU placement, the index file.
- ``index.build``: ``build_from_sql(...)``, an index from the stored embeddings.
- ``index.manifest``: what a saved index was built from, checked against SQL on load.
- ``index.search``: ``Searcher.open(...)``, ``search``, ``add``, ``remove``,
  ``refresh_from_changes`` (a package: filters, ranking, live index, change log, lifecycle).
"""
