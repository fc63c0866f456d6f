"""The models and indexes of model versions this process has open, bounded in memory.

``/evaluate`` with ``model_version`` or ``compare``, an activation's comparison gate and a
re-embedding open other versions' models and indexes; kept for good, every version ever
compared would stay in memory. :class:`VersionCache` keeps the served version always and the
others in least-recently-used order, bounded by count (``IMGRET_MAX_LOADED_VERSIONS``) and by
estimated bytes (``IMGRET_MAX_LOADED_BYTES``): a model's parameters and buffers, an index's
``size x dim x 4`` (float32 vectors; an IVF or HNSW index holds somewhat more). Past either
bound the least recently used non-served versions are dropped, model and index together.

Dropping only forgets the cache's reference: a request that holds the model or the index
finishes with it (Python keeps it alive), and the next request loads it again.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from prometheus_client import CollectorRegistry, Gauge

from imgret.embedder import Embedder
from imgret.gallery.search import Searcher

Kind = Literal["embedder", "searcher"]
T = TypeVar("T", Embedder, Searcher)


def model_bytes(embedder: Embedder) -> int:
    """Bytes of a model's parameters and buffers, and of its ONNX Runtime copy if it has
    one."""
    model = embedder.model
    return embedder.runtime_bytes + sum(
        t.numel() * t.element_size() for t in itertools.chain(model.parameters(),
                                                              model.buffers()))


def index_bytes(searcher: Searcher) -> int:
    """Estimated bytes of an index: its vectors as float32."""
    return int(searcher.size) * int(searcher.dim) * 4


@dataclass
class _Entry:
    embedder: Embedder | None = None
    searcher: Searcher | None = None
    model_bytes: int = 0  # fixed once loaded; an index's size is read when it counts

    def bytes(self) -> int:
        return self.model_bytes + (index_bytes(self.searcher) if self.searcher else 0)

    def empty(self) -> bool:
        return self.embedder is None and self.searcher is None


class VersionCache:
    """Per version, its open model and index; every version but the served one in an LRU.

    Thread-safe: every operation holds one lock; loading happens outside (the caller's).

    Args:
        served: the version being served now (never dropped).
        max_versions: non-served versions kept at most.
        max_bytes: estimated bytes of the non-served versions kept at most.
        registry: where to publish ``imgret_loaded_versions`` and ``imgret_loaded_bytes``
            (the non-served versions kept, as of the last change).
    """

    def __init__(self, *, served: Callable[[], str], max_versions: int, max_bytes: int,
                 registry: CollectorRegistry | None = None):
        self._served = served
        self.max_versions = max_versions
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recent first
        self._lock = threading.Lock()
        self._gauges: tuple[Gauge, Gauge] | None = None
        if registry is not None:
            self._gauges = (
                Gauge("imgret_loaded_versions", "Model versions other than the served one "
                      "whose model or index this process keeps loaded.", registry=registry,
                      multiprocess_mode="livesum"),
                Gauge("imgret_loaded_bytes", "Estimated bytes of those models and indexes.",
                      registry=registry, multiprocess_mode="livesum"),
            )

    def get(self, kind: Kind, version: str) -> Embedder | Searcher | None:
        """The version's open model or index (a use: it becomes the most recent)."""
        with self._lock:
            entry = self._entries.get(version)
            value = getattr(entry, kind) if entry is not None else None
            if value is not None:
                self._entries.move_to_end(version)
            return value

    def put(self, kind: Kind, version: str, value: Embedder | Searcher) -> list[str]:
        """Keep ``value`` as the version's model or index (the most recent), then drop the
        least recently used non-served versions past the bounds.

        Returns:
            The versions dropped.
        """
        with self._lock:
            entry = self._entries.setdefault(version, _Entry())
            self._entries.move_to_end(version)
            setattr(entry, kind, value)
            if kind == "embedder":
                assert isinstance(value, Embedder)
                entry.model_bytes = model_bytes(value)
            return self._evict()

    def discard(self, kind: Kind, version: str) -> None:
        """Forget the version's model or index (loaded again when next asked for)."""
        with self._lock:
            entry = self._entries.get(version)
            if entry is None:
                return
            setattr(entry, kind, None)
            if kind == "embedder":
                entry.model_bytes = 0
            if entry.empty():
                del self._entries[version]
            self._publish()

    def evict(self) -> list[str]:
        """Drop what is past the bounds now (after the served version changed)."""
        with self._lock:
            return self._evict()

    def loaded(self, kind: Kind) -> dict[str, Embedder | Searcher]:
        """Every open model or index by version (not a use)."""
        with self._lock:
            return {v: getattr(e, kind) for v, e in self._entries.items()
                    if getattr(e, kind) is not None}

    def usage(self) -> tuple[int, int]:
        """``(versions, estimated bytes)`` of the non-served versions kept."""
        with self._lock:
            return self._usage(self._served())

    def view(self, kind: Kind) -> LoadedView:
        """The models or the indexes as a mutable mapping version -> object."""
        return LoadedView(self, kind)

    def _usage(self, served: str) -> tuple[int, int]:
        others = [e for v, e in self._entries.items() if v != served]
        return len(others), sum(e.bytes() for e in others)

    def _evict(self) -> list[str]:
        served = self._served()
        dropped = []
        count, total = self._usage(served)
        for version in list(self._entries):  # least recent first
            if count <= self.max_versions and total <= self.max_bytes:
                break
            if version == served:
                continue
            entry = self._entries.pop(version)
            count, total = count - 1, total - entry.bytes()
            dropped.append(version)
        self._publish()
        return dropped

    def _publish(self) -> None:
        if self._gauges is not None:
            count, total = self._usage(self._served())
            self._gauges[0].set(count)
            self._gauges[1].set(total)


class LoadedView(MutableMapping[str, T], Generic[T]):
    """``Resources.embedders`` / ``Resources.searchers``: one kind of a :class:`VersionCache`
    as a mapping (setting an item may drop least recently used versions)."""

    def __init__(self, cache: VersionCache, kind: Kind):
        self._cache = cache
        self._kind: Kind = kind

    def __getitem__(self, version: str) -> T:
        value = self._cache.get(self._kind, version)
        if value is None:
            raise KeyError(version)
        return value  # type: ignore[return-value]

    def __setitem__(self, version: str, value: T) -> None:
        self._cache.put(self._kind, version, value)

    def __delitem__(self, version: str) -> None:
        if version not in self._cache.loaded(self._kind):
            raise KeyError(version)
        self._cache.discard(self._kind, version)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._cache.loaded(self._kind)))

    def __len__(self) -> int:
        return len(self._cache.loaded(self._kind))
