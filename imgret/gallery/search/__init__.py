"""Search a gallery: one model version's index (FAISS in process, or Milvus), with filters and
live updates.

:class:`Searcher` (in :mod:`imgret.gallery.search.searcher`) composes parts with one job each and
holds the locks that make them safe together:

- :mod:`imgret.gallery.search.filters`: :class:`SearchFilter`, and the catalog of live ids (label,
  camera, metadata) that turns a filter into an allowed-id mask;
- :mod:`imgret.gallery.search.ranking`: :class:`Hit`, and the ladder that gives a filtered search
  ``min(k, matching)`` hits on any index type (id selector or over-fetch, exhaustive retry,
  exact re-rank);
- :mod:`imgret.gallery.search.live`: the index being served (CPU master, GPU mirror), tombstones,
  and the memory of deleted ids, changed by adds, removes and rebuild swaps;
- :mod:`imgret.gallery.search.milvus_index`: the same contract with the vectors on Milvus
  (``IMGRET_INDEX_BACKEND=milvus``), reconciled with SQL on open;
- :mod:`imgret.gallery.search.changes`: what other processes committed (the deletes to catch up on
  before each search, the change log to replay);
- :mod:`imgret.gallery.search.rerank`: k-reciprocal re-ranking and average query expansion, from one
  query's top candidates and their own neighbourhoods in the index;
- :mod:`imgret.gallery.search.lifecycle`: open (load and check against SQL, or rebuild), save,
  background rebuilds;
- :mod:`imgret.gallery.search.threads`: how many threads a search may use (one per query, at most
  what the calling thread has), and the small-batch exact path (one BLAS product + FAISS's
  top-k heap) that keeps single queries at least as fast as NumPy brute force;
- :mod:`imgret.gallery.search.lock`: the reader/writer lock.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from imgret.gallery.search.filters import SearchFilter
    from imgret.gallery.search.lock import ReadWriteLock
    from imgret.gallery.search.ranking import Hit
    from imgret.gallery.search.searcher import Searcher

__all__ = ["Hit", "ReadWriteLock", "SearchFilter", "Searcher"]

# Loaded on first use (PEP 562): a command that needs only the index's manifest or file
# helpers (a collection delete, ``imgret media migrate``) must not import FAISS, whose loader
# logs to the command's one-line error output and costs start-up time.
_HOME = {"Hit": "ranking", "ReadWriteLock": "lock", "SearchFilter": "filters",
         "Searcher": "searcher"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
