"""Re-ranking against plain search: metric deltas, cost per query and the memory bound.

Two labelled sets, each embedded by a model trained the way its users would:

- **demo**: Fashion-MNIST as ``imgret demo`` builds it (closed-set protocol): the demo's model
  config (small_cnn, multi_similarity, 4 epochs on 12,000 train images), a gallery of the
  first 300 train images per class and 100 test images per class as queries;
- **re-ID**: a generated Market-1501-style folder (identities as two-colour outfits from a
  small palette with a pattern, so different people can dress alike; a colour cast, brightness
  and shift per camera; noise per image; distractors and junk), a model trained on its
  ``bounding_box_train`` identities, evaluated on ``bounding_box_test`` with one query per
  identity and camera pair in ``query``, under the Market-1501 rule (same-camera matches
  removed).

Each set is evaluated four times through the Searcher (exact ``Flat`` index,
``imgret.gallery.evaluation.retrieval.evaluate``): plain, k-reciprocal re-ranking (paper defaults k1
= 20, k2 = 6, lambda = 0.3 with N = 100 candidates, and with N = 400, above the demo's R = 300)
and average query expansion (top 5). Deltas are paired over the same queries
(``imgret.gallery.evaluation.comparison.compare_versions``: bootstrap 95% interval).
Cost: single-query searches (k = 10, as /search serves them), median and p90 ms, beside the
plain search of the same queries in the same run, and the peak Python/NumPy memory of one
re-ranked query (tracemalloc) beside the (Q + G)^2 float32 matrix a full-matrix
implementation (torchreid's ``re_ranking``) allocates for one query; then the same on
clustered 128-d galleries of 10k and 100k vectors, where only the cost and memory mean
anything.

Run: ``python benchmarks/rerank_bench.py``
(``--work DIR`` keeps the trained models and the generated folder between runs).

``--grid [SIZE]`` measures only the cost of one k-reciprocal query against its parameters
(candidates N, k1, k; and query expansion at its largest top_m) on a clustered synthetic
128-d gallery of SIZE vectors (default 100,000), median of 3 single-query searches each,
beside the plain search: the table the search budget of ``imgret.service.limits`` is derived from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from imgret.embedder import Embedder
from imgret.gallery.evaluation.comparison import compare_versions
from imgret.gallery.evaluation.retrieval import QueryBatch, evaluate
from imgret.gallery.search import Searcher
from imgret.gallery.search.faiss_index import check_factory, create_index
from imgret.gallery.search.rerank import KReciprocal, QueryExpansion
from imgret.gallery.storage.vector_store import ItemInfo

METHODS = {
    "plain": None,
    "k_reciprocal": KReciprocal(),
    "k_reciprocal N=400": KReciprocal(candidates=400),
    "query_expansion": QueryExpansion(),
}
TIMED_QUERIES = 200


@dataclass(frozen=True)
class LabelledSet:
    """Embedded gallery and queries of one protocol."""

    name: str
    gallery: np.ndarray
    gallery_labels: list[str]
    gallery_cameras: list[int | None]
    queries: np.ndarray
    query_labels: list[str]
    query_cameras: list[int | None] | None
    reid: bool
    note: str


# --------------------------------------------------------------------------- data


def demo_set(work: Path) -> LabelledSet:
    """Fashion-MNIST as the demo builds it, embedded by the demo's model config."""
    from imgret.datasets import FASHION_MNIST_CLASSES, load_fashion_mnist
    from imgret.training.config import FASHION_MNIST, LossConfig, TrainConfig
    from imgret.training.loop import train

    run = work / "demo-run"
    if not (run / "metrics.json").is_file():
        train(TrainConfig(
            data=FASHION_MNIST, protocol="closed-set", loss=LossConfig(name="multi_similarity"),
            backbone="small_cnn", dim=64, image_size=28, epochs=4, augmentation="none",
            max_train_images=12000, max_eval_images=2000,
        ), run, progress=False)
    embedder = Embedder.from_checkpoint(run, device="cpu")

    def take(split: str, per_class: int) -> tuple[np.ndarray, list[str]]:
        images, labels = load_fashion_mnist(split=split)
        rows = np.concatenate([(labels == c).nonzero()[0][:per_class] for c in range(10)])
        vectors = embedder.embed([Image.fromarray(images[i], mode="L").convert("RGB")
                                  for i in rows])
        return vectors, [FASHION_MNIST_CLASSES[int(labels[i])] for i in rows]

    gallery, g_labels = take("train", 300)
    queries, q_labels = take("test", 100)
    return LabelledSet("demo (Fashion-MNIST)", gallery, g_labels, [None] * len(g_labels),
                       queries, q_labels, None, False,
                       "closed-set retrieval, 1,000 test-split queries, 3,000 train-split "
                       "gallery images")


_PALETTE = np.array([[200, 30, 30], [30, 160, 40], [40, 60, 200], [220, 200, 40],
                     [20, 20, 20], [230, 230, 230], [130, 70, 30], [120, 120, 130]], float)


def _person(pid: int, camera: int, shot: int, size: int = 32) -> Image.Image:
    """A generated 'person': upper and lower colours and a pattern fixed per identity (from a
    palette small enough that people share outfits), a camera's colour cast, brightness and
    offset, and per-shot noise and jitter."""
    who = np.random.default_rng([7, pid])
    upper, lower = _PALETTE[who.integers(0, 8)], _PALETTE[who.integers(0, 8)]
    pattern, split = int(who.integers(0, 4)), int(who.integers(13, 19))
    cam = np.random.default_rng([11, camera])
    cast, light = cam.uniform(0.65, 1.35, 3), cam.uniform(-40, 40)
    shot_rng = np.random.default_rng([13, pid, camera, shot])
    y, x = np.mgrid[0:size, 0:size]
    dy, dx = shot_rng.integers(-3, 4, 2)
    yy, xx = y + dy, x + dx
    pixels = np.where((yy < split)[..., None], upper, lower)
    if pattern == 1:
        pixels = pixels + (((yy // 3) % 2) * 50.0)[..., None]
    elif pattern == 2:
        pixels = pixels + (((xx // 4) % 2) * 50.0)[..., None]
    elif pattern == 3:
        pixels = pixels + ((((xx + yy) // 4) % 2) * 50.0)[..., None]
    body = (np.abs(xx - size / 2) < size * 0.3)[..., None]
    background = cam.uniform(60, 200, 3)
    pixels = np.where(body, pixels, background) * cast + light
    pixels = pixels + shot_rng.normal(0, 22, pixels.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype("uint8"), "RGB")


def write_reid_folder(root: Path, *, identities: int = 300, cameras: int = 6) -> Path:
    """A Market-1501-style folder: the first half of the identities in bounding_box_train,
    the rest in bounding_box_test (3 to 5 cameras each, 1 to 3 shots per camera) with two
    queries each (another shot in two of its cameras), plus 100 distractors (0000) and 20
    junk images (-1) in the test gallery."""
    marker = root / ".complete"
    if marker.is_file():
        return root
    for split in ("bounding_box_train", "bounding_box_test", "query"):
        (root / split).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    frame = 0
    for pid in range(1, identities + 1):
        split = "bounding_box_train" if pid <= identities // 2 else "bounding_box_test"
        seen = rng.choice(np.arange(1, cameras + 1), int(rng.integers(3, 6)), replace=False)
        for camera in seen.tolist():
            for shot in range(int(rng.integers(1, 4))):
                frame += 1
                _person(pid, camera, shot).save(
                    root / split / f"{pid:04d}_c{camera}s1_{frame:06d}_00.jpg", quality=95)
        if split == "bounding_box_test":
            for camera in seen[:2].tolist():
                frame += 1
                _person(pid, camera, 99).save(
                    root / "query" / f"{pid:04d}_c{camera}s1_{frame:06d}_00.jpg", quality=95)
    for i in range(100):
        frame += 1
        _person(10_000 + i, 1 + i % cameras, 0).save(
            root / "bounding_box_test" / f"0000_c{1 + i % cameras}s1_{frame:06d}_00.jpg")
    for i in range(20):
        frame += 1
        _person(20_000 + i, 1 + i % cameras, 0).save(
            root / "bounding_box_test" / f"-1_c{1 + i % cameras}s1_{frame:06d}_00.jpg")
    marker.touch()
    return root


def reid_set(work: Path) -> LabelledSet:
    """The generated re-ID folder, embedded by a model trained on its train identities."""
    from imgret.datasets import list_records
    from imgret.images import load_image_file
    from imgret.training.config import LossConfig, TrainConfig
    from imgret.training.loop import train

    root = write_reid_folder(work / "reid")
    run = work / "reid-run"
    if not (run / "metrics.json").is_file():
        train(TrainConfig(
            data=str(root / "bounding_box_train"), protocol="closed-set",
            loss=LossConfig(name="multi_similarity"), backbone="small_cnn", dim=64,
            image_size=32, epochs=15, augmentation="none", batch_size=64,
        ), run, progress=False)
    embedder = Embedder.from_checkpoint(run, device="cpu")
    gallery = list_records(root / "bounding_box_test")  # junk (-1) skipped, as ingest does
    queries = list_records(root / "query")
    return LabelledSet(
        "re-ID (generated Market-1501-style)",
        embedder.embed([load_image_file(r.path) for r in gallery]),
        [r.label for r in gallery], [r.camera for r in gallery],
        embedder.embed([load_image_file(r.path) for r in queries]),
        [r.label for r in queries], [r.camera for r in queries], True,
        f"re-ID, Market-1501 rule, {len(queries)} queries, {len(gallery)} gallery images "
        "(150 test identities + 100 distractors)",
    )


# --------------------------------------------------------------------------- measurements


def searcher_of(vectors: np.ndarray, labels: list[str],
                cameras: list[int | None]) -> Searcher:
    """An exact in-memory Searcher over ``vectors`` (ids 1..n)."""
    index = create_index(check_factory("Flat", vectors.shape[1]), vectors.shape[1])
    ids = np.arange(1, len(vectors) + 1, dtype=np.int64)
    index.add_with_ids(vectors, ids)
    infos = {int(i): ItemInfo(label, camera) for i, label, camera in
             zip(ids.tolist(), labels, cameras, strict=True)}
    return Searcher(index, model_version="bench", factory="Flat", infos=infos, use_gpu=False)


def time_queries(searcher: Searcher, queries: np.ndarray, option) -> list[float]:
    """Milliseconds of each single-query search (k = 10)."""
    searcher.search(queries[:5], 10, rerank=option)  # warm-up
    out = []
    for query in queries:
        start = time.perf_counter()
        searcher.search(query[None, :], 10, rerank=option)
        out.append((time.perf_counter() - start) * 1000)
    return out


def peak_bytes(searcher: Searcher, query: np.ndarray, option) -> int:
    """Peak Python/NumPy allocation of one search (FAISS's own buffers are not traced)."""
    tracemalloc.start()
    try:
        searcher.search(query[None, :], 10, rerank=option)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def full_matrix_bytes(queries: int, gallery: int) -> int:
    """torchreid's ``re_ranking``: original_dist, V and initial_rank are (Q+G)^2 each."""
    return 3 * 4 * (queries + gallery) ** 2


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def measure_set(data: LabelledSet) -> tuple[list[str], list[str], dict]:
    searcher = searcher_of(data.gallery, data.gallery_labels, data.gallery_cameras)
    batch = QueryBatch(data.queries, data.query_labels, data.query_cameras)
    results, seconds = {}, {}
    for name, option in METHODS.items():
        start = time.perf_counter()
        results[name] = evaluate(searcher, batch, k=(1, 5, 10), exclude_same_camera=data.reid,
                                 rerank=option)
        seconds[name] = time.perf_counter() - start
    metric_rows = []
    plain = results["plain"].report
    raw: dict = {"set": data.name, "note": data.note, "methods": {},
                 "depth": plain["depth"], "num_truncated": plain["num_truncated"]}
    for name in METHODS:
        report = results[name].report
        row = (f"| {data.name} | {name} | {report['mean_average_precision']:.4f} | "
               f"{report['map_at_r']:.4f} | {report['recall_at_k'][1]:.4f} | "
               f"{report['recall_at_k'][5]:.4f} | {report['recall_at_k'][10]:.4f} |")
        entry = {m: report[m] for m in ("mean_average_precision", "map_at_r", "precision_at_1")}
        entry["recall_at_k"] = report["recall_at_k"]
        entry["evaluate_s"] = seconds[name]
        if name == "plain":
            row += " (floor) | | | |"
        else:
            diff = compare_versions(results["plain"], results[name])
            cells = []
            for metric in ("mean_average_precision", "map_at_r", "precision_at_1"):
                d = diff[metric]
                cells.append(f"{d['difference']:+.4f} [{d['ci95'][0]:+.4f}, "
                             f"{d['ci95'][1]:+.4f}]")
            row += " " + " | ".join(cells) + f" | {diff['verdict']['map_at_r']} |"
            entry["paired"] = {m: diff[m] for m in ("mean_average_precision", "map_at_r",
                                                     "precision_at_1")}
        metric_rows.append(row)
        raw["methods"][name] = entry

    timed = data.queries[:TIMED_QUERIES]
    cost_rows = []
    plain_ms = None
    for name, option in METHODS.items():
        ms = time_queries(searcher, timed, option)
        p50, p90 = statistics.median(ms), float(np.percentile(ms, 90))
        plain_ms = p50 if name == "plain" else plain_ms
        peak = peak_bytes(searcher, timed[0], option)
        cost_rows.append(
            f"| {data.name} | {len(data.gallery):,} | {name} | {p50:.2f} | {p90:.2f} | "
            f"{p50 / plain_ms:.1f}x | {fmt_bytes(peak)} | "
            f"{fmt_bytes(full_matrix_bytes(1, len(data.gallery)))} | "
            f"{seconds[name]:.1f} s |")
        raw["methods"][name].update(p50_ms=p50, p90_ms=p90, peak_bytes=peak)
    return metric_rows, cost_rows, raw


def measure_scale(sizes: list[int], dim: int = 128) -> list[str]:
    """Per-query cost and memory on clustered synthetic galleries (no labels needed)."""
    rows = []
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(200, dim))
    for size in sizes:
        points = centres[rng.integers(0, 200, size)] + 0.5 * rng.normal(size=(size, dim))
        points = (points / np.linalg.norm(points, axis=1, keepdims=True)).astype(np.float32)
        searcher = searcher_of(points, [""] * size, [None] * size)
        queries = points[rng.choice(size, 50, replace=False)] + 0.05 * rng.normal(size=(50, dim))
        queries = (queries / np.linalg.norm(queries, axis=1, keepdims=True)).astype(np.float32)
        plain_ms = None
        for name, option in METHODS.items():
            ms = time_queries(searcher, queries, option)
            p50, p90 = statistics.median(ms), float(np.percentile(ms, 90))
            plain_ms = p50 if name == "plain" else plain_ms
            rows.append(
                f"| synthetic {dim}-d | {size:,} | {name} | {p50:.2f} | {p90:.2f} | "
                f"{p50 / plain_ms:.1f}x | {fmt_bytes(peak_bytes(searcher, queries[0], option))}"
                f" | {fmt_bytes(full_matrix_bytes(1, size))} | |")
    return rows


def measure_grid(size: int, dim: int = 128, repeats: int = 3) -> None:
    """Print the median ms of one query per re-ranking parameter set (see the docstring)."""
    from imgret.service.pipeline import configure_threads

    configure_threads()  # the service's threads: BLAS on one
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(200, dim))
    points = centres[rng.integers(0, 200, size)] + 0.5 * rng.normal(size=(size, dim))
    points = (points / np.linalg.norm(points, axis=1, keepdims=True)).astype(np.float32)
    searcher = searcher_of(points, [""] * size, [None] * size)
    queries = points[rng.choice(size, repeats + 1, replace=False)]

    def median_ms(option, k: int) -> float:
        searcher.search(queries[:1], k, rerank=option)  # warm-up
        ms = []
        for row in range(1, repeats + 1):
            start = time.perf_counter()
            searcher.search(queries[row : row + 1], k, rerank=option)
            ms.append((time.perf_counter() - start) * 1000)
        return statistics.median(ms)

    print(f"One query on {size:,} synthetic {dim}-d vectors (exact Flat), median of {repeats}:")
    print()
    print("| search | N | k1 | k | ms | x plain (k = 10) |")
    print("|---|---:|---:|---:|---:|---:|")
    plain = median_ms(None, 10)
    print(f"| plain | | | 10 | {plain:.1f} | 1.0x |", flush=True)
    print(f"| plain | | | 1000 | {median_ms(None, 1000):.1f} | |", flush=True)
    for n in (50, 100, 200, 400, 1000):
        for k1 in (20, 50, 100):
            ms = median_ms(KReciprocal(candidates=n, k1=k1), 10)
            print(f"| k_reciprocal | {n} | {k1} | 10 | {ms:.1f} | {ms / plain:.0f}x |",
                  flush=True)
    for k in (100, 1000):
        ms = median_ms(KReciprocal(candidates=100), k)
        print(f"| k_reciprocal | 100 | 20 | {k} | {ms:.1f} | {ms / plain:.0f}x |", flush=True)
    for k in (10, 1000):
        ms = median_ms(QueryExpansion(top_m=100), k)
        print(f"| query_expansion top_m = 100 | | | {k} | {ms:.1f} | {ms / plain:.1f}x |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/imgret-rerank-bench"),
                        help="trained models and generated images (reused when present)")
    parser.add_argument("--sizes", default="10000,100000",
                        help="synthetic gallery sizes for the cost table ('' for none)")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    parser.add_argument("--grid", type=int, nargs="?", const=100_000, default=None,
                        metavar="SIZE", help="only the cost grid, on SIZE synthetic vectors")
    args = parser.parse_args()
    if args.grid is not None:
        measure_grid(args.grid)
        return
    args.work.mkdir(parents=True, exist_ok=True)

    sets = [demo_set(args.work), reid_set(args.work)]
    metric_rows, cost_rows, raw = [], [], []
    for data in sets:
        m, c, r = measure_set(data)
        metric_rows += m
        cost_rows += c
        raw.append(r)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    cost_rows += measure_scale(sizes)

    k_rec, qe = METHODS["k_reciprocal"], METHODS["query_expansion"]
    print(f"k_reciprocal: k1={k_rec.k1}, k2={k_rec.k2}, lambda={k_rec.lambda_value}, "
          f"N={k_rec.candidates} candidates; query_expansion: top_m={qe.top_m}, "
          f"alpha={qe.alpha}; exact Flat index; one run.")
    for data, r in zip(sets, raw, strict=True):
        print(f"- {data.name}: {data.note}; ranking depth {r['depth']} ({r['num_truncated']} "
              "queries with relevant items below it: their AP, hence mAP, is a lower bound)")
    print()
    print("| set | search | mAP | MAP@R | R@1 | R@5 | R@10 | ΔmAP [95% CI] | ΔMAP@R [95% CI] "
          "| ΔP@1 [95% CI] | MAP@R verdict |")
    print("|---|---|---:|---:|---:|---:|---:|---|---|---|---|")
    print("\n".join(metric_rows))
    print()
    print("Cost of one query (k = 10, single-query searches, 2-core CPU); memory: peak "
          "Python/NumPy allocation of one search (tracemalloc) beside the (Q+G)^2 float32 "
          "matrices (x3) of a full-matrix re-ranking for that one query:")
    print()
    print("| set | gallery | search | p50 ms | p90 ms | x plain | peak memory / query | "
          "full matrix (Q=1) | whole evaluation |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(cost_rows))
    if args.json is not None:
        args.json.write_text(json.dumps(raw, indent=2, default=str))


if __name__ == "__main__":
    main()
