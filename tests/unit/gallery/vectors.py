"""Seeded clustered unit vectors (like real embeddings) for index tests."""

from __future__ import annotations

import numpy as np


def clustered_vectors(n: int, dim: int = 16, clusters: int = 8, seed: int = 0) -> np.ndarray:
    """``(n, dim)`` float32 unit vectors drawn around ``clusters`` random centres."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, dim))
    points = centres[rng.integers(0, clusters, n)] + 0.35 * rng.normal(size=(n, dim))
    points /= np.linalg.norm(points, axis=1, keepdims=True)
    return points.astype(np.float32)
