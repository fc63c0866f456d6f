"""GPU figures against the device's own ceilings, measured in the same run; markdown tables.

Four parts, each beside its floor or peer:

1. **Ceilings** of this device, measured first: dense bf16, TF32 and strict fp32 matrix
   products (8192³) and the copy and read bandwidth of a 4 GiB buffer. Datasheets are not
   used: the rooflines below are these numbers.
2. **embed**: ``Embedder.embed_tensors`` (the product path: host tensor in, float32 rows
   out) with an untrained resnet50 at 224 px, batch 256, bf16 autocast, channels_last;
   beside the bare forward pass on a GPU-resident batch and the roofline (bf16 product
   rate / FLOPs per image, FLOPs counted by ``torch.utils.flop_counter``).
3. **flat search**, 1M x 512 float32, k = 10, batches 1 and 1,024: the FAISS GPU index that
   ``imgret.gallery.search.faiss_index.place_index`` makes (what the ``Searcher`` searches; host
   arrays in and out) beside ``torch.mm`` + ``topk`` on GPU-resident data and the roofline: batch 1
   reads the whole gallery (read bandwidth), batch 1,024 is a product (fp32 rate; TF32's
   beside it). Then the ``Searcher`` with its GPU mirror at k = 3,000 (> FAISS GPU's 2,048):
   it must return the CPU searcher's ids, also after deletes, without an error.
4. **metrics**: ``retrieval_metrics(device="cuda")`` against pytorch-metric-learning's
   ``AccuracyCalculator`` on the same device (FAISS GPU k-NN when faiss-gpu is installed),
   the largest difference of the shared numbers, and the chunked product on the GPU with
   and without the copy of each chunk of scores to the host (ours counts ranks on the CPU).

Times: CUDA events around GPU-resident work (median of ``--repeats`` after warm-ups), wall
clock around calls that take host data (they synchronise by returning host arrays).

Usage: ``python benchmarks/gpu_bench.py [--quick] [--parts ceilings,embed,search,metrics]``.
``--quick`` shrinks every size so that the script can be checked on a CPU-only machine
(CUDA parts then run on the CPU and print CPU numbers, labelled as such).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from imgret.checkpoint import EmbeddingNet, ModelSpec  # noqa: E402
from imgret.embedder import Embedder  # noqa: E402
from imgret.metrics import retrieval_metrics  # noqa: E402
from imgret.metrics.ranks import default_chunk_size  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
T = TypeVar("T")


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], T], repeats: int, warmup: int = 2) -> tuple[float, T]:
    """Median seconds per call, and the last call's result (so that checking it costs no
    extra run); GPU work is synchronised before and after each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        result = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    sys.stdout.flush()


# ---------------------------------------------------------------------------- ceilings

def ceilings(args) -> dict[str, float]:
    n = 8192 if not args.quick else 512
    out = {}
    for name, dtype, tf32 in (("bf16", torch.bfloat16, False), ("tf32", torch.float32, True),
                              ("fp32", torch.float32, False)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a = torch.randn(n, n, device=DEVICE, dtype=dtype)
        b = torch.randn(n, n, device=DEVICE, dtype=dtype)
        t, _ = timed(lambda a=a, b=b: a @ b, args.repeats)
        out[name] = 2 * n**3 / t
    torch.backends.cuda.matmul.allow_tf32 = False
    size = (4 << 30) if not args.quick else (64 << 20)
    src = torch.empty(size // 4, device=DEVICE, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    out["copy"] = 2 * size / timed(lambda: dst.copy_(src), args.repeats)[0]
    out["read"] = size / timed(lambda: src.sum(), args.repeats)[0]
    table(f"Ceilings measured on {device_name()}", ["what", "rate"], [
        ["bf16 matrix product 8192³", f"{out['bf16'] / 1e12:.0f} TFLOP/s"],
        ["TF32 matrix product 8192³", f"{out['tf32'] / 1e12:.0f} TFLOP/s"],
        ["fp32 matrix product 8192³ (no TF32)", f"{out['fp32'] / 1e12:.1f} TFLOP/s"],
        ["copy, bytes read + written", f"{out['copy'] / 1e12:.2f} TB/s"],
        ["read (sum of a 4 GiB buffer)", f"{out['read'] / 1e12:.2f} TB/s"],
    ])
    return out


def device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (no CUDA device)"


# ---------------------------------------------------------------------------- embed

def embed(args, peak: dict[str, float]) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    size, batch = (224, 256) if not args.quick else (64, 8)
    spec = ModelSpec(backbone="resnet50", dim=512, image_size=size)
    torch.manual_seed(0)
    embedder = Embedder(EmbeddingNet(spec), spec, device=DEVICE, batch_size=batch)
    host = torch.randn(batch, 3, size, size)
    t_product, _ = timed(lambda: embedder.embed_tensors(host), args.repeats)

    model = embedder.model.eval()
    gpu = host.to(DEVICE)
    if DEVICE == "cuda":
        gpu = gpu.contiguous(memory_format=torch.channels_last)
    autocast = torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda")

    def bare():
        with torch.inference_mode(), autocast:
            return model(gpu)

    t_bare, _ = timed(bare, args.repeats)
    with FlopCounterMode(display=False) as counter:
        bare()
    flops = counter.get_total_flops() / batch
    roof = peak["bf16"] / flops
    torch.backends.cudnn.benchmark = True
    t_tuned, _ = timed(bare, args.repeats)
    torch.backends.cudnn.benchmark = False
    rows = [
        ["Embedder.embed_tensors (host in, host out)", f"{batch / t_product:,.0f}",
         f"{batch / t_product / roof:.2f}"],
        ["bare forward, GPU-resident batch", f"{batch / t_bare:,.0f}",
         f"{batch / t_bare / roof:.2f}"],
        ["bare forward, cudnn.benchmark on", f"{batch / t_tuned:,.0f}",
         f"{batch / t_tuned / roof:.2f}"],
        ["roofline: bf16 rate / FLOPs per image", f"{roof:,.0f}", "1.00"],
    ]
    table(f"embed: resnet50, {size} px, batch {batch}, bf16 autocast "
          f"({flops / 1e9:.2f} GFLOP per image)", ["path", "images/s", "of roofline"], rows)


# ---------------------------------------------------------------------------- search

def unit_rows(n: int, d: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(n, d, device=DEVICE, generator=gen)
    return torch.nn.functional.normalize(x, dim=1)


def search(args, peak: dict[str, float]) -> None:
    from imgret.gallery.search.faiss_index import check_factory, create_index, place_index

    n, d, k = (1_000_000, 512, 10) if not args.quick else (20_000, 64, 10)
    gallery_gpu = unit_rows(n, d, 0)
    gallery = gallery_gpu.cpu().numpy()
    cpu_index = create_index(check_factory("Flat", d), d)
    cpu_index.add_with_ids(gallery, np.arange(n, dtype=np.int64))
    gpu_index, where = place_index(cpu_index)
    rows = []
    for batch in (1, 1024):
        queries_gpu = unit_rows(batch, d, 1)
        queries = queries_gpu.cpu().numpy()
        reps = args.repeats * (10 if batch == 1 else 1)

        def peer(q=queries_gpu):
            return torch.topk(q @ gallery_gpu.T, k, dim=1)

        t_peer, (_, want) = timed(peer, reps)
        if batch == 1:
            t_roof = gallery.nbytes / peak["read"]
            bound = "read bandwidth"
        else:
            t_roof = 2 * batch * n * d / peak["fp32"]
            bound = f"fp32 rate (TF32: {batch / (2 * batch * n * d / peak['tf32']):,.0f} q/s)"
        if gpu_index is not None:
            t_faiss, (_, got) = timed(lambda g=gpu_index, q=queries: g.search(q, k), reps)
            agree = float(np.mean(got == want.cpu().numpy()))
            faiss_cells = [f"{batch / t_faiss:,.0f}", f"{t_roof / t_faiss:.2f}", f"{agree:.4f}"]
        else:
            faiss_cells = ["n/a (no FAISS GPU)", "", ""]
        rows.append([str(batch), *faiss_cells, f"{batch / t_peer:,.0f}",
                     f"{t_roof / t_peer:.2f}", f"{batch / t_roof:,.0f}", bound])
    table(f"flat search: {n:,} x {d} float32, k = {k}, FAISS on {where}",
          ["batch", "FAISS GPU q/s", "of roofline", "ids equal to torch", "torch mm+topk q/s",
           "of roofline", "roofline q/s", "bound by"], rows)


def large_k() -> None:
    """The Searcher's GPU mirror at k beyond FAISS GPU's 2,048: same ids as the CPU copy."""
    from imgret.gallery.search import Searcher
    from imgret.gallery.search.faiss_index import check_factory, create_index, set_search_defaults
    from imgret.gallery.storage.vector_store import ItemInfo

    n, d, k = 20_000, 64, 3_000
    vectors = unit_rows(n, d, 2).cpu().numpy()
    ids = np.arange(1, n + 1, dtype=np.int64)
    queries = unit_rows(8, d, 3).cpu().numpy()
    searchers = {}
    for use_gpu in (None, False):
        index = create_index(check_factory("Flat", d), d)
        index.add_with_ids(vectors, ids)
        set_search_defaults(index)
        infos = {int(i): ItemInfo(f"l{int(i) % 7}") for i in ids}
        searchers[use_gpu] = Searcher(index, model_version="m", factory="Flat", infos=infos,
                                      use_gpu=use_gpu)
    gpu, cpu = searchers[None], searchers[False]
    rows = []
    for step in ("all live", "after deleting 500 ids"):
        if step != "all live":
            gone = ids[::40]
            gpu.remove(gone)
            cpu.remove(gone)
        try:
            got, want = gpu.search(queries, k), cpu.search(queries, k)
            same = sum([h.id for h in g] == [h.id for h in w] for g, w in zip(got, want,
                                                                               strict=True))
            # Two exact searches may order near-ties differently (other float summation
            # order): equally correct when the scores agree rank by rank.
            gap = max(abs(a.score - b.score) for g, w in zip(got, want, strict=True)
                      for a, b in zip(g, w, strict=True))
            sizes = {len(row) for row in got}
            verdict = (f"{'ok' if gap <= 1e-5 and sizes == {k} else 'WRONG'}: hits per query "
                       f"{sorted(sizes)}, largest score gap at equal rank {gap:.1e}, "
                       f"{same}/{len(queries)} id lists identical")
        except Exception as exc:  # the verdict is the point: print it, do not stop the run
            verdict = f"error: {type(exc).__name__}: {exc}"
        rows.append([step, gpu.device, verdict])
    table(f"Searcher with a GPU mirror, k = {k} (FAISS GPU returns at most 2,048)",
          ["gallery", "searcher device", "GPU mirror vs CPU searcher"], rows)


# ---------------------------------------------------------------------------- metrics

def metrics(args) -> None:
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

    from benchmarks.metrics_bench import clustered

    calc = AccuracyCalculator(
        include=("mean_average_precision_at_r", "r_precision", "precision_at_1"),
        k="max_bin_count", device=torch.device(DEVICE),
    )
    sets = [(20_000, 1.5), (20_000, 2.0), (100_000, 2.0)] if not args.quick else [(2_000, 1.5)]
    rows = []
    for n, noise in sets:
        x, y, _ = clustered(n, 128, 100, noise, seed=0)
        xg, yg = torch.from_numpy(x).to(DEVICE), torch.from_numpy(y).to(DEVICE)
        reps = args.repeats if n <= 20_000 else 1
        t_pml, ref = timed(lambda xg=xg, yg=yg: calc.get_accuracy(xg, yg, xg, yg,
                                                                  ref_includes_query=True),
                           reps, 1)
        t_ours, rep = timed(lambda x=x, y=y: retrieval_metrics(
            x, y, x, y, query_in_gallery=True, bootstrap=0, device=DEVICE), reps, 1)
        chunk = default_chunk_size(n, n)  # retrieval_metrics' own
        buf = torch.empty(chunk, n, device=DEVICE)
        host = torch.empty(chunk, n, pin_memory=DEVICE == "cuda")

        def product(copy: bool, xg=xg, buf=buf, host=host, chunk=chunk):
            for i in range(0, len(xg), chunk):
                part = xg[i : i + chunk]
                torch.mm(part, xg.T, out=buf[: len(part)])
                if copy:
                    host[: len(part)].copy_(buf[: len(part)])

        t_mm, _ = timed(lambda: product(False), reps, 1)
        t_mm_copy, _ = timed(lambda: product(True), reps, 1)
        diff = max(abs(rep["map_at_r"] - ref["mean_average_precision_at_r"]),
                   abs(rep["r_precision"] - ref["r_precision"]),
                   abs(rep["precision_at_1"] - ref["precision_at_1"]))
        rows.append([f"{n:,} x {n:,}", f"{noise}", f"{t_ours:.3f}", f"{t_pml:.3f}",
                     f"{t_pml / t_ours:.2f}", f"{t_mm:.3f}", f"{t_mm_copy:.3f}",
                     f"{t_ours / t_mm_copy:.1f}", f"{diff:.1e}"])
    table(f"retrieval_metrics on {device_name()} (leave-one-out, 128-d, 100 classes; seconds)",
          ["queries x gallery", "noise", "ours", "PML", "PML / ours", "chunked product",
           "product + copy to host", "ours / (product + copy)", "max diff"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a CPU-only check)")
    ap.add_argument("--parts", default="embed,search,large_k,metrics",
                    help="comma-separated: embed, search, large_k (only the k > 2048 check), "
                         "metrics; the ceilings always run")
    args = ap.parse_args()
    parts = args.parts.split(",")
    print(f"torch {torch.__version__} on {device_name()}")
    peak = ceilings(args)
    for name, part in (("embed", lambda: embed(args, peak)), ("search", lambda: search(args, peak)),
                       ("large_k", large_k), ("metrics", lambda: metrics(args))):
        if name in parts:
            try:
                part()
            except Exception:  # one broken part must not cost the others their numbers
                print(f"\n### {name}: failed\n\n```\n{traceback.format_exc()}```")


if __name__ == "__main__":
    main()
