"""imgret.metrics input validation: every malformed input is a ValueError naming the problem."""

from __future__ import annotations

import numpy as np
import pytest

from imgret.metrics import ranking_metrics, retrieval_metrics
from tests.unit.metrics.cases import clustered


@pytest.mark.parametrize(
    ("ranks", "num_relevant", "kwargs", "match"),
    [
        ([[1, 2]], [1], {}, "lists 2 relevant"),
        ([[1]], [2], {}, "pass depth"),
        ([[0]], [1], {}, ">= 1"),
        ([[2, 2]], [2], {}, "twice"),
        ([[1], [1]], [1], {}, "num_relevant has 1"),
        ([[5]], [1], {"depth": 3}, "depth"),
        ([[1]], [-1], {}, ">= 0"),
        ([[1]], [[1]], {}, "1-D"),
        ([[1.5]], [1], {}, "integers"),
        ([[1]], [1], {"k": 0}, "k must be >= 1"),
        ([[1]], [1], {"bootstrap": -1}, "bootstrap"),
        ([[1]], [], {}, "empty"),
        ([[]], [0], {}, "no query"),
        (np.zeros((2, 2, 2), bool), [1, 1], {}, "relevance matrix"),
        (np.ones((2, 2)), [2, 2], {}, "relevance matrix"),
        (np.zeros((2, 3), bool), [1, 1], {"depth": 3}, "implied"),
        (np.zeros((1, 3), bool), [1, 1], {}, "rows"),
    ],
)
def test_ranking_metrics_bad_input(ranks, num_relevant, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ranking_metrics(ranks, num_relevant, **kwargs)


_X, _Y = clustered(20, d=4, classes=3)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((_X[:0], _Y[:0], _X, _Y), {}, "empty"),
        ((_X, _Y, _X[:0], _Y[:0]), {}, "empty"),
        ((_X, _Y[:5], _X, _Y), {}, "entries"),
        ((_X, _Y, _X, _Y[:-1]), {}, "entries"),
        ((_X, _Y, _X[:, :3], _Y), {}, "dimension mismatch"),
        ((np.where(np.eye(20, 4, dtype=bool), np.nan, _X), _Y, _X, _Y), {}, "NaN"),
        ((_X, _Y, np.where(np.eye(20, 4, dtype=bool), np.inf, _X), _Y), {}, "NaN or infinite"),
        ((_X[0], _Y, _X, _Y), {}, "2-D"),
        ((_X.astype(np.int64), _Y, _X, _Y), {}, "floating"),
        ((_X, _Y, _X, _Y), {"k": 21}, "larger than"),
        ((_X, _Y, _X, _Y), {"k": 0}, ">= 1"),
        ((_X, _Y, _X, _Y), {"k": (1, -3)}, ">= 1"),
        ((_X, _Y, _X, _Y), {"k": ()}, "non-empty"),
        ((_X, _Y, _X, _Y), {"k": 1.5}, "positive int"),
        ((_X, _Y[:, None], _X, _Y), {}, "1-D"),
        ((_X, _Y, _X, np.stack([_Y, _Y], 1)), {}, "1-D"),
        ((_X, _Y, _X, _Y), {"query_cameras": _Y}, "both"),
        ((_X, _Y, _X, _Y), {"gallery_cameras": _Y}, "both"),
        ((_X, _Y, _X, _Y), {"query_cameras": _Y, "gallery_cameras": _Y[:3]}, "entries"),
        ((_X[:5], _Y[:5], _X, _Y), {"query_in_gallery": True}, "as many queries"),
        ((_X, _Y[::-1], _X, _Y), {"query_in_gallery": True}, "label"),
        ((_X, _Y, _X, _Y), {"chunk_size": 0}, "chunk_size"),
        ((_X, _Y, _X, _Y), {"bootstrap": -5}, "bootstrap"),
        ((_X, _Y, _X, _Y), {"device": "no-such-device"}, "device"),
        ((_X, np.array([1, "a"] * 10, dtype=object), _X, _Y), {}, "one comparable type"),
    ],
)
def test_bad_input_raises_value_error(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        retrieval_metrics(*args, **kwargs)
