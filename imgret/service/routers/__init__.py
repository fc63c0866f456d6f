"""The HTTP routes, one module per path prefix. A router only translates HTTP: it reads the
request, calls a service module (``imgret.service.gallery``, ``imgret.service.version_evaluation``,
the
batcher) or ``index``, and shapes the answer; it imports no other router and writes no SQL
(``tests/unit/test_layering.py`` checks both).

- ``search``: ``POST /search`` and ``/search/batch`` (its docstring traces a search to FAISS);
- ``gallery``: ``/gallery``: add, list, read, fetch image bytes, delete;
- ``query_sets``: ``/query-sets``: the stored labelled query sets and their images;
- ``evaluate``: ``POST /evaluate``: metrics of a query set ranked through the serving index;
- ``models``: ``/models``: register, re-embed, switch (gated), roll back;
- ``admin``: ``POST /admin/backup``: a consistent backup while serving;
- ``health``: ``GET /health``: liveness and what is being served;
- ``metrics``: ``GET /metrics``: Prometheus exposition;
- ``ui``: ``GET /``: the web page.
"""
