"""Scoring a split: the validation and test numbers of a run, from embedding the split
through the Embedder and scoring it with imgret.metrics.

Every number of a run (validation each epoch, the test once, the baselines) comes from
:func:`score_split`, so they are comparable. The trained and untrained networks are embedded
by ``imgret.embedder.Embedder`` (the one embedding path); the raw-pixel baseline is the one
"embedding" that is not a network: L2-normalised flattened pixels.

Which images are queries and which the gallery depends on the protocol:

- class-disjoint: the split is both (every image is a query against all others of the split,
  ``query_in_gallery=True``), as in the Reality Check;
- closed-set: the split's images are queries against the *training* images (a stratified
  subset of at most ``max_eval_images``), as a product-search service would be used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from imgret.checkpoint import EmbeddingNet
from imgret.embedder import Embedder
from imgret.metrics import per_query_table, retrieval_metrics
from imgret.stats import BETTER, WORSE, paired_comparison
from imgret.training.config import TrainConfig
from imgret.training.data import DataSplit, ImageSource, iter_images, stratified_subset
from imgret.training.data.sources import grey_pixels
from imgret.training.geometry import embedding_geometry

logger = logging.getLogger(__name__)

# The raw-pixel baseline's side length: large images are shrunk so the vectors stay small.
PIXEL_SIDE_MAX = 64


@dataclass
class EmbeddedSet:
    """Vectors of one split.

    Attributes:
        embeddings: ``(n, d)`` float32, unit rows.
        labels: ``(n,)`` class names.
        cameras: ``(n,)`` int64 camera ids, or ``None``.
    """

    embeddings: np.ndarray
    labels: np.ndarray
    cameras: np.ndarray | None


class Evaluator:
    """The query / gallery sets of a run's protocol, built once, and the models scored on them.

    Args:
        config: the run's config (protocol, caps, seeds, image size).
        source: the images.
        split: the run's split.
        device: where the exact search of the metrics runs (``cpu`` or ``cuda``: where the
            model trains).
    """

    def __init__(self, config: TrainConfig, source: ImageSource, split: DataSplit, device: str):
        self.config, self.source, self.split, self.device = config, source, split, device
        self.gallery_indices: np.ndarray | None = None
        if config.protocol == "closed-set":
            # Queries are held-out images, the gallery the training images (capped, seeded).
            train_idx = split.indices["train"]
            cap = config.max_eval_images
            if cap is not None and len(train_idx) > cap:
                rng = np.random.default_rng([config.split_seed, 1])
                train_idx = stratified_subset(train_idx, source.labels, cap, rng)
            self.gallery_indices = train_idx

    def validate(self, model: EmbeddingNet, *, epoch: int) -> tuple[dict[str, Any],
                                                                     dict[str, float]]:
        """Validation metrics of the network at an epoch, and the geometry of its validation
        embeddings (:func:`imgret.training.geometry.embedding_geometry`: the collapse
        detector's input)."""
        embedded: list[EmbeddedSet] = []

        def embed(idx: np.ndarray) -> EmbeddedSet:
            embedded.append(embed_split(model, self.source, idx, tag=f"epoch-{epoch}"))
            return embedded[-1]

        metrics = self._score(embed, "val")
        return metrics, embedding_geometry(embedded[0].embeddings)  # [0]: the queries

    def test(self, model: EmbeddingNet, *, per_query: bool = False) -> dict[str, Any]:
        """Test metrics of a network (with ``per_query``: the per-query values too, for
        :func:`baseline_verdicts`)."""
        return self._score(lambda idx: embed_split(model, self.source, idx, tag="test"), "test",
                           per_query=per_query)

    def test_pixels(self, *, per_query: bool = False) -> dict[str, Any]:
        """Test metrics of the raw-pixel baseline."""
        def embed(idx: np.ndarray) -> EmbeddedSet:
            return pixel_split(self.source, idx, side=self.config.image_size)

        return self._score(embed, "test", per_query=per_query)

    def test_models(self, models: Sequence[EmbeddingNet]) -> dict[str, Any]:
        """Test metrics of several networks (the fold models of a cross-validated run), each
        alone and concatenated, from one embedding of the test split per network.

        Returns:
            ``{"separate": [metrics per model], "concatenated": metrics}``: the concatenation
            is :func:`concatenate` of the models' embeddings (``k x d`` dimensions).
        """
        test_idx = self.split.indices["test"]
        queries = [embed_split(m, self.source, test_idx, tag="test") for m in models]
        galleries: list[EmbeddedSet | None] = [
            embed_split(m, self.source, self.gallery_indices, tag="test")
            if self.gallery_indices is not None else None for m in models]
        separate = [score_split(q, g, device=self.device)
                    for q, g in zip(queries, galleries, strict=True)]
        gallery = (concatenate([g for g in galleries if g is not None])
                   if self.gallery_indices is not None else None)
        return {"separate": separate,
                "concatenated": score_split(concatenate(queries), gallery, device=self.device)}

    def _score(self, embed: Callable[[np.ndarray], EmbeddedSet], split: str, *,
               per_query: bool = False) -> dict[str, Any]:
        queries = embed(self.split.indices[split])
        gallery = embed(self.gallery_indices) if self.gallery_indices is not None else None
        return score_split(queries, gallery, device=self.device, per_query=per_query)


def embed_split(
    model: EmbeddingNet, source: ImageSource, indices: np.ndarray, *, batch_size: int = 256,
    tag: str = "validation",
) -> EmbeddedSet:
    """Embed source items with ``Embedder.from_model`` (eval mode restored afterwards).

    Args:
        model: the network (on its training device).
        source: the images.
        indices: ``(k,)`` int64 source indices.
        tag: names the model in the Embedder (skips hashing the weights at every epoch).
    """
    embedder = Embedder.from_model(model, model_version=tag, batch_size=batch_size)
    parts, kept = [], []
    pixels = grey_pixels(source)
    if pixels is not None and embedder.transform.grey_table(*pixels.shape[1:]) is not None:
        # An in-memory greyscale array: the transform's per-pixel table, no PIL images.
        for start in range(0, len(indices), batch_size):
            chunk = np.asarray(indices[start : start + batch_size], dtype=np.int64)
            parts.append(embedder.embed_tensors(embedder.transform.grey_tensor(pixels[chunk])))
            kept.append(chunk)
        return _embedded(source, parts, kept, model.spec.dim)
    for chunk_indices, images in iter_images(source, indices):
        if images:
            parts.append(embedder.embed(images))
            kept.append(chunk_indices)
    return _embedded(source, parts, kept, model.spec.dim)


def pixel_split(source: ImageSource, indices: np.ndarray, *, side: int) -> EmbeddedSet:
    """The raw-pixel baseline: each image resized to ``side`` (at most 64) px, flattened,
    L2-normalised (greyscale sources keep one channel)."""
    side = min(side, PIXEL_SIDE_MAX)
    parts, kept = [], []
    for chunk_indices, images in iter_images(source, indices):
        if not images:
            continue
        parts.append(pixel_embeddings(images, side=side, grayscale=source.grayscale))
        kept.append(chunk_indices)
    return _embedded(source, parts, kept, side * side * (1 if source.grayscale else 3))


def pixel_embeddings(images: Sequence[Image.Image], *, side: int, grayscale: bool) -> np.ndarray:
    """Raw pixels as embeddings: ``(n, side*side[*3])`` float32, L2-normalised rows."""
    mode = "L" if grayscale else "RGB"
    rows = np.stack([
        np.asarray(im.convert(mode).resize((side, side)), dtype=np.float32).reshape(-1)
        for im in images
    ])
    rows /= np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
    return rows


def _embedded(
    source: ImageSource, parts: list[np.ndarray], kept: list[np.ndarray], dim: int
) -> EmbeddedSet:
    index = np.concatenate(kept) if kept else np.zeros(0, np.int64)
    embeddings = np.concatenate(parts) if parts else np.zeros((0, dim), np.float32)
    cameras = source.cameras[index] if source.cameras is not None else None
    return EmbeddedSet(embeddings.astype(np.float32, copy=False), source.labels[index], cameras)


def concatenate(sets: Sequence[EmbeddedSet]) -> EmbeddedSet:
    """Several models' embeddings of the same images side by side: each row L2-normalised
    per model, concatenated, and scaled by ``1 / sqrt(k)`` so rows stay unit vectors. The
    inner product of two rows is then the mean of the models' cosine similarities (the
    scaling changes no ranking): the Reality Check's "concatenated" evaluation.

    Raises:
        ValueError: the sets do not hold the same images (labels differ).
    """
    first = sets[0]
    for other in sets[1:]:
        if not np.array_equal(other.labels, first.labels):
            raise ValueError("the embedded sets hold different images; cannot concatenate")
    parts = [s.embeddings / np.maximum(np.linalg.norm(s.embeddings, axis=1, keepdims=True),
                                       1e-12) for s in sets]
    joined = np.concatenate(parts, axis=1) / np.sqrt(len(sets))
    return EmbeddedSet(joined.astype(np.float32), first.labels, first.cameras)


def score_split(
    queries: EmbeddedSet, gallery: EmbeddedSet | None = None, *,
    k: tuple[int, ...] = (1, 5, 10), device: str = "cpu", per_query: bool = False,
) -> dict[str, Any]:
    """Retrieval metrics of one split by ``imgret.metrics.retrieval_metrics``.

    Args:
        queries: the query vectors.
        gallery: the gallery; ``None`` = the queries themselves (``query_in_gallery``).
        k: cut-offs of the ``*_at_k`` metrics (those beyond the gallery size are left out).
        device: where the exact search runs (``cpu`` or ``cuda``).
        per_query: add ``per_query`` (each query's values, see ``retrieval_metrics``).

    Returns:
        The metrics dict (``map_at_r``, ``r_precision``, ``precision_at_1``, ..., ``ci95``),
        made JSON-ready (NumPy scalars to floats, keys to strings).
    """
    same = gallery is None
    gallery = queries if gallery is None else gallery
    cameras = queries.cameras is not None and gallery.cameras is not None
    # A tiny split (tests, a small validation set) has fewer items than the largest k.
    limit = len(gallery.labels) - int(same)
    ks = tuple(x for x in k if x <= limit) or (1,)
    metrics = retrieval_metrics(
        queries.embeddings, queries.labels.astype(str), gallery.embeddings,
        gallery.labels.astype(str), k=ks, query_in_gallery=same, device=device,
        query_cameras=queries.cameras if cameras else None,
        gallery_cameras=gallery.cameras if cameras else None, per_query=per_query,
    )
    return to_jsonable(metrics)


def to_jsonable(value: Any) -> Any:
    """NumPy scalars/arrays and tuples to plain Python, dict keys to str (for JSON and
    for ``torch.load(weights_only=True)``)."""
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return to_jsonable(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    return value


def format_metric(metrics: dict[str, Any], name: str = "map_at_r") -> str:
    """``0.512 [0.498, 0.527]``: a metric with its 95% interval when there is one."""
    value = metrics.get(name)
    if value is None:
        return "n/a"
    ci = (metrics.get("ci95") or {}).get(name)
    return f"{value:.4f} [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else f"{value:.4f}"


# ----------------------------------------------------------------------------- verdict

# The baselines a run is judged against, as its verdict lines name them.
BASELINE_NAMES = {"raw_pixels": "raw pixels", "untrained": "the untrained network"}
# Metrics the verdict pairs per query (R-Precision has no per-query value in the report);
# MAP@R, the selection metric, is the one printed.
VERDICT_METRICS = {"map_at_r": "MAP@R", "precision_at_1": "P@1"}
VERDICT_BOOTSTRAP = 1000
VERDICT_SEED = 0
# Below either size a class-disjoint test split is too small to stand for unseen classes in
# general (docs/training.md, "Does the model beat its baselines?").
MIN_TEST_CLASSES = 10
MIN_TEST_IMAGES = 50


def baseline_verdicts(
    test: dict[str, Any], baselines: dict[str, dict[str, Any]], *,
    resamples: int = VERDICT_BOOTSTRAP, seed: int = VERDICT_SEED,
) -> dict[str, dict[str, Any]]:
    """Trained minus each baseline on the same test queries: per metric of
    :data:`VERDICT_METRICS`, the difference, its paired bootstrap 95% interval and the verdict
    (``imgret.stats.paired_comparison``; ``a`` is the baseline, ``b`` the trained model).

    Every metrics dict must carry ``per_query`` (``score_split(..., per_query=True)``); queries
    are paired by index (the same test images, embedded by each model).

    Returns:
        ``{baseline: {metric: {"a", "b", "difference", "ci95", "num_paired", "min_effect",
        "verdict"}}}``.
    """
    trained = per_query_table(test["per_query"])
    out = {}
    for name, metrics in baselines.items():
        base = per_query_table(metrics["per_query"])
        common = sorted(set(trained) & set(base))
        a = np.array([[base[q][m] for m in VERDICT_METRICS] for q in common], dtype=float)
        b = np.array([[trained[q][m] for m in VERDICT_METRICS] for q in common], dtype=float)
        rows = paired_comparison(a, b, resamples, seed)
        out[name] = dict(zip(VERDICT_METRICS, rows, strict=True))
    return out


def small_split_warning(summary: dict[str, Any]) -> str | None:
    """The one-line warning for a class-disjoint test split too small to mean much about
    unseen classes (fewer than :data:`MIN_TEST_CLASSES` classes or :data:`MIN_TEST_IMAGES`
    images), else ``None``."""
    if summary["protocol"] != "class-disjoint":
        return None
    test = summary["splits"]["test"]
    if test["num_classes"] >= MIN_TEST_CLASSES and test["num_images"] >= MIN_TEST_IMAGES:
        return None
    return (f"warning: the test split holds {test['num_classes']} unseen classes "
            f"({test['num_images']} images): the class-disjoint result is not meaningful at "
            f"this size (it needs >= {MIN_TEST_CLASSES} classes and >= {MIN_TEST_IMAGES} "
            "images); --protocol closed-set measures retrieval of the trained classes")


def verdict_lines(verdict: dict[str, Any], metric: str = "map_at_r") -> list[str]:
    """One line per baseline of a run's ``verdict`` record (:func:`baseline_verdicts` under
    ``"baselines"``), e.g. ``verdict: trained beats raw pixels on MAP@R by +0.2100 [0.1900,
    0.2300] (paired 95% interval)``."""
    lines = []
    for name, comparisons in verdict["baselines"].items():
        c = comparisons[metric]
        label = BASELINE_NAMES.get(name, name)
        numbers = f"{c['difference']:+.4f} [{c['ci95'][0]:.4f}, {c['ci95'][1]:.4f}]"
        what = VERDICT_METRICS[metric]
        if c["verdict"] == BETTER:
            text = f"trained beats {label} on {what} by {numbers}"
        elif c["verdict"] == WORSE:
            text = f"trained is worse than {label} on {what} by {numbers}"
        else:
            text = f"trained vs {label} on {what}: {c['verdict']}, {numbers}"
        lines.append(f"verdict: {text} (paired 95% interval)")
    return lines
