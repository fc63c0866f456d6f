"""FAISS helpers: factory checks, index creation and training, query-time knobs, id
selectors, GPU placement, and the index file.

Every index uses ``METRIC_INNER_PRODUCT`` on the Embedder's L2-normalised float32 vectors,
so a score is the cosine similarity (higher is better) and FAISS ids are gallery ids.
:mod:`imgret.gallery.search.build` runs these stages in order to build an index from SQL.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from imgret import timing
from imgret.errors import IndexStale, InvalidIndexFactory
from imgret.files import file_sha256, write_atomic
from imgret.gallery.search.manifest import INDEX_FILE, normalise_factory

logger = logging.getLogger(__name__)

DEFAULT_FACTORY = "Flat"
# FAISS k-means warns below 39 points per centroid; we sample up to 256 per centroid.
_POINTS_PER_CENTROID_MIN = 39
_POINTS_PER_CENTROID_MAX = 256
_TRAIN_MAX = 500_000

_EXAMPLES = "Flat (exact), IVF1024,Flat, IVF1024,PQ32, HNSW32, OPQ32,IVF1024,PQ32, SQ8"

# Pre-transforms that keep inner products (rotations, zero padding) are fine; these are not.
_REFUSED_COMPONENTS: tuple[tuple[str, str], ...] = (
    (
        r"L2norm",
        "the Embedder already L2-normalises every vector, so inner product is the cosine "
        "similarity; a normalisation inside the index is redundant at the front and, after a "
        "dimension-changing transform, rescales the vectors so the scores are no longer the "
        "model's similarities. Remove the L2norm component",
    ),
    (
        r"PCA\w*",
        "PCA subtracts the data mean before projecting, which changes inner products "
        "(<x-m, y-m> != <x, y>) and so the ranking; for a smaller index use a rotation with "
        "a code instead, e.g. OPQ32_64,IVF1024,PQ32, or fewer dimensions at training time",
    ),
    (
        r"ITQ\w*|LSH\w*",
        "ITQ/LSH produce binary codes compared by Hamming distance, not inner product",
    ),
    (
        r"NSG\w*",
        "NSG graphs are built once from all vectors and cannot take new ones, so live "
        "gallery additions would fail; use HNSW32 for a graph index",
    ),
)


class TooFewVectors(InvalidIndexFactory):
    """A trainable factory (IVF, PQ, ...) and fewer vectors than it can be trained on."""


@dataclass(frozen=True)
class FactoryInfo:
    """What a checked factory string needs.

    Attributes:
        factory: the string, blanks removed.
        build_factory: what is passed to FAISS (``IDMap``/``IDMap2`` prefixes dropped:
            imgret maps ids itself).
        needs_training: the index must be trained before vectors are added.
        nlist: inverted lists of an IVF/IMI coarse quantizer, else ``None``.
        min_train: the fewest training vectors FAISS accepts.
    """

    factory: str
    build_factory: str
    needs_training: bool
    nlist: int | None
    min_train: int

    def train_size(self, n_vectors: int) -> int:
        """How many vectors to train on: up to 256 per centroid, capped, at most all."""
        if not self.needs_training:
            return 0
        want = max(self.min_train * _POINTS_PER_CENTROID_MAX, 10_000)
        return min(n_vectors, want, _TRAIN_MAX)

    def check_vector_count(self, n_vectors: int, model_version: str = "") -> None:
        """Refuse a trainable index on fewer vectors than it can be trained on.

        Raises:
            TooFewVectors: too few vectors, with a suggestion that fits.
        """
        if not self.needs_training or n_vectors >= self.min_train:
            if self.nlist and n_vectors < self.nlist * _POINTS_PER_CENTROID_MIN:
                logger.warning(
                    "%s: %d vectors for %d lists is below FAISS's 39 per list; recall will "
                    "suffer (consider IVF%d)", self.factory, n_vectors, self.nlist,
                    _suggest_nlist(n_vectors),
                )
            return
        what = f"{self.nlist} inverted lists" if self.nlist else "its quantizer"
        of = f" of model version {model_version}" if model_version else ""
        nlist = _suggest_nlist(n_vectors)
        alternative = f" or IVF{nlist},Flat" if nlist > 1 else ""
        raise TooFewVectors(
            f"index factory {self.factory!r} needs at least {self.min_train} vectors to train "
            f"{what}, but the gallery{of} has {n_vectors}; use --factory Flat (exact)"
            f"{alternative}, or ingest more images first"
        )


def check_factory(factory: str, dim: int) -> FactoryInfo:
    """Validate a FAISS factory string for inner-product search on ``dim``-d vectors.

    Refuses, with an explanation, strings FAISS cannot parse and strings that would parse
    but silently misbehave for normalised inner-product search: normalisation or centring
    transforms (L2norm, PCA), binary codes (LSH, ITQ), indexes that cannot take new vectors
    (NSG), and any index whose parts would compute L2 instead of inner product.

    Args:
        factory: e.g. ``"Flat"``, ``"IVF1024,Flat"``, ``"HNSW32"``, ``"IVF1024,PQ32"``.
        dim: the vector dimension.

    Raises:
        InvalidIndexFactory: the message names the problem and a fix.
    """
    text = normalise_factory(factory or "")
    if not text:
        raise InvalidIndexFactory(f"empty index factory string; use e.g. {_EXAMPLES}")
    components = text.split(",")
    build = components
    while build and build[0] in ("IDMap", "IDMap2"):
        build = build[1:]  # ids are mapped by imgret (IDMap2 where the index needs it)
    if not build:
        raise InvalidIndexFactory(f"index factory {factory!r} has no index after IDMap")
    for component in build:
        for pattern, why in _REFUSED_COMPONENTS:
            if re.fullmatch(pattern, component):
                raise InvalidIndexFactory(f"index factory {factory!r}: {component}: {why}")
    build_factory = ",".join(build)
    try:
        index = faiss.index_factory(dim, build_factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        raise InvalidIndexFactory(
            f"FAISS cannot build index factory {factory!r} for {dim}-d vectors "
            f"({_faiss_message(exc)}); examples: {_EXAMPLES}"
        ) from None
    for part in _parts(index):
        if part.metric_type != faiss.METRIC_INNER_PRODUCT:
            raise InvalidIndexFactory(
                f"index factory {factory!r}: FAISS builds its {type(part).__name__} with the "
                f"{_METRIC_NAMES.get(part.metric_type, part.metric_type)} metric even when "
                "asked for inner product, so scores would not be similarities; use e.g. "
                "HNSW32 or IVF1024,PQ32"
            )
    nlist, min_train = _training_needs(build, index)
    return FactoryInfo(text, build_factory, not index.is_trained, nlist, min_train)


def create_index(info: FactoryInfo, dim: int) -> faiss.Index:
    """An empty index for ``info`` that accepts ``add_with_ids`` with gallery ids.

    IVF indexes keep their own ids (with a hash-table direct map, so vectors can be
    reconstructed by id for exact re-ranking of filtered searches); others are wrapped in
    ``IndexIDMap2``.
    """
    index = faiss.index_factory(dim, info.build_factory, faiss.METRIC_INNER_PRODUCT)
    core = unwrap(index)
    if isinstance(core, faiss.IndexIVF) and _ids_native(index):
        core.set_direct_map_type(faiss.DirectMap.Hashtable)
        return index
    return faiss.IndexIDMap2(index)


def train_index(index: faiss.Index, sample: np.ndarray, info: FactoryInfo) -> None:
    """Train on ``sample`` (``(n, d)`` float32); FAISS errors become InvalidIndexFactory."""
    if index.is_trained:
        return
    with timed(f"training {info.factory} on {len(sample)} vectors"):
        try:
            index.train(np.ascontiguousarray(sample, dtype=np.float32))
        except RuntimeError as exc:
            raise InvalidIndexFactory(
                f"FAISS could not train {info.factory!r} on {len(sample)} vectors "
                f"({_faiss_message(exc)}); use Flat or a smaller index"
            ) from None


def set_search_defaults(index: faiss.Index, *, nprobe: int | None = None,
                        ef_search: int | None = None) -> None:
    """Set query-time knobs: IVF ``nprobe`` (default nlist/16, at least 8) and HNSW
    ``efSearch`` (default 64). They trade recall for speed and are not saved in a manifest."""
    core = unwrap(index)
    if isinstance(core, faiss.IndexIVF):
        core.nprobe = min(core.nlist, nprobe or max(8, core.nlist // 16))
    if isinstance(core, faiss.IndexHNSW):
        core.hnsw.efSearch = ef_search or max(64, core.hnsw.efSearch)


def unwrap(index: faiss.Index) -> faiss.Index:
    """The index under ``IndexIDMap``/``IndexIDMap2``/``IndexPreTransform`` wrappers."""
    core = faiss.downcast_index(index)
    while isinstance(core, (faiss.IndexIDMap, faiss.IndexIDMap2, faiss.IndexPreTransform)):
        core = faiss.downcast_index(core.index)
    return core


def search_index(
    index: faiss.Index, queries: np.ndarray, k: int, params: faiss.SearchParameters | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``imgret.gallery.search`` that survives ``faiss.contrib.torch_utils``.

    pytorch-metric-learning imports that module, which replaces ``Index.search`` process-wide
    with a torch-aware wrapper that has no ``params`` argument; the original stays available
    as ``search_numpy``.
    """
    search = getattr(index, "search_numpy", index.search)
    return search(queries, k, params=params)


def search_params(
    index: faiss.Index, selector: faiss.IDSelector | None, *, k: int, exhaustive: bool = False
) -> tuple[faiss.SearchParameters | None, bool]:
    """Per-call search parameters carrying an id selector.

    Args:
        index: the (CPU) index.
        selector: the allowed ids, or ``None``.
        k: results wanted (HNSW needs ``efSearch >= k``).
        exhaustive: visit everything the index can (IVF: all lists; HNSW: a 4x larger beam),
            the retry when a filtered search came back short.

    Returns:
        ``(params, supported)``: ``supported`` is ``False`` when this index type takes no
        search parameters (PQ, refine, ...); the caller then over-fetches and post-filters.
        A fresh object per call: FAISS's IDMap rewrites ``params.sel`` while searching.
    """
    core = unwrap(index)
    if isinstance(core, faiss.IndexIVF):
        nprobe = core.nlist if exhaustive else core.nprobe
        return faiss.SearchParametersIVF(sel=selector, nprobe=nprobe), True
    if isinstance(core, faiss.IndexHNSW):
        ef = max(core.hnsw.efSearch, k) * (4 if exhaustive else 1)
        return faiss.SearchParametersHNSW(sel=selector, efSearch=ef), True
    if isinstance(core, (faiss.IndexFlat, faiss.IndexScalarQuantizer)):
        return (faiss.SearchParameters(sel=selector) if selector is not None else None), True
    return None, selector is None


def stored_ids(index: faiss.Index) -> np.ndarray:
    """Every id stored in the index (``(n,) int64``, unordered)."""
    top = faiss.downcast_index(index)
    if isinstance(top, (faiss.IndexIDMap, faiss.IndexIDMap2)):
        return faiss.vector_to_array(top.id_map).astype(np.int64)
    core = unwrap(index)
    if isinstance(core, faiss.IndexIVF):
        invlists = core.invlists
        parts = []
        for list_no in range(core.nlist):
            size = invlists.list_size(list_no)
            if size:
                ptr = invlists.get_ids(list_no)
                parts.append(faiss.rev_swig_ptr(ptr, size).copy())
                invlists.release_ids(list_no, ptr)
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    raise IndexStale(f"cannot list the ids of a {type(top).__name__}")


# FAISS GPU resources and GPU indexes are not thread-safe: every use of a GPU mirror in this
# process (copies, searches, updates) holds this lock.
GPU_LOCK = threading.Lock()
# Temporary memory reserved per device by the shared FAISS GPU resources. FAISS reserves up to
# 1.5 GiB per StandardGpuResources, and faiss.index_cpu_to_all_gpus makes new ones for every
# copy: a process that placed a few dozen indexes (rebuilds, model switches, tests) ran the
# device out of memory, and FAISS then aborts the process instead of raising (seen on an
# H200: the API tests on 12 workers). One set per process, capped, is what FAISS advises;
# searches that need more fall back to per-call allocations inside FAISS.
GPU_TEMP_MEMORY = 256 << 20
_GPU_RESOURCES: list = []


def _copy_to_gpus(index: faiss.Index, options, ngpu: int) -> faiss.Index:
    """``index`` copied to the first ``ngpu`` GPUs with this process's shared resources."""
    with GPU_LOCK:
        while len(_GPU_RESOURCES) < ngpu:
            resources = faiss.StandardGpuResources()
            resources.setTempMemory(GPU_TEMP_MEMORY)
            _GPU_RESOURCES.append(resources)
        return faiss.index_cpu_to_gpu_multiple_py(_GPU_RESOURCES[:ngpu], index, co=options)


def place_index(
    index: faiss.Index, *, use_gpu: bool | None = None
) -> tuple[faiss.Index | None, str]:
    """Mirror the index on every GPU (sharded) when FAISS sees GPUs, else stay on CPU.

    The CPU index stays the master copy (updates, filtered searches with id selectors,
    saving); the GPU mirror serves unfiltered searches. Both paths share the Searcher's code:
    only the object searched differs.

    Args:
        index: the CPU index.
        use_gpu: ``None`` = automatic (``faiss.get_num_gpus() > 0``), ``False`` = CPU.

    Returns:
        ``(gpu_index or None, device description)``.
    """
    ngpu = faiss.get_num_gpus() if use_gpu is not False else 0
    if ngpu == 0:
        why = "disabled" if use_gpu is False else "faiss.get_num_gpus() == 0"
        logger.info("FAISS index on CPU (%s)", why)
        return None, "cpu"
    try:
        options = faiss.GpuMultipleClonerOptions()
        options.shard = True  # split the vectors across GPUs: memory scales with GPU count
        gpu_index = _copy_to_gpus(index, options, ngpu)
    except (AttributeError, RuntimeError) as exc:
        logger.warning(
            "FAISS index stays on CPU: %s has no GPU version or the copy failed (%s)",
            type(unwrap(index)).__name__, _faiss_message(exc),
        )
        return None, "cpu"
    logger.info("FAISS index on %d GPU(s), sharded", ngpu)
    return gpu_index, f"cuda x{ngpu} (sharded)"


def write_index(index: faiss.Index, folder: str | Path) -> tuple[Path, str]:
    """Write ``index.faiss`` atomically and durably; returns its path and SHA-256.

    Callers that must not hold a lock during the disk write serialise first
    (:func:`serialize_index`, fast, in memory) and pass the bytes to :func:`write_index_bytes`.
    """
    return write_index_bytes(serialize_index(index), folder)


def serialize_index(index: faiss.Index) -> np.ndarray:
    """The index file's bytes, in memory (a copy: the index may change afterwards)."""
    return faiss.serialize_index(index)


def write_index_bytes(data: np.ndarray, folder: str | Path) -> tuple[Path, str]:
    """Write serialised index bytes as ``index.faiss`` (atomic, fsync'd); path and SHA-256."""
    folder = Path(folder)
    path = folder / INDEX_FILE
    view = memoryview(np.ascontiguousarray(data, dtype=np.uint8))
    write_atomic(path, view)
    return path, hashlib.sha256(view).hexdigest()


def read_index(folder: str | Path, expected_sha256: str = "") -> faiss.Index:
    """Read ``index.faiss``; a checksum mismatch or unreadable file raises IndexStale."""
    path = Path(folder) / INDEX_FILE
    if not path.is_file():
        raise IndexStale(f"{path}: no index file")
    if expected_sha256 and file_sha256(path) != expected_sha256:
        raise IndexStale(f"{path}: file checksum differs from the manifest")
    try:
        return faiss.read_index(str(path))
    except RuntimeError as exc:
        raise IndexStale(f"{path}: unreadable ({_faiss_message(exc)})") from None


def _ids_native(index: faiss.Index) -> bool:
    """Whether ``add_with_ids`` works without IDMap (IVF, possibly under a pre-transform)."""
    top = faiss.downcast_index(index)
    if isinstance(top, faiss.IndexPreTransform):
        top = unwrap(top)
    return isinstance(top, faiss.IndexIVF)


def _parts(index: faiss.Index) -> Iterator[faiss.Index]:
    """The index and every sub-index (quantizers, storage, refine and base indexes)."""
    stack = [faiss.downcast_index(index)]
    while stack:
        part = stack.pop()
        yield part
        for attr in ("index", "quantizer", "storage", "base_index", "refine_index"):
            child = getattr(part, attr, None)
            if isinstance(child, faiss.Index):
                stack.append(faiss.downcast_index(child))


def _training_needs(components: list[str], index: faiss.Index) -> tuple[int | None, int]:
    nlist = None
    min_train = 1
    for component in components:
        if match := re.match(r"IVF(\d+)", component):
            nlist = int(match.group(1))
            min_train = max(min_train, nlist)
        elif match := re.match(r"IMI(\d+)x(\d+)", component):
            nlist = 2 ** (int(match.group(1)) * int(match.group(2)))
            min_train = max(min_train, 2 ** int(match.group(2)))
        elif match := re.match(r"(?:O?PQ|RQ|LSQ|PRQ|PLSQ)\d+(?:_\d+)?(?:x(\d+))?", component):
            nbits = int(match.group(1)) if match.group(1) else 8
            min_train = max(min_train, 2**nbits)
    if index.is_trained:
        return nlist, 0
    return nlist, min_train


def _suggest_nlist(n_vectors: int) -> int:
    """A list count FAISS trains well on ``n_vectors`` (about 4·sqrt(n), ≥ 39 per list)."""
    if n_vectors < _POINTS_PER_CENTROID_MIN * 2:
        return 1
    by_sqrt = 4 * int(math.sqrt(n_vectors))
    return max(1, min(by_sqrt, n_vectors // _POINTS_PER_CENTROID_MIN))


def _faiss_message(exc: BaseException) -> str:
    """FAISS's C++ message without the signature and source location."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    match = re.search(r"\.(?:cpp|h):\d+: (.*)$", text)
    message = match.group(1) if match else text
    return re.sub(r"^Error: '(.*)' failed", r"check \1 failed", message)


_METRIC_NAMES = {faiss.METRIC_INNER_PRODUCT: "inner product", faiss.METRIC_L2: "L2"}


@contextmanager
def timed(stage: str) -> Iterator[None]:
    """Log a stage and its duration (autofaiss's Timeit)."""
    logger.info("%s ...", stage)
    with timing.timed(lambda seconds: logger.info("%s: done in %.2fs", stage, seconds)):
        yield
