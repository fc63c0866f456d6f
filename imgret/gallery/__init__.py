"""The gallery: SQL as the source of truth, image bytes beside it, the FAISS indexes derived
from it, and the model versions that embed it. Each room is a sub-package whose
``__init__`` lists its modules:

- ``storage``: the database (engines, migrations, the tables, the collection scope, the
  SQL of items, query sets and the change log, wake-ups, the lock serving processes hold);
- ``media``: image bytes (a content-addressed folder or database blobs) and removing the
  bytes no row refers to;
- ``ingest``: image bytes -> media + rows + embeddings, for uploads and bulk sources;
- ``search``: one version's FAISS index with filters, live updates and re-ranking, how it
  is built from stored vectors and checked against SQL;
- ``versions``: model versions (their records, registering, switching the served one,
  re-embedding the gallery, int8 versions);
- ``evaluation``: query sets ranked through the serving path, paired comparisons, open-set
  decisions and the thresholds calibrated on them;
- ``tenancy``: collections and API keys, where access and ownership live;
- ``backup``: a consistent backup while serving, and its restore.

No module here knows HTTP or the command line: ``imgret.service`` and ``imgret.cli`` call
these, and ``imgret`` (the core) is below.
"""
