"""Index benchmark: exact FAISS vs NumPy brute force, and IVF / HNSW recall, speed, build time.

Vectors: ``n`` L2-normalised 128-d float32 vectors drawn around ``n / 100`` cluster centres
(100 images per class, like an embedded gallery), and 1,000 queries from the same clusters
that are not in the gallery. Indexes are made by imgret's own code
(``imgret.gallery.search.faiss_index``: factory check, IDMap2 / native ids, training sample, default
``nprobe``/``efSearch``), so the numbers are those of the service's index, not of a hand-tuned
FAISS.

Reported per gallery size:
- build time (training + adding), for FAISS indexes;
- QPS for a batch of 1,000 queries and for one query at a time (k = 10);
- recall@10 against exact search (the fraction of the exact top 10 that the index returns).

Then, per gallery size up to ``--searcher-max``, the Searcher as the service uses it (CPU, over
the exact ``Flat`` index, hits as :class:`Hit` lists) against its floor, NumPy brute force
(``numpy_topk``: one matrix product and ``argpartition`` per block of queries), at each of
``--batches`` (default 1, 8, 32, 1,000 queries per call): QPS of each, measured in alternating
rounds in the same run, and the Searcher / NumPy ratio of the medians (≥ 1: the Searcher is at
least as fast as brute force).

Usage::

    python benchmarks/index_bench.py                       # 100k and 1M (HNSW32 at 1M
                                                           # builds for minutes on 2 cores)
    python benchmarks/index_bench.py --sizes 20000 --single 50
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import platform
import time
from collections.abc import Callable

import faiss
import numpy as np

from imgret.gallery.search import Searcher
from imgret.gallery.search.faiss_index import (
    check_factory,
    create_index,
    set_search_defaults,
    train_index,
    unwrap,
)
from imgret.gallery.storage.vector_store import ItemInfo

K = 10
DIM = 128


def clustered(n: int, *, dim: int, centres: np.ndarray, seed: int,
              spread: float = 1.0) -> np.ndarray:
    """``n`` unit vectors around unit ``centres``: centre + noise of norm about ``spread``.

    With ``spread=1`` a vector's cosine to its centre is about 0.7 and to another vector of
    its class about 0.5, while unrelated vectors are near 0: classes overlap at the margins,
    like the embeddings of a trained metric-learning model, not like separated points.
    """
    rng = np.random.default_rng(seed)
    out = np.empty((n, dim), dtype=np.float32)
    for start in range(0, n, 100_000):
        m = min(100_000, n - start)
        block = centres[rng.integers(0, len(centres), m)] + rng.normal(
            scale=spread / math.sqrt(dim), size=(m, dim)
        ).astype(np.float32)
        block /= np.linalg.norm(block, axis=1, keepdims=True)
        out[start : start + m] = block
    return out


def numpy_topk(queries: np.ndarray, base: np.ndarray, k: int, block: int = 100) -> np.ndarray:
    """Brute-force top-k ids by inner product (query blocks, never the full matrix)."""
    out = np.empty((len(queries), k), dtype=np.int64)
    for start in range(0, len(queries), block):
        scores = queries[start : start + block] @ base.T
        part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(scores, part, axis=1), axis=1)
        out[start : start + block] = np.take_along_axis(part, order, axis=1)
    return out


def qps(run: Callable[[np.ndarray], object], queries: np.ndarray, single: int) -> tuple:
    """QPS of one batch of all queries, of ``single`` queries one at a time, and of those
    again with FAISS limited to one OpenMP thread (NumPy's BLAS threads are unaffected)."""
    start = time.perf_counter()
    run(queries)
    batch = len(queries) / (time.perf_counter() - start)
    rates = []
    threads = faiss.omp_get_max_threads()
    for omp in (threads, 1):
        faiss.omp_set_num_threads(omp)
        start = time.perf_counter()
        for i in range(single):
            run(queries[i : i + 1])
        rates.append(single / (time.perf_counter() - start))
    faiss.omp_set_num_threads(threads)
    return batch, rates[0], rates[1]


def batch_qps(runs: dict[str, Callable[[np.ndarray], object]], queries: np.ndarray,
              batch: int, *, seconds: float, rounds: int) -> dict[str, float]:
    """Median QPS of each run at ``batch`` queries per call, over ``rounds`` rounds that
    alternate between the runs (so a noisy neighbour hits them alike); each round calls one
    run on successive batches of ``queries`` for about ``seconds``."""
    rates: dict[str, list[float]] = {name: [] for name in runs}
    starts = range(0, len(queries) - batch + 1, batch)
    for run in runs.values():  # warm up
        run(queries[:batch])
    for _ in range(rounds):
        for name, run in runs.items():
            done, calls = 0, 0
            start = time.perf_counter()
            while True:
                at = starts[calls % len(starts)]
                run(queries[at : at + batch])
                done, calls = done + batch, calls + 1
                elapsed = time.perf_counter() - start
                if elapsed >= seconds:
                    break
            rates[name].append(done / elapsed)
    return {name: float(np.median(r)) for name, r in rates.items()}


def recall_at_k(found: np.ndarray, exact: np.ndarray) -> float:
    return float(np.mean([len(set(f) & set(e)) / len(e) for f, e in zip(found, exact,
                                                                          strict=True)]))


def build(factory: str, base: np.ndarray) -> tuple[faiss.Index, float]:
    """Build with imgret's path: check, create, train on its sample size, add with ids."""
    start = time.perf_counter()
    info = check_factory(factory, base.shape[1])
    info.check_vector_count(len(base))
    index = create_index(info, base.shape[1])
    if info.needs_training:
        rng = np.random.default_rng(0)
        sample = base[np.sort(rng.choice(len(base), info.train_size(len(base)), replace=False))]
        train_index(index, sample, info)
    ids = np.arange(len(base), dtype=np.int64)
    for s in range(0, len(base), 100_000):
        index.add_with_ids(base[s : s + 100_000], ids[s : s + 100_000])
    set_search_defaults(index)
    return index, time.perf_counter() - start


def bench_size(n: int, args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    rng = np.random.default_rng(n)
    centres = rng.normal(size=(max(n // 100, 10), DIM)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    base = clustered(n, dim=DIM, centres=centres, seed=1, spread=args.spread)
    queries = clustered(args.queries, dim=DIM, centres=centres, seed=2, spread=args.spread)
    rows: list[dict] = []
    floor_rows: list[dict] = []

    exact_index, seconds = build("Flat", base)
    _, exact = exact_index.search(queries, K)
    batch, one, one1 = qps(lambda q, index=exact_index: index.search(q, K), queries, args.single)
    rows.append(dict(n=n, method="FAISS exact (Flat, IndexIDMap2)", build=seconds,
                     recall=1.0, batch=batch, single=one, single1=one1))

    numpy_ids = numpy_topk(queries, base, K)
    batch, one, one1 = qps(lambda q: numpy_topk(q, base, K), queries, args.single)
    rows.append(dict(n=n, method="NumPy brute force (matmul + argpartition)", build=None,
                     recall=recall_at_k(numpy_ids, exact), batch=batch, single=one, single1=one1))

    if n <= args.searcher_max:  # the Python API's overhead does not grow with n
        searcher = Searcher(exact_index, model_version="bench", factory="Flat",
                            infos=dict.fromkeys(range(n), ItemInfo("")), use_gpu=False)
        batch, one, one1 = qps(lambda q, s=searcher: s.search(q, K), queries, args.single)
        rows.append(dict(n=n, method="imgret Searcher over Flat (Python API)", build=None,
                         recall=1.0, batch=batch, single=one, single1=one1))
        runs = {"searcher": lambda q, s=searcher: s.search(q, K),
                "numpy": lambda q: numpy_topk(q, base, K)}
        for size in (int(b) for b in args.batches.split(",")):
            rates = batch_qps(runs, queries, min(size, len(queries)),
                              seconds=args.batch_seconds, rounds=args.rounds)
            floor_rows.append(dict(n=n, batch=min(size, len(queries)), **rates))
            logging.info("%d: batch %d: %s", n, size, rates)
        del searcher
    del exact_index

    nlist = args.nlist or _nlist(n)
    for factory in (f"IVF{nlist},Flat", args.hnsw):
        index, seconds = build(factory, base)
        _, found = index.search(queries, K)
        batch, one, one1 = qps(lambda q, index=index: index.search(q, K), queries, args.single)
        core = unwrap(index)
        knob = (f"nprobe={core.nprobe}" if isinstance(core, faiss.IndexIVF)
                else f"efSearch={core.hnsw.efSearch}")
        rows.append(dict(n=n, method=f"FAISS {factory} ({knob})", build=seconds,
                         recall=recall_at_k(found, exact), batch=batch, single=one, single1=one1))
        del index
        logging.info("%d: %s done", n, factory)
    return rows, floor_rows


def _nlist(n: int) -> int:
    """A power of two near sqrt(n), at most n / 39 (the low end of FAISS's guidance, so that
    training on a 2-core machine stays in seconds)."""
    return 2 ** round(math.log2(min(math.sqrt(n), n / 39)))


def table(rows: list[dict]) -> str:
    lines = [
        "| vectors | method | build (s) | recall@10 | QPS, batch of 1,000 "
        "| QPS, one at a time | QPS, one at a time, 1 OpenMP thread |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        build = f"{r['build']:.1f}" if r["build"] is not None else "–"
        lines.append(
            f"| {r['n']:,} | {r['method']} | {build} | {r['recall']:.3f} | "
            f"{r['batch']:,.0f} | {r['single']:,.0f} | {r['single1']:,.0f} |"
        )
    return "\n".join(lines)


def floor_table(rows: list[dict]) -> str:
    lines = [
        "| vectors | batch | Searcher QPS | NumPy brute force QPS | Searcher / NumPy |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['n']:,} | {r['batch']:,} | {r['searcher']:,.0f} | "
                     f"{r['numpy']:,.0f} | {r['searcher'] / r['numpy']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100000,1000000",
                        help="comma-separated gallery sizes")
    parser.add_argument("--queries", type=int, default=1000, help="batch size for batch QPS")
    parser.add_argument("--single", type=int, default=50,
                        help="queries timed one at a time")
    parser.add_argument("--nlist", type=int, default=0, help="IVF lists (default ~sqrt(n))")
    parser.add_argument("--spread", type=float, default=1.0,
                        help="noise norm around the class centres (unit norm)")
    parser.add_argument("--hnsw", default="HNSW32", help="HNSW factory string")
    parser.add_argument("--searcher-max", type=int, default=100_000,
                        help="time the Searcher (Python API) rows up to this size")
    parser.add_argument("--batches", default="1,8,32,1000",
                        help="batch sizes of the Searcher-against-NumPy table")
    parser.add_argument("--batch-seconds", type=float, default=1.0,
                        help="seconds per round and method in that table")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating rounds in that table (the median is shown)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    rows, floor_rows = [], []
    for n in (int(s) for s in args.sizes.split(",")):
        size_rows, size_floor_rows = bench_size(n, args)
        rows.extend(size_rows)
        floor_rows.extend(size_floor_rows)
        logging.info("results so far:\n%s\n\n%s", table(rows),  # kept if a later size
                     floor_table(floor_rows))                   # is cut short
    cpus = os.cpu_count()
    load = os.getloadavg()[0]
    print(f"\nFAISS {faiss.__version__} on CPU ({cpus} cores, {faiss.omp_get_max_threads()} "
          f"OpenMP threads, load average {load:.1f} at the end), NumPy {np.__version__}, "
          f"{platform.machine()}; {DIM}-d unit vectors around n/100 class centres "
          f"(spread {args.spread}), k={K}, {args.queries} queries, {args.single} timed one at "
          f"a time\n")
    print(table(rows))
    if floor_rows:
        print(f"\nThe Searcher (CPU, Flat) against NumPy brute force by batch size (median of "
              f"{args.rounds} alternating rounds of {args.batch_seconds:g} s each):\n")
        print(floor_table(floor_rows))


if __name__ == "__main__":
    main()
