"""Torch eager against ONNX Runtime on the CPU: the Embedder's two runtimes (IMGRET_RUNTIME) on
the same weights and the same preprocessed images; images/s per runtime and the ratio, torch
eager being the peer.

``Embedder.embed_tensors`` is timed (the product path from model input to float32 rows), so
preprocessing, the same for both, is left out. The two runtimes alternate round by round, so
that a change in the machine's load falls on both; each figure is the median round. Both run
with the same intra-op threads (``torch.get_num_threads()``, the Embedder's rule), first
torch's default (one per core), then each count of ``--threads``: on a machine whose cores
other processes use, a team of one thread per core waits on its slowest, preempted member,
and the two runtimes suffer from that differently. The largest difference between their
vectors is printed too.

Usage: ``python benchmarks/runtime_bench.py [--backbone resnet18] [--image-size 64]
[--batches 32,1] [--threads 1] [--seconds 8]`` (``--seconds``: time per row, both
runtimes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from imgret.checkpoint import EmbeddingNet, ModelSpec  # noqa: E402
from imgret.embedder import Embedder  # noqa: E402

RUNTIMES = ("torch", "onnxruntime")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbone", default="resnet18")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batches", default="32,1")
    parser.add_argument("--threads", default="1", help="thread counts after the default")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    spec = ModelSpec(backbone=args.backbone, dim=args.dim, image_size=args.image_size)
    model = EmbeddingNet(spec).eval()
    started = time.perf_counter()
    embedders = {name: Embedder(model, spec, device="cpu", runtime=name) for name in RUNTIMES}
    assert embedders["onnxruntime"].runtime == "onnxruntime", "onnxruntime is not installed"
    load_s = time.perf_counter() - started
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.backbone} d{args.dim} at {args.image_size} px; torch {torch.__version__}, "
          f"intra-op threads {torch.get_num_threads()} of {os.cpu_count()} cores, "
          f"1-min load average {load:.2f} at start; both embedders built in {load_s:.1f} s "
          "(the ONNX export included)")
    print()
    print("| threads | batch | torch eager img/s | onnxruntime img/s | onnxruntime / torch | "
          "rounds | max abs diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    counts = [torch.get_num_threads()] + [int(t) for t in args.threads.split(",") if t]
    for threads in dict.fromkeys(counts):
        torch.set_num_threads(threads)  # the ONNX Runtime session follows (a new one)
        for batch_size in (int(b) for b in args.batches.split(",")):
            row(embedders, threads, batch_size, args)


def row(embedders: dict[str, Embedder], threads: int, batch_size: int,
        args: argparse.Namespace) -> None:
    """Time both runtimes at one batch size and print the table's row."""
    batch = torch.randn(batch_size, 3, args.image_size, args.image_size)
    vectors = {}
    for name, embedder in embedders.items():
        for _ in range(args.warmup):
            vectors[name] = embedder.embed_tensors(batch)
    times: dict[str, list[float]] = {name: [] for name in RUNTIMES}
    deadline = time.perf_counter() + args.seconds
    while time.perf_counter() < deadline or len(times["torch"]) < 3:
        for name, embedder in embedders.items():
            start = time.perf_counter()
            embedder.embed_tensors(batch)
            times[name].append(time.perf_counter() - start)
    rate = {name: batch_size / statistics.median(t) for name, t in times.items()}
    diff = float(np.abs(vectors["torch"] - vectors["onnxruntime"]).max())
    print(f"| {threads} | {batch_size} | {rate['torch']:.1f} | {rate['onnxruntime']:.1f} | "
          f"{rate['onnxruntime'] / rate['torch']:.2f} | {len(times['torch'])} | "
          f"{diff:.1e} |")


if __name__ == "__main__":
    main()
