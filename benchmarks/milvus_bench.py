"""Milvus (milvus-lite, embedded) against FAISS Flat and FAISS IVF at gallery scale.

The same ``--n`` L2-normalised 128-d vectors (clustered like an embedded gallery:
``index_bench.clustered``) and 1,000 held-out queries go into each engine; reported per
engine, from one run:

- ingest: vectors per second into an empty index (FAISS: train + add through imgret's factory
  path; Milvus: ``upsert`` in the rows imgret's Milvus backend writes, then the index build
  and load it needs before a search);
- queries per second at batch 1 and batch 32 (k = 10);
- recall@10 against exact search (NumPy brute force over the same vectors);
- memory: the stage process's peak resident set (``VmHWM``) minus its size with the libraries
  and the vectors loaded.

Each engine runs in its own process (a clean peak RSS), one after the other; finished stages
are kept in ``--out``/results.json, so an interrupted run resumes where it stopped.

Usage::

    python benchmarks/milvus_bench.py                  # 1M vectors (about 15 minutes here)
    python benchmarks/milvus_bench.py --n 100000 --out runs/milvus-bench-100k
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from index_bench import DIM, clustered, numpy_topk, recall_at_k  # noqa: E402

K = 10
QUERIES = 1_000
SINGLE = 200
STAGES = ("faiss-flat", "faiss-ivf", "milvus-flat", "milvus-ivf")
IVF_LISTS = 1_024
IVF_PROBE = 32


def _status_mb(field: str) -> float:
    """A ``/proc/self/status`` figure in MB: ``VmRSS`` (now) or ``VmHWM`` (the peak; not
    getrusage's ru_maxrss, which Linux keeps across exec, so a stage would inherit the peak
    of the process that started it)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def prepare(out: Path, n: int) -> None:
    """Vectors, queries and the exact top 10 (NumPy), written once."""
    if (out / "exact.npy").is_file():
        return
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(max(n // 100, 1), DIM)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    base = clustered(n, dim=DIM, centres=centres, seed=1)
    queries = clustered(QUERIES, dim=DIM, centres=centres, seed=2)
    np.save(out / "base.npy", base)
    np.save(out / "queries.npy", queries)
    np.save(out / "exact.npy", numpy_topk(queries, base, K))


def _rates(search, queries: np.ndarray) -> tuple[float, float]:
    """Queries per second one at a time (``SINGLE`` of them) and in batches of 32."""
    search(queries[:32])  # warm up
    start = time.perf_counter()
    for i in range(SINGLE):
        search(queries[i:i + 1])
    single = SINGLE / (time.perf_counter() - start)
    start = time.perf_counter()
    for at in range(0, len(queries) - 31, 32):
        search(queries[at:at + 32])
    batch = (len(queries) // 32 * 32) / (time.perf_counter() - start)
    return single, batch


def run_stage(stage: str, out: Path) -> dict:
    # Libraries first: the memory figure is what the index adds to a process that holds them
    # and the vectors.
    import faiss
    from index_bench import build
    from pymilvus import MilvusClient

    from imgret.gallery.search.milvus_index import collection_schema, upsert_pages
    from imgret.gallery.storage.vector_store import ItemInfo, VectorPage

    base = np.load(out / "base.npy")
    queries = np.load(out / "queries.npy")
    exact = np.load(out / "exact.npy")
    ids = np.arange(len(base), dtype=np.int64)
    loaded = _status_mb("VmRSS")
    if stage.startswith("faiss"):
        factory = "Flat" if stage == "faiss-flat" else f"IVF{IVF_LISTS},Flat"
        index, seconds = build(factory, base)
        if stage == "faiss-ivf":
            faiss.extract_index_ivf(index).nprobe = IVF_PROBE

        def search(q: np.ndarray) -> np.ndarray:
            return index.search(q, K)[1]
    else:
        client = MilvusClient(str(out / f"{stage}.db"))
        name = "bench"
        if client.has_collection(name):
            client.drop_collection(name)
        params = client.prepare_index_params()
        if stage == "milvus-flat":
            params.add_index("vec", index_type="FLAT", metric_type="IP")
            search_params: dict = {"metric_type": "IP"}
        else:
            params.add_index("vec", index_type="IVF_FLAT", metric_type="IP",
                             params={"nlist": IVF_LISTS})
            search_params = {"metric_type": "IP", "params": {"nprobe": IVF_PROBE}}
        client.create_collection(name, schema=collection_schema(client, DIM), index_params=params,
                                 consistency_level="Strong")
        info = ItemInfo("x", 1, {"n": 0})
        start = time.perf_counter()
        for at in range(0, len(base), 100_000):  # imgret's upsert path, a page at a time
            page = slice(at, at + 100_000)
            upsert_pages(client, name, [VectorPage(ids[page], base[page],
                                                   [info] * len(ids[page]))])
            # progress on stderr; stdout carries the result
            print(f"  {stage}: {min(at + 100_000, len(base)):,} / {len(base):,} upserted",
                  file=sys.stderr, flush=True)
        client.flush(name)
        client.load_collection(name)
        seconds = time.perf_counter() - start

        def search(q: np.ndarray) -> np.ndarray:
            answer = client.search(name, data=[row.tolist() for row in q], limit=K,
                                   search_params=search_params)
            return np.array([[hit["id"] for hit in row] for row in answer])
    found = np.concatenate([search(queries[at:at + 100]) for at in range(0, QUERIES, 100)])
    single, batch = _rates(search, queries)
    return {"ingest_per_s": len(base) / seconds, "ingest_s": seconds, "qps_1": single,
            "qps_32": batch, "recall_at_10": recall_at_k(found, exact),
            "memory_mb": _status_mb("VmHWM") - loaded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--out", type=Path, default=Path("runs/milvus-bench"))
    parser.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage:
        print(json.dumps(run_stage(args.stage, args.out)))
        return
    results_path = args.out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    if results.get("n") != args.n:
        results = {"n": args.n}
    started = time.perf_counter()
    prepare(args.out, args.n)
    todo = [s for s in STAGES if s not in results]
    for done, stage in enumerate(todo):
        elapsed = time.perf_counter() - started
        eta = f", ETA {elapsed / done * (len(todo) - done):.0f} s" if done else ""
        print(f"[{done + 1}/{len(todo)}] {stage} ({elapsed:.0f} s so far{eta})", flush=True)
        answer = subprocess.run([sys.executable, __file__, "--stage", stage, "--n",
                                 str(args.n), "--out", str(args.out)],
                                stdout=subprocess.PIPE, text=True, check=False)
        if answer.returncode != 0:
            sys.exit(f"{stage} failed (its error is above):\n{answer.stdout[-2000:]}")
        results[stage] = json.loads(answer.stdout.strip().splitlines()[-1])
        results_path.write_text(json.dumps(results, indent=2))
    flat = results["faiss-flat"]
    print(f"\n{args.n:,} vectors x {DIM}-d, k = {K}, {QUERIES} queries; {os.cpu_count()} "
          f"cores, {platform.processor() or platform.machine()}; ratios to FAISS Flat")
    print(f"{'engine':<12} {'ingest/s':>10} {'q/s @1':>9} {'q/s @32':>9} {'recall@10':>9} "
          f"{'memory MB':>9}   ratios: ingest, q/s @1, q/s @32, memory")
    for stage in STAGES:
        r = results[stage]
        print(f"{stage:<12} {r['ingest_per_s']:>10,.0f} {r['qps_1']:>9,.1f} "
              f"{r['qps_32']:>9,.1f} {r['recall_at_10']:>9.4f} {r['memory_mb']:>9,.0f}   "
              f"{r['ingest_per_s'] / flat['ingest_per_s']:.3f}, "
              f"{r['qps_1'] / flat['qps_1']:.2f}, {r['qps_32'] / flat['qps_32']:.2f}, "
              f"{r['memory_mb'] / max(flat['memory_mb'], 1):.2f}")


if __name__ == "__main__":
    main()
