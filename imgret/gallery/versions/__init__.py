"""Model versions: a checkpoint bound to a collection, with its vectors of the gallery.

- ``version_store``: a version's own SQL (the version rows, the active one, lookups,
  checkpoint bytes, activation history, coverage, the claims and heartbeats of jobs);
- ``intake``: a checkpoint read (confined paths, uploads, bytes), checked and registered;
- ``lifecycle``: describe, compare and delete versions, switch the served one (gated on a
  paired verdict), roll back (``/models``, ``imgret models``);
- ``reembed``: the background job that embeds the stored gallery for a version, resumable
  and throttled;
- ``quantization``: an int8 version of a registered one, calibrated on stored images.
"""
