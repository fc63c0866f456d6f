"""What the app holds per collection and process, and how it gets and keeps it:

- ``bundle``: :class:`Resources`, the typed bundle (model, index, database, batcher) and
  the follower's state;
- ``embed_jobs``: the supervisor of the background re-embedding jobs;
- ``startup``: assembling the bundle at start-up (the default collection) and on a
  collection's first request, and the checks that refuse a version that cannot serve;
- ``follower``: following what other processes commit (change log, switches), woken by
  PostgreSQL's LISTEN or on an interval.
"""
