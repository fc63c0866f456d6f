"""Search a gallery: one model version's FAISS index, with filters and live updates.

:class:`Searcher` (in :mod:`imgret.index.search.searcher`) composes parts with one job each and
holds the locks that make them safe together:

- :mod:`imgret.index.search.filters`: :class:`SearchFilter`, and the catalog of live ids (label,
  camera, metadata) that turns a filter into an allowed-id mask;
- :mod:`imgret.index.search.ranking`: :class:`Hit`, and the ladder that gives a filtered search
  ``min(k, matching)`` hits on any index type (id selector or over-fetch, exhaustive retry,
  exact re-rank);
- :mod:`imgret.index.search.live`: the index being served (CPU master, GPU mirror), tombstones, and
  the memory of deleted ids, changed by adds, removes and rebuild swaps;
- :mod:`imgret.index.search.changes`: what other processes committed (the deletes to catch up on
  before each search, the change log to replay);
- :mod:`imgret.index.search.rerank`: k-reciprocal re-ranking and average query expansion, from one
  query's top candidates and their own neighbourhoods in the index;
- :mod:`imgret.index.search.lifecycle`: open (load and check against SQL, or rebuild), save,
  background rebuilds;
- :mod:`imgret.index.search.threads`: how many threads a search may use (one per query, at most
  what the calling thread has), and the small-batch exact path (one BLAS product + FAISS's
  top-k heap) that keeps single queries at least as fast as NumPy brute force;
- :mod:`imgret.index.search.lock`: the reader/writer lock.
"""

from imgret.index.search.filters import SearchFilter
from imgret.index.search.lock import ReadWriteLock
from imgret.index.search.ranking import Hit
from imgret.index.search.searcher import Searcher

__all__ = ["Hit", "ReadWriteLock", "SearchFilter", "Searcher"]
