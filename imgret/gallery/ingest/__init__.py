"""Ingest: image bytes -> media store + gallery rows + embeddings + change log.

Two entry points share one pipeline (hash, dedup, decode, embed, write):

- :func:`add_items`: a list of uploaded images, all or nothing (``POST /gallery``);
- :func:`ingest_source`: a folder / CSV / Market-1501 source (``imgret ingest``), in chunks
  that each commit on their own; corrupt files are skipped and reported, and an interrupted
  run resumes by running it again.

Modules, one job each:

- :mod:`imgret.gallery.ingest.uploads`: :func:`add_items` and its types (:class:`NewItem`,
  :class:`AddedItems`);
- :mod:`imgret.gallery.ingest.pipeline`: :func:`ingest_source`, the chunk flow (read and hash, plan,
  hand to the workers, write on a writer thread, overlapped across chunks) and the stored
  ``source`` names;
- :mod:`imgret.gallery.ingest.workers`: the forked worker pool that decodes and (on the CPU) embeds,
  slices handed back through shared memory; :func:`default_workers`;
- :mod:`imgret.gallery.ingest.decode`: bytes -> model input, the served path's decoder (shared by
  the workers and the Ray actors);
- :mod:`imgret.gallery.ingest.plan`: dedup by content hash (what to create, what only needs an
  embedding), the idempotence of every ingest;
- :mod:`imgret.gallery.ingest.writer`: the write transaction (media bytes, then rows, under the
  gallery write lock, planned again under it), its concurrency and crash-safety rules;
- :mod:`imgret.gallery.ingest.report`: :class:`IngestReport`, counts and seconds per stage;
- :mod:`imgret.gallery.ingest.ray`: the same bulk ingest on Ray Data (``imgret ingest PATH --ray``,
  extra ``ray``); import it by name: it is not loaded with this package.
"""

from imgret.gallery.ingest.pipeline import ingest_source
from imgret.gallery.ingest.report import STAGES, IngestReport
from imgret.gallery.ingest.uploads import AddedItems, NewItem, add_items
from imgret.gallery.ingest.workers import default_workers

__all__ = [
    "STAGES",
    "AddedItems",
    "IngestReport",
    "NewItem",
    "add_items",
    "default_workers",
    "ingest_source",
]
