"""Evaluation through the serving path: the same index, filters and ranking users get.

- ``retrieval``: a labelled query set ranked through the Searcher and scored (MAP@R, P@1,
  ...), and the paired comparison of two versions (``POST /evaluate``, ``imgret evaluate``);
- ``open_set``: "who is this, or nobody", measured as FNIR at FPIR;
- ``calibration``: a version's decision threshold, calibrated on a query set and kept.
"""
