"""Ingest: image bytes -> media store + gallery rows + embeddings + change log.

Two entry points share one pipeline (hash, dedup, decode, embed, write):

- :func:`add_items`: a list of uploaded images, all or nothing (``POST /gallery``);
- :func:`ingest_source`: a folder / CSV / Market-1501 source (``imgret ingest``), in chunks
  that each commit on their own; corrupt files are skipped and reported, and an interrupted
  run resumes by running it again.

Modules, one job each:

- :mod:`imgret.index.ingest.uploads`: :func:`add_items` and its types (:class:`NewItem`,
  :class:`AddedItems`);
- :mod:`imgret.index.ingest.pipeline`: :func:`ingest_source`, the chunk flow (read and hash, plan,
  hand to the workers, write on a writer thread, overlapped across chunks) and the stored
  ``source`` names;
- :mod:`imgret.index.ingest.workers`: the forked worker pool that decodes and (on the CPU) embeds,
  slices handed back through shared memory; :func:`default_workers`;
- :mod:`imgret.index.ingest.decode`: bytes -> model input, the served path's decoder (shared by the
  workers and the Ray actors);
- :mod:`imgret.index.ingest.plan`: dedup by content hash (what to create, what only needs an
  embedding), the idempotence of every ingest;
- :mod:`imgret.index.ingest.writer`: the write transaction (media bytes, then rows, under the
  gallery write lock, planned again under it), its concurrency and crash-safety rules;
- :mod:`imgret.index.ingest.report`: :class:`IngestReport`, counts and seconds per stage;
- :mod:`imgret.index.ingest.ray`: the same bulk ingest on Ray Data (``imgret ingest PATH --ray``,
  extra ``ray``); import it by name: it is not loaded with this package.
"""

from imgret.index.ingest.pipeline import ingest_source
from imgret.index.ingest.report import STAGES, IngestReport
from imgret.index.ingest.uploads import AddedItems, NewItem, add_items
from imgret.index.ingest.workers import default_workers

__all__ = [
    "STAGES",
    "AddedItems",
    "IngestReport",
    "NewItem",
    "add_items",
    "default_workers",
    "ingest_source",
]
