"""Torch eager against ONNX Runtime and int8 on the CPU: the Embedder's two runtimes
(IMGRET_RUNTIME) on the same weights, and the int8 graph of those weights (calibrated here on
random inputs, so its vectors say nothing of retrieval quality: `serving_runtimes_bench.py`
measures that), on the same preprocessed images; images/s and the ratio, torch eager being
the peer.

``Embedder.embed_tensors`` is timed (the product path from model input to float32 rows), so
preprocessing, the same for all, is left out. The runtimes alternate round by round
(:func:`imgret.quantize.throughput`), so that a change in the machine's load falls on all;
each figure is the median round. All run with the same intra-op threads
(``torch.get_num_threads()``, the Embedder's rule), first torch's default (one per core), then
each count of ``--threads``: on a machine whose cores other processes use, a team of one
thread per core waits on its slowest, preempted member, and the runtimes suffer from that
differently. The largest difference between the torch and ONNX Runtime vectors, and the
lowest cosine between the torch and int8 ones, are printed too.

Usage: ``python benchmarks/runtime_bench.py [--backbone resnet18] [--image-size 64]
[--batches 32,1] [--threads 1] [--seconds 8]`` (``--seconds``: time per row, all
runtimes).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from imgret.checkpoint import EmbeddingNet, ModelSpec, Quantized  # noqa: E402
from imgret.embedder import Embedder  # noqa: E402
from imgret.onnx_export import onnx_bytes  # noqa: E402
from imgret.quantize import quantize_int8, throughput  # noqa: E402

RUNTIMES = ("torch", "onnxruntime", "int8")


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
    calibration = [torch.randn(32, 3, args.image_size, args.image_size).numpy()
                   for _ in range(4)]
    quantized = Quantized("int8", quantize_int8(onnx_bytes(model, spec), calibration))
    embedders = {
        "torch": Embedder(model, spec, device="cpu", runtime="torch"),
        "onnxruntime": Embedder(model, spec, device="cpu", runtime="onnxruntime"),
        "int8": Embedder(model, spec, device="cpu", quantized=quantized),
    }
    assert embedders["onnxruntime"].runtime == "onnxruntime", "onnxruntime is not installed"
    load_s = time.perf_counter() - started
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.backbone} d{args.dim} at {args.image_size} px; torch {torch.__version__}, "
          f"intra-op threads {torch.get_num_threads()} of {os.cpu_count()} cores, "
          f"1-min load average {load:.2f} at start; embedders built in {load_s:.1f} s "
          "(the ONNX export and the int8 calibration included)")
    print()
    print("| threads | batch | torch eager img/s | onnxruntime img/s | onnxruntime / torch | "
          "int8 img/s | int8 / torch | rounds | onnxruntime max abs diff | int8 min cosine |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    counts = [torch.get_num_threads()] + [int(t) for t in args.threads.split(",") if t]
    for threads in dict.fromkeys(counts):
        torch.set_num_threads(threads)  # the ONNX Runtime sessions follow (new ones)
        for batch_size in (int(b) for b in args.batches.split(",")):
            row(embedders, threads, batch_size, args)


def row(embedders: dict[str, Embedder], threads: int, batch_size: int,
        args: argparse.Namespace) -> None:
    """Time the runtimes at one batch size and print the table's row."""
    batch = torch.randn(batch_size, 3, args.image_size, args.image_size)
    vectors = {name: embedder.embed_tensors(batch) for name, embedder in embedders.items()}
    speed = throughput({name: functools.partial(embedder.embed_tensors, batch)
                        for name, embedder in embedders.items()},
                       batch_size, seconds=args.seconds, warmup=args.warmup)
    rate = {name: s["images_per_s"] for name, s in speed.items()}
    diff = float(np.abs(vectors["torch"] - vectors["onnxruntime"]).max())
    cosine = float(np.sum(vectors["torch"] * vectors["int8"], axis=1).min())
    print(f"| {threads} | {batch_size} | {rate['torch']:.1f} | {rate['onnxruntime']:.1f} | "
          f"{rate['onnxruntime'] / rate['torch']:.2f} | {rate['int8']:.1f} | "
          f"{rate['int8'] / rate['torch']:.2f} | {speed['torch']['rounds']} | {diff:.1e} | "
          f"{cosine:.4f} |")


if __name__ == "__main__":
    main()
