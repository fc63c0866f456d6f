"""Retrieval metrics: one exact, chunked implementation shared by training, `/evaluate` and the CLI.

Two pure functions produce the same report:

* :func:`retrieval_metrics` takes embeddings and labels, runs an exact (flat, inner-product)
  search in query chunks and hands the rank of every relevant gallery item to the same code
  that :func:`ranking_metrics` uses.
* :func:`ranking_metrics` takes rankings that were computed elsewhere (for example the top-K
  lists that the service gets back from FAISS) and computes the report from them.

Ranking convention (both functions):
    Scores are similarities, higher is better. Ties are broken by gallery index, lower index
    first: the order of a stable sort on descending score, which is also the order FAISS's flat
    search returns and hence what pytorch-metric-learning's ``AccuracyCalculator`` sees. A rank
    is 1-based: the best gallery item has rank 1.

Why no top-k search: ``mean_average_precision`` is defined over the *full* ranking, so the
rank of every relevant item is needed, however deep; :mod:`imgret.metrics.ranks` counts it
exactly without sorting the gallery.

Modules, in reading order:

* ``retrieval``: the two entry points.
* ``inputs``: input checks and conversions (every malformed input is a ``ValueError``).
* ``relevance``: who is relevant to whom (labels, leave-one-out, the re-ID camera rule).
* ``ranks``: the one rank engine (a float32 GEMM per chunk, a numba kernel for the counts).
* ``definitions``: the metrics from the ranks, and the report; its ``ci95`` is
  :func:`imgret.stats.bootstrap_ci`.
* ``jit``: the numba compilation of the loops, each written once as plain Python.
"""

from imgret.metrics.definitions import per_query_table
from imgret.metrics.retrieval import ranking_metrics, retrieval_metrics

__all__ = ["per_query_table", "ranking_metrics", "retrieval_metrics"]
