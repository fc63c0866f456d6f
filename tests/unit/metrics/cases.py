"""Inputs and slow references shared by the imgret.metrics tests."""

from __future__ import annotations

import numpy as np


def scored(scores_per_query):
    """Query/gallery embeddings whose inner products are exactly ``scores_per_query``.

    Gallery item j is the unit vector e_j, so query row i . e_j = scores[i][j] (exact in
    float32; these are not unit-norm queries, which the metrics do not need).
    """
    s = np.asarray(scores_per_query, np.float32)
    return s, np.eye(s.shape[1], dtype=np.float32)


def clustered(n, d=16, classes=10, noise=1.5, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((classes, d)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    labels = rng.integers(0, classes, n)
    x = centres[labels] + noise * rng.standard_normal((n, d)).astype(np.float32) / np.sqrt(d)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float32), labels


def integer_embeddings(n, d=6, classes=5, seed=0):
    """Small-integer embeddings: every inner product is exact in float32, and ties abound."""
    rng = np.random.default_rng(seed)
    return rng.integers(-2, 3, (n, d)).astype(np.float32), rng.integers(0, classes, n)


def brute_force(q, ql, g, gl, ks, loo=False, qc=None, gc=None):
    """Reference: full stable sort of every query's scores (float64: exact for integer data)."""
    S = q.astype(np.float64) @ g.astype(np.float64).T
    rows, skipped = [], 0
    for i in range(len(q)):
        rel = gl == ql[i]
        removed = np.zeros(len(g), bool)
        if qc is not None:
            removed = rel & (gc == qc[i])
        elif loo:
            removed[i] = True
        rel &= ~removed
        R = int(rel.sum())
        if R == 0:
            skipped += 1
            continue
        keep = np.flatnonzero(~removed)
        order = keep[np.argsort(-S[i, keep], kind="stable")]  # ties: lower index first
        r = rel[order].astype(float)
        hits = np.cumsum(r)
        prec = hits / np.arange(1, len(r) + 1)
        first = int(np.argmax(r)) + 1
        row = {
            "map_at_r": float((prec[:R] * r[:R]).sum() / R),
            "r_precision": float(r[:R].sum() / R),
            "precision_at_1": float(r[0]),
            "mean_average_precision": float((prec * r).sum() / R),
            "mrr": 1.0 / first,
        }
        for k in ks:
            hk = r[:k].sum()
            row[f"recall_at_k/{k}"] = float(hk > 0)
            row[f"map_at_k/{k}"] = float((prec[:k] * r[:k]).sum() / hk) if hk else 0.0
            dcg = (r[:k] / np.log2(np.arange(2, min(k, len(r)) + 2))).sum()
            idcg = (1 / np.log2(np.arange(2, min(R, k) + 2))).sum()
            row[f"ndcg_at_k/{k}"] = float(dcg / idcg)
            row[f"recall_fraction_at_k/{k}"] = float(hk / R)
        rows.append(row)
    means = {key: float(np.mean([r[key] for r in rows])) for key in rows[0]}
    return means, skipped


def flat_report(rep):
    out = {m: rep[m] for m in ("map_at_r", "r_precision", "precision_at_1")}
    out["mean_average_precision"] = rep["mean_average_precision"]
    out["mrr"] = rep["mrr"]
    for m in ("recall_at_k", "map_at_k", "ndcg_at_k", "recall_fraction_at_k"):
        for k, v in rep[m].items():
            out[f"{m}/{k}"] = v
    return out
