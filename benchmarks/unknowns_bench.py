"""How well does the unknowns pool cluster people it has never seen, and how fast?

The glyph identities of ``benchmarks/openset_bench.py`` (one CJK character per identity,
16 images each: 8 font faces x 2 distortions), split by the same seeded order:

- the model: small_cnn trained on the first 200 identities (openset_bench's trainer), or
  ``--model DIR``;
- the threshold: what ``POST /models/{v}/calibrate`` would find at FPIR 0.01, from the 150
  enrolled identities' gallery (8 images each) against 375 never-enrolled identities (4
  images each, non-mated);
- the pool: ``--identities`` further identities (default 625, all 16 images: 10,000
  unknowns) that neither training nor the threshold saw, fed one by one in a seeded random
  order through :func:`imgret.gallery.storage.unknowns_store.keep_unknown` into a fresh SQLite
  database (the service's path, SQL included).

Against the ground truth: BCubed precision / recall / F (per image: the share of its
cluster that is its identity, the share of its identity in its cluster), pairwise precision
/ recall / F (scikit-learn's pair confusion), and the clusters proposed against the true
number. The same figures for scikit-learn's offline agglomerative clustering (average
linkage, cosine distance, cut at 1 - threshold: every pair of clusters compared, all
vectors at once) as the peer. Time: the pool's seconds per 10,000 unknowns, with progress.

Run: ``python benchmarks/unknowns_bench.py [--work DIR] [--identities 625] [--model DIR]
[--json PATH]`` (``--work`` shares openset_bench's rendered folders and model).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.openset_bench import (  # noqa: E402
    PER_CLASS,
    SMALL_CNN_SECONDS,
    build_folders,
    split_sizes,
    train_model,
)
from imgret.embedder import Embedder  # noqa: E402
from imgret.gallery.storage import unknowns_store  # noqa: E402
from imgret.gallery.storage.db import make_engine, make_sessionmaker, upgrade_to_head  # noqa: E402
from imgret.gallery.storage.tables import ModelVersion  # noqa: E402
from imgret.metrics.openset import threshold_at_rate  # noqa: E402
from imgret.training.config import GlyphOptions  # noqa: E402
from imgret.training.data.glyphs import load_glyphs  # noqa: E402

FPIR = 0.01
CALIBRATION_UNKNOWNS = 375


def bcubed(truth: np.ndarray, found: np.ndarray) -> dict[str, float]:
    """BCubed precision, recall and F of a clustering ``found`` against labels ``truth``."""
    _, t = np.unique(truth, return_inverse=True)
    _, f = np.unique(found, return_inverse=True)
    both = np.zeros((t.max() + 1, f.max() + 1), dtype=np.int64)
    np.add.at(both, (t, f), 1)
    same = both[t, f].astype(float)
    precision = float(np.mean(same / np.bincount(f)[f]))
    recall = float(np.mean(same / np.bincount(t)[t]))
    return {"precision": precision, "recall": recall,
            "f": 2 * precision * recall / (precision + recall)}


def pairwise(truth: np.ndarray, found: np.ndarray) -> dict[str, float]:
    from sklearn.metrics.cluster import pair_confusion_matrix

    (_, fp), (fn, tp) = pair_confusion_matrix(truth, found)
    if tp == 0:  # no pair put together (or none right): precision is undefined, F is 0
        return {"precision": None if tp + fp == 0 else 0.0, "recall": 0.0, "f": 0.0}
    precision, recall = tp / (tp + fp), tp / (tp + fn)
    return {"precision": float(precision), "recall": float(recall),
            "f": float(2 * precision * recall / (precision + recall))}


def embed(embedder: Embedder, pixels: list[np.ndarray], batch: int = 256) -> np.ndarray:
    out = []
    for start in range(0, len(pixels), batch):
        out.append(embedder.embed([Image.fromarray(p).convert("RGB")
                                   for p in pixels[start:start + batch]]))
    return np.concatenate(out).astype(np.float32)


def scores_figures(truth: np.ndarray, found: np.ndarray) -> dict:
    return {"bcubed": bcubed(truth, found), "pairwise": pairwise(truth, found),
            "clusters": int(len(np.unique(found))),
            "singletons": int((np.bincount(np.unique(found, return_inverse=True)[1]) == 1).sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--identities", type=int, default=625)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="unknowns_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print("[1/5] rendering", flush=True)
    folders = build_folders(work, unknowns=500)
    sizes = split_sizes(500, "imagefolder")
    glyphs = load_glyphs(GlyphOptions(classes=sum(sizes.values()), per_class=PER_CLASS, seed=0))
    order = np.random.default_rng(0).permutation(len(glyphs.codepoints))
    enrolled = order[sizes["train"]:sizes["train"] + sizes["enrolled"]]
    start = sizes["train"] + sizes["enrolled"]
    calibration = order[start:start + CALIBRATION_UNKNOWNS]
    pool = order[start + CALIBRATION_UNKNOWNS:start + CALIBRATION_UNKNOWNS + args.identities]
    if len(pool) < args.identities:
        raise SystemExit(f"only {len(pool)} identities are left for the pool")
    print(f"[2/5] model ({time.perf_counter() - started:.0f} s)", flush=True)
    model = args.model or train_model(folders["train"], work / "trained", SMALL_CNN_SECONDS)
    embedder = Embedder.from_checkpoint(model, device="cpu")

    def images(classes: np.ndarray, which: list[int]) -> tuple[list[np.ndarray], np.ndarray]:
        pixels = [glyphs.pixels[c * PER_CLASS + n] for c in classes.tolist() for n in which]
        return pixels, np.repeat(classes, len(which))

    print(f"[3/5] threshold at FPIR {FPIR} ({time.perf_counter() - started:.0f} s)", flush=True)
    gallery, _ = images(enrolled, list(range(8)))
    strangers, _ = images(calibration, [8, 10, 12, 14])
    top = (embed(embedder, strangers) @ embed(embedder, gallery).T).max(axis=1)
    threshold = threshold_at_rate(top, FPIR)
    print(f"      threshold {threshold:.4f} ({len(strangers)} non-mated searches)", flush=True)

    print(f"[4/5] the pool: {len(pool)} identities x {PER_CLASS} images "
          f"({time.perf_counter() - started:.0f} s)", flush=True)
    pixels, truth = images(pool, list(range(PER_CLASS)))
    vectors = embed(embedder, pixels)
    arrival = np.random.default_rng(args.seed).permutation(len(vectors))
    db = work / f"unknowns-{time.time_ns()}.db"
    url = f"sqlite:///{db}"
    upgrade_to_head(url)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    with sessions.begin() as session:
        version = ModelVersion(version="bench", dim=vectors.shape[1], config={})
        session.add(version)
        session.flush()
        version_id = version.id
    found = np.zeros(len(vectors), dtype=np.int64)
    fed = time.perf_counter()
    for n, row in enumerate(arrival.tolist(), 1):
        with sessions.begin() as session:
            kept = unknowns_store.keep_unknown(
                session=session, sha256=f"{row:064x}", media_path="-",
                content_type="image/png", vector=vectors[row],
                model_version=session.get(ModelVersion, version_id), threshold=threshold,
                score=None)
        found[row] = kept.cluster_id
        if n % 1000 == 0 or n == len(arrival):
            spent = time.perf_counter() - fed
            print(f"      {n}/{len(arrival)} kept, {spent:.0f} s, ETA "
                  f"{spent / n * (len(arrival) - n):.0f} s", flush=True)
    pool_seconds = time.perf_counter() - fed
    engine.dispose()
    db.unlink()

    print(f"[5/5] the peer: offline agglomerative ({time.perf_counter() - started:.0f} s)",
          flush=True)
    from sklearn.cluster import AgglomerativeClustering

    peer_started = time.perf_counter()
    peer = AgglomerativeClustering(n_clusters=None, metric="cosine", linkage="average",
                                   distance_threshold=1 - threshold).fit_predict(vectors)
    peer_seconds = time.perf_counter() - peer_started
    result = {
        "setup": {"identities": len(pool), "unknowns": len(vectors), "threshold": threshold,
                  "fpir": FPIR, "model": str(model), "arrival_seed": args.seed},
        "pool": {**scores_figures(truth, found), "seconds": pool_seconds,
                 "seconds_per_10000": pool_seconds * 10_000 / len(vectors)},
        "agglomerative": {**scores_figures(truth, peer), "seconds": peer_seconds},
        "one_cluster_per_image": scores_figures(truth, np.arange(len(vectors))),
    }
    print(f"\n{len(vectors)} unknowns of {len(pool)} identities; threshold {threshold:.4f}\n")
    print("| clustering | BCubed P | BCubed R | BCubed F | pairwise P | pairwise R | "
          "pairwise F | clusters (true " + str(len(pool)) + ") | singletons | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in ("pool", "agglomerative", "one_cluster_per_image"):
        row = result[name]
        b, p = row["bcubed"], row["pairwise"]
        pp = "-" if p["precision"] is None else f"{p['precision']:.3f}"
        print(f"| {name} | {b['precision']:.3f} | {b['recall']:.3f} | {b['f']:.3f} | "
              f"{pp} | {p['recall']:.3f} | {p['f']:.3f} | {row['clusters']} | "
              f"{row['singletons']} | {row.get('seconds', 0):.1f} |")
    print(f"\npool: {result['pool']['seconds_per_10000']:.1f} s per 10,000 unknowns")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
