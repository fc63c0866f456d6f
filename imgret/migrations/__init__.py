"""Alembic migrations of the gallery schema (SQLite and PostgreSQL alike).

- ``env.py``: where the database URL comes from (the caller, ``-x url=``, or the settings);
- ``versions/``: one file per revision, in order (``0001_...``, ``0002_...``); each says
  whether it runs on a live database.

``imgret.gallery.storage.db.upgrade_to_head`` runs them (``imgret db upgrade``, and every start of
``imgret serve``); ``alembic.ini`` in the repository root points here for plain ``alembic``.
"""
