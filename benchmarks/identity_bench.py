"""Which identity score should a grouped search and ``/identify`` use? Measured, multi-shot.

The glyph identities of ``benchmarks/openset_bench.py`` (a CJK character per identity, one
font face per camera, never trained on): 150 enrolled identities with 8 gallery images each
(every face, distortion 0), mated queries of another distortion (8 per identity: "cal" and
"fresh" together), and 1,000 identities never enrolled (4 queries each) as the non-mated
searches. Market-1501's protocol: a query does not see its own identity's gallery image from
its own camera (face), so each identity shows 7 images to each of its queries.

For each aggregation of :mod:`imgret.gallery.search.identities` (``best``, ``mean_top2``,
``mean_top3``, ``template``), from the same embeddings:

- **CMC** rank-1 and rank-5 identification of the mated queries (the query's identity among
  the top r identities), with 95% bootstrap intervals that resample identities;
- **FNIR at FPIR 0.01** (``imgret.metrics.openset``: the threshold that lets 1% of the
  never-enrolled through, and the mated queries it turns away), with its interval;
- the paired difference against ``best`` (resampling identities), and per-item search's CMC
  (the query's identity among the top r *items*) beside grouped search's.

The model: small_cnn trained from scratch on 200 other identities for ``--train-seconds``
(openset_bench's trainer), or ``--model DIR`` for any checkpoint.

Run: ``python benchmarks/identity_bench.py [--work DIR] [--train-seconds 120] [--model DIR]
[--json PATH]`` (``--work`` keeps the rendered folders and the model between runs).
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
    FACES,
    SMALL_CNN_SECONDS,
    build_folders,
    clustered_ci,
    train_model,
)
from imgret.datasets import list_records  # noqa: E402
from imgret.embedder import Embedder  # noqa: E402
from imgret.gallery.search.identities import score_matrix_identities  # noqa: E402
from imgret.metrics.openset import (  # noqa: E402
    OpenSetSearches,
    open_set_report,
    paired_fnir_difference,
)

AGGREGATIONS = ("best", "mean_top2", "mean_top3", "template")
RANKS = (1, 5)
FPIR = 0.01
RESAMPLES = 1000  # as openset_bench.clustered_ci's


def embed(embedder: Embedder, paths: list[Path], batch: int = 256) -> np.ndarray:
    out = []
    for start in range(0, len(paths), batch):
        images = [Image.open(p).convert("RGB") for p in paths[start:start + batch]]
        out.append(embedder.embed(images))
    return np.concatenate(out).astype(np.float32)


def camera_of(path: Path) -> int:
    """The face of an ImageFolder glyph image (``NN.png``: image n shows face n % 8)."""
    return int(path.stem) % FACES


def identity_ranks(labels: np.ndarray, scores: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """1-based rank of each query's own identity (ties count against it); 0: not seen."""
    ranks = np.zeros(len(truth), np.int64)
    for i, label in enumerate(truth):
        where = np.flatnonzero(labels == label)
        if not len(where) or not np.isfinite(scores[i, where[0]]):
            continue
        ranks[i] = int((scores[i] >= scores[i, where[0]]).sum())
    return ranks


def item_ranks(scores: np.ndarray, gallery_labels: np.ndarray, valid: np.ndarray,
               truth: np.ndarray) -> np.ndarray:
    """1-based rank, among items, of the first item of the query's identity (per-item
    search)."""
    ranks = np.zeros(len(truth), np.int64)
    for i, label in enumerate(truth):
        row = np.where(valid[i], scores[i], -np.inf)
        mates = row[(gallery_labels == label) & valid[i]]
        if len(mates):
            ranks[i] = int((row >= mates.max()).sum())
    return ranks


def searches(labels: np.ndarray, scores: np.ndarray, truth: np.ndarray,
             mated: np.ndarray) -> OpenSetSearches:
    top = scores.max(axis=1)
    top_label = labels[scores.argmax(axis=1)]
    mate = np.full(len(truth), -np.inf)
    for i, label in enumerate(truth):
        where = np.flatnonzero(labels == label)
        if len(where):
            mate[i] = scores[i, where[0]]
    _, group = np.unique(truth, return_inverse=True)
    return OpenSetSearches(top, mate, (top_label == truth) & mated, mated, group)


def fnir(report: dict) -> tuple[float, list[float]]:
    point = report["operating_points"][0]
    return point["fnir"]["value"], point["fnir"]["ci95"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--train-seconds", type=float, default=SMALL_CNN_SECONDS)
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint directory "
                        "(default: small_cnn trained on the 200 training identities)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="identity_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print("[1/4] rendering the identities", flush=True)
    folders = build_folders(work, unknowns=500, layout="imagefolder")
    print(f"[2/4] model ({time.perf_counter() - started:.0f} s)", flush=True)
    model = args.model or train_model(folders["train"], work / "trained", args.train_seconds)
    embedder = Embedder.from_checkpoint(model, device="cpu")
    print(f"[3/4] embedding ({time.perf_counter() - started:.0f} s)", flush=True)
    gallery = list_records(folders["gallery"])
    queries = list_records(folders["cal"]) + list_records(folders["fresh"])
    g_vec = embed(embedder, [r.path for r in gallery])
    q_vec = embed(embedder, [r.path for r in queries])
    g_lab = np.array([r.label for r in gallery])
    q_lab = np.array([r.label for r in queries])
    g_cam = np.array([camera_of(r.path) for r in gallery])
    q_cam = np.array([camera_of(r.path) for r in queries])
    mated = np.isin(q_lab, g_lab)
    # Market-1501: a query does not see its own identity's image from its own camera.
    valid = ~((q_lab[:, None] == g_lab[None, :]) & (q_cam[:, None] == g_cam[None, :]))
    scores = q_vec @ g_vec.T
    print(f"[4/4] {len(queries)} queries ({int(mated.sum())} mated) x {len(gallery)} gallery "
          f"images of {len(set(g_lab))} identities ({time.perf_counter() - started:.0f} s)",
          flush=True)
    groups = q_lab[mated]
    rows, per_query = {}, {}
    per_item = item_ranks(scores, g_lab, valid, q_lab)[mated]
    rows["per-item search"] = {f"rank{r}": float((per_item >= 1).__and__(per_item <= r).mean())
                               for r in RANKS}
    for r in RANKS:
        rows["per-item search"][f"rank{r}_ci95"] = clustered_ci(
            (per_item >= 1) & (per_item <= r), groups)
    for name in AGGREGATIONS:
        labels, id_scores = score_matrix_identities(scores, g_lab, name, vectors=g_vec,
                                                    queries=q_vec, valid=valid)
        ranks = identity_ranks(labels, id_scores, q_lab)[mated]
        report = open_set_report(searches(labels, id_scores, q_lab, mated), fpirs=(FPIR,),
                                 resamples=RESAMPLES)
        value, interval = fnir(report)
        row = {"fnir_at_fpir": value, "fnir_ci95": interval,
               "mated": report["mated"], "non_mated": report["non_mated"]}
        for r in RANKS:
            hit = (ranks >= 1) & (ranks <= r)
            row[f"rank{r}"] = float(hit.mean())
            row[f"rank{r}_ci95"] = clustered_ci(hit, groups)
        per_query[name] = (ranks, report, searches(labels, id_scores, q_lab, mated))
        rows[name] = row
    best_ranks = per_query["best"][0]
    for name in AGGREGATIONS[1:]:
        diff = (per_query[name][0] == 1).astype(float) - (best_ranks == 1).astype(float)
        rows[name]["rank1_minus_best"] = float(diff.mean())
        rows[name]["rank1_minus_best_ci95"] = clustered_ci(diff, groups)
        paired = paired_fnir_difference(per_query["best"][2], per_query[name][2], FPIR,
                                        resamples=RESAMPLES)
        rows[name]["fnir_minus_best"] = paired["difference"]
        rows[name]["fnir_minus_best_ci95"] = paired["ci95"]
    result = {"setup": {"gallery_images": len(gallery), "identities": int(len(set(g_lab))),
                        "queries": len(queries), "mated": int(mated.sum()),
                        "fpir": FPIR, "model": str(model),
                        "seconds": round(time.perf_counter() - started, 1)},
              "rows": rows}
    print(f"\n| aggregation | rank-1 [95% CI] | rank-5 [95% CI] | FNIR @ FPIR {FPIR} [95% CI] "
          "| rank-1 - best [95% CI] | FNIR - best [95% CI] |")
    print("|---|---|---|---|---|---|")
    for name, row in rows.items():
        cells = [f"{row[f'rank{r}']:.3f} [{row[f'rank{r}_ci95'][0]:.3f}, "
                 f"{row[f'rank{r}_ci95'][1]:.3f}]" for r in RANKS]
        fn = (f"{row['fnir_at_fpir']:.3f} [{row['fnir_ci95'][0]:.3f}, {row['fnir_ci95'][1]:.3f}]"
              if "fnir_at_fpir" in row else "-")
        diff = (f"{row['rank1_minus_best']:+.3f} [{row['rank1_minus_best_ci95'][0]:+.3f}, "
                f"{row['rank1_minus_best_ci95'][1]:+.3f}]" if "rank1_minus_best" in row else "-")
        fdiff = (f"{row['fnir_minus_best']:+.3f} [{row['fnir_minus_best_ci95'][0]:+.3f}, "
                 f"{row['fnir_minus_best_ci95'][1]:+.3f}]" if "fnir_minus_best" in row else "-")
        print(f"| {name} | {' | '.join(cells)} | {fn} | {diff} | {fdiff} |")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
