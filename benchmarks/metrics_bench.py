"""Speed and agreement of ``imgret.metrics.retrieval_metrics``; prints markdown tables.

Protocol (synthetic, closed-set, leave-one-out): ``n`` L2-normalised embeddings drawn around
``classes`` random unit centres with Gaussian noise; every item is a query against all the
others (``query_in_gallery=True``, pytorch-metric-learning's ``ref_includes_query=True``).

Part 1, for each noise level (an easy and a hard data set by default):

* ``AccuracyCalculator(include=(MAP@R, R-precision, P@1), k="max_bin_count")`` (FAISS k-NN);
* ``retrieval_metrics`` without and with its default 1000-resample bootstrap; it computes
  every metric of the report, including mAP over the full ranking, exactly;
* the bare query x gallery product: one ``torch.mm`` of the full matrix (allocating it, as
  asked), and the same product in chunks into a reused buffer (the GEMM work any chunked
  method has to do, without the page faults of a fresh n x n allocation);
* ``exact_ranks`` alone, its seconds split into the product (into a fresh chunk buffer) and
  the rank counting, so that the product sits beside its floor and the rest is named;
* the largest absolute difference between the two implementations' three shared numbers.

Times are the minimum over ``--repeats`` runs, ours and the chunked product alternating (the
machine may be shared; the load average is printed). Part 2 runs one large evaluation
(default 50,000 queries x 1,000,000 gallery) in a child process and reports its time, the
chunked product over the same data at the same chunk (its floor) and peak memory (peak RSS
above the RSS after the data
was generated, from /proc/self/status VmHWM after resetting it; ru_maxrss as a fallback).

Usage: ``python benchmarks/metrics_bench.py [--n 20000] [--noise 1.5,2.0] [--large-queries
50000] [--large-gallery 1000000] [--skip-large]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

import numba
import numpy as np
import torch

from imgret.metrics import retrieval_metrics
from imgret.metrics.ranks import CHUNK_BYTES, default_chunk_size, exact_ranks
from imgret.metrics.relevance import RelevancePlan


def clustered(n: int, d: int, classes: int, noise: float, seed: int, centres=None):
    """(n, d) float32 unit vectors around ``classes`` unit centres, and their labels."""
    rng = np.random.default_rng(seed)
    if centres is None:
        centres = rng.standard_normal((classes, d), dtype=np.float32)
        centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    labels = rng.integers(0, classes, n)
    x = np.empty((n, d), np.float32)
    step = 100_000  # bounded temporaries for the million-item gallery
    for i in range(0, n, step):
        lab = labels[i : i + step]
        y = centres[lab] + noise * rng.standard_normal((len(lab), d), dtype=np.float32) / np.sqrt(d)
        y /= np.linalg.norm(y, axis=1, keepdims=True)
        x[i : i + step] = y
    return x, labels, centres


def best_time(fn, repeats: int):
    out, times = None, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def part1(args) -> list[dict]:
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

    calc = AccuracyCalculator(
        include=("mean_average_precision_at_r", "r_precision", "precision_at_1"),
        k="max_bin_count",
        device=torch.device("cpu"),
    )
    rows = []
    for noise in args.noise:
        x, y, _ = clustered(args.n, args.dim, args.classes, noise, seed=0)
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)

        def pml(xt=xt, yt=yt):
            return calc.get_accuracy(xt, yt, xt, yt, ref_includes_query=True)

        def ours(x=x, y=y, bootstrap=0):
            return retrieval_metrics(x, y, x, y, query_in_gallery=True, bootstrap=bootstrap)

        def full_mm(xt=xt):
            return torch.mm(xt, xt.T).shape

        chunk = default_chunk_size(args.n, args.n)
        buf = torch.empty(chunk, args.n)

        def chunked_mm(xt=xt, buf=buf, chunk=chunk):
            for i in range(0, len(xt), chunk):
                part = xt[i : i + chunk]
                torch.mm(part, xt.T, out=buf[: len(part)])

        plan = RelevancePlan(y, y, None, None, args.n, args.n, True)
        evaluated = np.flatnonzero(plan.num_relevant > 0)

        def parts(xt=xt, plan=plan, evaluated=evaluated, chunk=chunk):
            """exact_ranks alone (retrieval_metrics' default chunk), its seconds by part."""
            spent = {"product": 0.0, "ranks": 0.0}

            def record(part, seconds):
                spent[part] += seconds

            exact_ranks(xt, xt, plan, evaluated, chunk, lambda *_: None, record)
            return spent

        t_pml, ref = best_time(pml, args.repeats)
        # Ours and its floor alternate, so that a busy spell on a shared machine hits both.
        t_ours = t_cmm = float("inf")
        split = {"product": float("inf"), "ranks": float("inf")}
        for _ in range(args.repeats):
            t, rep = best_time(ours, 1)
            t_ours = min(t_ours, t)
            t_cmm = min(t_cmm, best_time(chunked_mm, 1)[0])
            split = min(split, parts(), key=lambda p: p["product"] + p["ranks"])
        t_boot, _ = best_time(lambda: ours(bootstrap=1000), 1)
        t_mm, _ = best_time(full_mm, args.repeats)
        diff = max(
            abs(rep["map_at_r"] - ref["mean_average_precision_at_r"]),
            abs(rep["r_precision"] - ref["r_precision"]),
            abs(rep["precision_at_1"] - ref["precision_at_1"]),
        )
        rows.append(
            {
                "noise": noise,
                "pml": t_pml,
                "ours": t_ours,
                "ours_boot": t_boot,
                "mm": t_mm,
                "cmm": t_cmm,
                "split": split,
                "diff": diff,
                "rep": rep,
            }
        )
    return rows


def _mem_status() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(("VmHWM", "VmRSS")):
                    key, value = line.split(":")
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def large_child(args) -> None:
    """Run in a fresh process so that its peak memory is this run's alone."""
    g, gl, centres = clustered(args.large_gallery, args.dim, args.large_classes, 1.5, seed=1)
    q, ql, _ = clustered(args.large_queries, args.dim, args.large_classes, 1.5, 2, centres)
    base = _mem_status().get("VmRSS")
    maxrss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    reset = False
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM (peak RSS) to the current RSS
        reset = True
    except OSError:
        pass
    t0 = time.perf_counter()
    rep = retrieval_metrics(q, ql, g, gl, k=(1, 5, 10), chunk_size=args.large_chunk)
    elapsed = time.perf_counter() - t0
    if reset and base is not None:
        peak = _mem_status()["VmHWM"] - base
        how = "VmHWM - RSS before"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - maxrss0
        how = "ru_maxrss delta (a lower bound if data generation peaked higher)"
    data = g.nbytes + q.nbytes + gl.nbytes + ql.nbytes
    # The floor over the same data: the chunked product alone, same chunk, one reused buffer.
    qt, gt = torch.from_numpy(q), torch.from_numpy(g)
    buf = torch.empty(min(args.large_chunk, len(q)), len(g))
    t0 = time.perf_counter()
    for i in range(0, len(q), len(buf)):
        part = qt[i : i + len(buf)]
        torch.mm(part, gt.T, out=buf[: len(part)])
    floor = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "time": elapsed,
                "floor": floor,
                "peak": peak,
                "how": how,
                "data": data,
                "chunk_bytes": len(buf) * len(g) * 4,
                "rep": rep,
            },
            default=str,
        )
    )


def part2(args) -> dict | None:
    cmd = [
        sys.executable,
        __file__,
        "--large-child",
        f"--dim={args.dim}",
        f"--large-queries={args.large_queries}",
        f"--large-gallery={args.large_gallery}",
        f"--large-classes={args.large_classes}",
        f"--large-chunk={args.large_chunk}",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(f"large run failed:\n{done.stderr[-3000:]}")
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--noise", type=lambda s: [float(v) for v in s.split(",")], default=[1.5, 2.0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--large-queries", type=int, default=50_000)
    ap.add_argument("--large-gallery", type=int, default=1_000_000)
    ap.add_argument("--large-classes", type=int, default=10_000)
    ap.add_argument("--large-chunk", type=int, default=256, help="queries per chunk")
    ap.add_argument("--skip-large", action="store_true")
    ap.add_argument("--large-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.large_child:
        large_child(args)
        return

    load0 = os.getloadavg()
    print("# imgret.metrics benchmark\n")
    print(
        f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads; "
        f"load average at start {load0[0]:.2f}"
    )
    print(
        f"retrieval_metrics rank engine: numba {numba.__version__} kernel with "
        f"{numba.get_num_threads()} threads"
    )
    print(
        f"\n## {args.n:,} x {args.n:,} leave-one-out, d={args.dim}, {args.classes} classes "
        f"(synthetic clustered, closed-set); best of {args.repeats}\n"
    )
    rows = part1(args)
    print(
        "| noise | MAP@R | P@1 | mAP (full) | retrieval_metrics s | floor: torch.mm chunked s "
        "| ours / floor | of ours: product s | of ours: rank counting s "
        "| AccuracyCalculator s | ours / AccCalc | + bootstrap 1000 s "
        "| torch.mm full s | max abs diff |"
    )
    print("|" + "---|" * 14)
    for r in rows:
        rep = r["rep"]
        print(
            f"| {r['noise']} | {rep['map_at_r']:.4f} | {rep['precision_at_1']:.4f} "
            f"| {rep['mean_average_precision']:.4f} | {r['ours']:.2f} | {r['cmm']:.2f} "
            f"| **{r['ours'] / r['cmm']:.2f}** | {r['split']['product']:.2f} "
            f"| {r['split']['ranks']:.2f} | {r['pml']:.2f} | {r['ours'] / r['pml']:.2f} "
            f"| {r['ours_boot']:.2f} | {r['mm']:.2f} | {r['diff']:.1e} |"
        )
    print(
        f"\nfloor: the same product in chunks of the default chunk size ({CHUNK_BYTES >> 20} "
        f"MiB of scores, {default_chunk_size(args.n, args.n)} queries) into one reused buffer: "
        "the GEMM work any exact chunked method has to do. Timed in the same run, alternating "
        "with ours."
    )
    print(
        "\nof ours: `exact_ranks` alone, best of its own alternating runs, by part: the "
        "product (into a fresh chunk buffer, so with its page faults, which the floor's "
        "reused buffer does not pay) and the rank counting (relevance pairs and the rank "
        "kernel). The rest of ours is validation, relevance grouping and the metrics."
    )
    print(
        "\nmax abs diff: largest |ours - AccuracyCalculator| over MAP@R, R-precision and P@1. "
        "AccuracyCalculator computes only those three; retrieval_metrics computes the whole "
        "report (mAP and MRR over the full ranking, recall/mAP/NDCG@k, ...)."
    )
    if not args.skip_large:
        print(
            f"\n## {args.large_queries:,} queries x {args.large_gallery:,} gallery, "
            f"d={args.dim}, {args.large_classes:,} classes, chunk {args.large_chunk} queries\n"
        )
        big = part2(args)
        if big is not None:
            rep = big["rep"]
            print(
                "| queries | gallery | time s | floor: chunked mm s | ours / floor "
                "| peak memory MiB | one chunk of scores MiB | data MiB | MAP@R | mAP |"
            )
            print("|---|---|---|---|---|---|---|---|---|---|")
            print(
                f"| {args.large_queries:,} | {args.large_gallery:,} | {big['time']:.1f} "
                f"| {big['floor']:.1f} | **{big['time'] / big['floor']:.2f}** "
                f"| {big['peak'] / 2**20:.0f} | {big['chunk_bytes'] / 2**20:.0f} "
                f"| {big['data'] / 2**20:.0f} "
                f"| {float(rep['map_at_r']):.4f} | {float(rep['mean_average_precision']):.4f} |"
            )
            print(f"\npeak memory = {big['how']}; data = the embeddings and labels themselves.")
    load1 = os.getloadavg()
    print(f"\nload average at end {load1[0]:.2f} (2-core machine: above ~2 means contention)")


if __name__ == "__main__":
    main()
