"""The FastAPI service: search, gallery management, evaluation, model versions, the web page.

It turns HTTP into calls of ``index`` (and ``imgret``) and their results back into HTTP; no
SQL is written here (that is ``imgret.gallery.storage``'s).

Start-up and the app:

- ``run``: what ``imgret serve`` calls: the checks before anything slow, the schema to
  head, uvicorn;
- ``app``: the app factory: middleware, routers, error handlers, the lifespan;
- ``resources``: what the app loads once per process (models, indexes, database, batcher);
- ``version_cache``: the other model versions' models and indexes open here, bounded;
- ``deps``: FastAPI dependencies (resources, settings, a session per request, API key).

A request on its way in:

- ``auth``: the write guard (API key, exposure, ``Origin``), decided before a body is read;
- ``limits``: what one request may cost (body size, the search budget);
- ``security_headers``: the security headers of every response;
- ``forms``: the one parser of multipart forms, into the models of ``schemas``;
- ``schemas``: the pydantic models of the API, in and out;
- ``request_rules``: what a request field may hold, the refusals, reading a form body;
- ``routers``: one module per path prefix, HTTP only (a package).

The work behind the routes:

- ``pipeline``: the search pipeline (decode, embed, rank, re-rank) that the batcher runs;
- ``batching``: dynamic batching: concurrent queries queued and run together, off the
  event loop;
- ``followups``: work that finishes an answer after its batch (re-ranking), on its own pool;
- ``gallery``: add, delete and look up items and stored images, search by a stored item;
- ``version_evaluation``: evaluate and compare model versions with what this process has
  open (``/evaluate``, the activation gate).

Errors, threads and observability:

- ``errors``: the one table from exceptions to HTTP answers;
- ``unavailable``: the service's own refusals (queue full, shutting down), answered 503;
- ``os_threads``: the service's worker threads as the OS sees them (names, priority);
- ``tasks``: asyncio helpers for the service's own background tasks;
- ``telemetry``: Prometheus metrics and the access log.

``static/`` holds the web page (HTML, JS, CSS).
"""
