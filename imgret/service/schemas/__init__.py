"""Pydantic models of the HTTP API, one module per router's resource: what the routers accept
(JSON bodies, and multipart forms read by :mod:`imgret.service.forms`) and what they return.

Models raise ``ValueError`` from their validators, as pydantic expects; the routes and
:mod:`imgret.service.forms` turn the resulting ``ValidationError`` into a 422.

- ``common``: limits shared by several resources, the re-ranking options, form helpers;
- ``health``, ``search`` (search, batch, identify), ``gallery``, ``evaluation``
  (``/evaluate`` and its reports), ``versions`` (``/models``), ``query_sets``,
  ``collections``, ``keys``: each resource's requests and responses.
"""
