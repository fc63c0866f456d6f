"""Input checks of :mod:`imgret.metrics`: every malformed input raises ``ValueError`` with a
message that names the argument, before any work is done.

Embeddings become float32 tensors on the requested device; labels and cameras become small
ints (:func:`encode_pair`); rank lists become one CSR array (:func:`rank_lists`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch


def to_numpy(x: Any) -> np.ndarray:
    """An array or tensor (any device) as a NumPy array."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def is_bool_matrix(x: Any) -> bool:
    """Whether ``x`` is a 2-D boolean array or tensor (a relevance matrix)."""
    if isinstance(x, torch.Tensor):
        return x.dtype == torch.bool and x.dim() == 2
    return isinstance(x, np.ndarray) and x.dtype == np.bool_ and x.ndim == 2


def as_int_vector(x: Any, name: str) -> np.ndarray:
    """``x`` as a 1-D int64 array (integral floats accepted); ``name`` goes in the errors."""
    arr = to_numpy(x)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if np.issubdtype(arr.dtype, np.floating) and np.all(np.mod(arr, 1) == 0):
            arr = arr.astype(np.int64)
        else:
            raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def rank_lists(lists: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` per-query lists of 1-based ranks as ``(ranks, offsets)`` (CSR, in the given order).

    Rejects ranks < 1 and a rank listed twice by one query.
    """
    if isinstance(lists, (np.ndarray, torch.Tensor)):
        arr = to_numpy(lists)
        # A 2-D integer array is one row of ranks per query (equal counts).
        if arr.ndim not in (1, 2) or (arr.ndim == 2 and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(
                "relevant_ranks must be a 2-D boolean relevance matrix or a sequence of 1-D "
                "rank arrays"
            )
        lists = list(arr)
    if not isinstance(lists, (Sequence, np.ndarray)) or isinstance(lists, str):
        raise ValueError("relevant_ranks must be a boolean matrix or a sequence of rank arrays")
    if len(lists) != n:
        raise ValueError(
            f"relevant_ranks has {len(lists)} queries but num_relevant has {n} entries"
        )
    parts = []
    for i, r in enumerate(lists):
        arr = np.atleast_1d(to_numpy(r)) if np.ndim(to_numpy(r)) == 0 else to_numpy(r)
        if arr.ndim != 1:
            raise ValueError(f"relevant_ranks[{i}] must be 1-D, got shape {arr.shape}")
        arr = as_int_vector(arr, f"relevant_ranks[{i}]") if arr.size else np.empty(0, np.int64)
        parts.append(arr)
    counts = np.array([len(p) for p in parts], np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    ranks = np.concatenate(parts) if parts else np.empty(0, np.int64)
    if ranks.size:
        if ranks.min() < 1:
            raise ValueError("ranks are 1-based: every rank must be >= 1")
        q = np.repeat(np.arange(n), counts)
        order = np.lexsort((ranks, q))
        sr, sq = ranks[order], q[order]
        if np.any((sr[1:] == sr[:-1]) & (sq[1:] == sq[:-1])):
            raise ValueError("a query lists the same rank twice")
    return ranks, offsets


def validate_k(k: Any, limit: int | None, what: str) -> list[int]:
    """The cut-offs ``k`` (an int or an iterable of ints), sorted and de-duplicated; each in
    ``1..limit`` (``what`` names the limit in the error; None: no upper limit)."""
    if isinstance(k, (int, np.integer)):
        values = [k]
    elif isinstance(k, Iterable) and not isinstance(k, (str, bytes)):
        values = list(k)
    else:
        raise ValueError(f"k must be a positive int or a list of them, got {k!r}")
    if not values:
        raise ValueError("k must be a positive int or a non-empty list of them")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"k values must be ints, got {v!r}")
        if v < 1:
            raise ValueError(f"k must be >= 1, got {int(v)}")
        if limit is not None and v > limit:
            raise ValueError(f"k={int(v)} is larger than {what} ({limit})")
        out.append(int(v))
    return sorted(set(out))


def validate_bootstrap(bootstrap: Any) -> None:
    """``bootstrap`` (the number of resamples) must be an int >= 0."""
    if isinstance(bootstrap, bool) or not isinstance(bootstrap, (int, np.integer)):
        raise ValueError(f"bootstrap must be an int >= 0, got {bootstrap!r}")
    if bootstrap < 0:
        raise ValueError(f"bootstrap must be >= 0, got {bootstrap}")


def prepare_embeddings(
    query_emb: Any, gallery_emb: Any, device: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both embedding matrices as contiguous float32 tensors on ``device`` (views of the
    caller's arrays where they already are), after checking shapes, dtypes and finiteness."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}") from exc
    mats = []
    for name, x in (("query_emb", query_emb), ("gallery_emb", gallery_emb)):
        if isinstance(x, torch.Tensor):
            if x.dim() != 2:
                raise ValueError(f"{name} must be 2-D (n, d), got shape {tuple(x.shape)}")
            if not (x.is_floating_point()):
                raise ValueError(f"{name} must be floating point, got {x.dtype}")
        else:
            x = np.asarray(x)
            if x.ndim != 2:
                raise ValueError(f"{name} must be 2-D (n, d), got shape {x.shape}")
            if not np.issubdtype(x.dtype, np.floating):
                raise ValueError(f"{name} must be floating point, got {x.dtype}")
        if x.shape[0] == 0 or x.shape[1] == 0:
            raise ValueError(f"{name} is empty (shape {tuple(x.shape)})")
        mats.append(x)
    if mats[0].shape[1] != mats[1].shape[1]:
        raise ValueError(
            f"dimension mismatch: query_emb has d={mats[0].shape[1]}, "
            f"gallery_emb has d={mats[1].shape[1]}"
        )
    out = []
    for name, x in zip(("query_emb", "gallery_emb"), mats, strict=True):
        if dev.type == "cpu":
            arr = np.ascontiguousarray(to_numpy(x), dtype=np.float32)
            # Squared norms catch NaN/inf and magnitudes whose dot products would overflow.
            if not np.all(np.isfinite(np.einsum("ij,ij->i", arr, arr, dtype=np.float64))):
                raise ValueError(f"{name} contains NaN or infinite values")
            out.append(_read_only_tensor(arr))
        else:
            t = x if isinstance(x, torch.Tensor) else _read_only_tensor(np.asarray(x))
            t = t.to(device=dev, dtype=torch.float32).contiguous()
            if not bool(torch.isfinite((t.double() ** 2).sum(1)).all()):
                raise ValueError(f"{name} contains NaN or infinite values")
            out.append(t)
    return out[0], out[1]


def encode_pair(q: Any, g: Any, n_q: int, n_g: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Map query and gallery values (ints, strings, ...) jointly to small ints."""
    qa, ga = to_numpy(q), to_numpy(g)
    for name, arr, n in ((f"query_{what}", qa, n_q), (f"gallery_{what}", ga, n_g)):
        if arr.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
        if len(arr) != n:
            raise ValueError(f"{name} has {len(arr)} entries but there are {n} embeddings")
    try:
        both = np.concatenate([qa, ga])
        _, inv = np.unique(both, return_inverse=True)
    except TypeError as exc:  # e.g. ints mixed with strings in an object array
        raise ValueError(f"{what} must be all of one comparable type: {exc}") from exc
    if both.dtype.kind == "f" and np.any(np.isnan(both)):
        raise ValueError(f"{what} contain NaN")
    inv = inv.reshape(-1).astype(np.int64)
    return inv[:n_q], inv[n_q:]


def _read_only_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor view of ``array`` without a copy; torch only reads it here, so the warning it
    gives for read-only arrays (e.g. vectors decoded from database bytes) does not apply."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)
