"""What the commands of ``imgret`` run on the gallery, one function each (the benchmarks call
them too):

- ``gallery``: ``imgret db``, ``ingest``, ``index build``, ``evaluate``, ``media migrate``;
- ``models``: ``imgret models ...`` and ``imgret export --quantize``.
"""
