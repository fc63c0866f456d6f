"""The gallery's vectors on Milvus (``IMGRET_INDEX_BACKEND=milvus``), SQL still the record.

One Milvus collection per (imgret collection, model version) holds every live item's vector
with the fields filters select on (label, camera, metadata). :class:`MilvusIndex` is the
Searcher's live index on it, with the same contract as the in-process FAISS one
(:class:`imgret.gallery.search.live.LiveIndex`): exact ``min(k, matching)`` hits under
filters, a delete final in every process at once, an add searchable as soon as it returns.

What stays in each server: the catalog of live ids with their labels and cameras (what a
filter counts, and the check every hit passes) and the memory of deleted ids, about a tenth
of the vectors' size at 128 dimensions. What Milvus holds: the vectors, their index,
sharding, replicas and compaction.

Consistency, in the words of the FAISS backend's rules:

* The SQL change log is the outbox. An add or delete is applied to Milvus after its SQL
  commit; if Milvus is unreachable the item stays out of this server's catalog, the
  follower stops at that change (``/health`` shows its lag and error) and applies it again
  when Milvus answers (``upsert``: applying twice is harmless).
* A delete is remembered by every process that has seen it; each hit Milvus returns is
  checked against the catalog, so a vector that another process's late add put back is never
  returned, and it is deleted again.
* Opening reconciles the Milvus collection with SQL: ids Milvus holds that SQL does not are
  deleted, ids it lacks are inserted from the stored embeddings (``imgret index build
  --rebuild`` drops and refills it).
* The collection is created with ``Strong`` consistency: a search sees every write
  acknowledged before it, by any process.

A milvus-lite file (``IMGRET_MILVUS_URI=/path/milvus.db``, the default
``<data_dir>/milvus.db``) serves one process; several servers share a Milvus server
(``http://host:19530``, or ``milvus-lite server`` for tests).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from imgret.errors import GalleryError, IndexUnavailable
from imgret.gallery.search.filters import Catalog, DeadIds, SearchFilter
from imgret.gallery.search.ranking import Hit
from imgret.gallery.storage.vector_store import ItemInfo

logger = logging.getLogger(__name__)

# Milvus answers at most this many hits per query (its topk limit).
MAX_TOPK = 16_384
# Ids per insert / delete call: bounded request sizes.
_BATCH = 2_000
# Milvus's code for "collection not loaded" (a restarted Milvus releases every collection).
_NOT_LOADED = 101
# A filter the expression language cannot state exactly is sent as its allowed ids.
_ID_LIST_LIMIT = 65_536
NO_CAMERA = -1
FACTORY = "milvus:FLAT"


class MilvusUnavailable(IndexUnavailable):
    """Milvus could not be reached or refused a request: 503 with Retry-After. The message is
    ours; what failed, and the engine's own text, go to the log."""


def _unavailable(what: str, exc: Exception) -> MilvusUnavailable:
    logger.warning("Milvus %s failed: %s: %s", what, type(exc).__name__, exc)
    return MilvusUnavailable("the vector index (Milvus) is unavailable; retry")


_CLIENTS: dict[tuple[str, str | None], Any] = {}
_CLIENTS_LOCK = threading.Lock()


def client_for(uri: str, token: str | None = None) -> Any:
    """One :class:`pymilvus.MilvusClient` per URI in this process (a milvus-lite file admits
    one opener)."""
    with _CLIENTS_LOCK:
        key = (uri, token)
        if key not in _CLIENTS:
            try:
                from pymilvus import MilvusClient
            except ImportError:
                raise GalleryError(
                    "IMGRET_INDEX_BACKEND=milvus needs pymilvus and milvus-lite: "
                    "pip install 'imgret[milvus]'") from None
            try:
                _CLIENTS[key] = MilvusClient(uri, token=token or "")
            except Exception as exc:
                raise _unavailable(f"connection to {uri}", exc) from None
        return _CLIENTS[key]


def close_clients() -> None:
    """Close every client this process opened (tests; a milvus-lite file is then free)."""
    with _CLIENTS_LOCK:
        for client in _CLIENTS.values():
            try:
                client.close()
            except Exception:  # closing is best effort
                logger.debug("closing a Milvus client failed", exc_info=True)
        _CLIENTS.clear()


def milvus_uri(settings: Any) -> str:
    """``IMGRET_MILVUS_URI``, by default a milvus-lite file in the data dir."""
    return settings.milvus_uri or str(settings.data_dir / "milvus.db")


def vector_dropper(settings: Any) -> Callable[[int, str | None], None] | None:
    """What a collection or version delete calls to drop its Milvus collections (``None`` on
    the FAISS backend, whose index files the delete removes itself)."""
    if settings.index_backend != "milvus":
        return None

    def drop(collection_id: int, version: str | None) -> None:
        token = settings.milvus_token.get_secret_value() if settings.milvus_token else None
        client = client_for(milvus_uri(settings), token)
        if version is not None:
            drop_collection(client, collection_name(str(collection_id), version))
            return
        prefix = f"imgret_{int(collection_id)}__"  # collection_name's, for any version
        for name in client.list_collections():
            if name.startswith(prefix):
                client.drop_collection(name)

    return drop


def is_lite_file(uri: str) -> bool:
    """Whether ``uri`` names a milvus-lite file (embedded) rather than a Milvus server."""
    return "://" not in uri and not uri.startswith("unix:")


def collection_name(collection: str, model_version: str) -> str:
    """The Milvus collection of an imgret collection's model version: readable, within
    Milvus's alphabet, and unique (a hash of the exact pair)."""
    digest = hashlib.sha256(f"{collection}\0{model_version}".encode()).hexdigest()[:12]
    readable = re.sub(r"[^A-Za-z0-9_]", "_", f"{collection}__{model_version}")[:200]
    return f"imgret_{readable}_{digest}"


def literal(value: str) -> str:
    """A Milvus expression string literal (double quotes; quotes and backslashes escaped)."""
    return json.dumps(value, ensure_ascii=False)


class MilvusIndex:
    """The live index of a Searcher on a Milvus collection (the FAISS ``LiveIndex``'s
    contract; not thread-safe, the Searcher's lock guards it).

    Args:
        client: a ``MilvusClient``.
        name: the Milvus collection (created by :func:`ensure_collection`).
        dim: the vectors' dimension.
        infos: id -> filter info of every live id (from SQL).
        change_seq: the change-log position the collection reflects.
    """

    def __init__(self, client: Any, name: str, *, dim: int, infos: dict[int, ItemInfo],
                 change_seq: int, uri: str = ""):
        self.client = client
        self.name = name
        self.d = dim
        self.uri = uri
        self.catalog = Catalog(infos)
        self.seq = int(change_seq)
        self.factory = FACTORY
        self.device = "milvus"
        self.tombstones: set[int] = set()  # Milvus deletes for real: none
        self._dead = DeadIds()

    @property
    def stored(self) -> int:
        return len(self.catalog)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``client.<method>(self.name, ...)``, loading the collection and trying once more
        when Milvus answers that it is not loaded (after a Milvus restart)."""
        call = getattr(self.client, method)
        try:
            return call(self.name, *args, **kwargs)
        except Exception as exc:
            if getattr(exc, "code", None) != _NOT_LOADED:
                raise
            logger.info("Milvus collection %s was released; loading it again", self.name)
            self.client.load_collection(self.name)
            return call(self.name, *args, **kwargs)

    # ------------------------------------------------------------------ updates

    def add(self, ids: np.ndarray, vectors: np.ndarray, infos: Sequence[ItemInfo]) -> int:
        """Upsert the items that are new and were never removed; returns how many.

        Raises:
            MilvusUnavailable: the upsert failed; nothing was marked live, and the change-log
                follower applies the adds again (its position does not move past them).
        """
        keep, seen = [], set()
        for row, item_id in enumerate(ids.tolist()):
            if item_id in self.catalog or item_id in seen or item_id in self._dead:
                continue
            if item_id < 0:
                raise ValueError(f"gallery ids are non-negative, got {item_id}")
            seen.add(item_id)
            keep.append(row)
        if not keep:
            return 0
        rows = [_row(int(ids[r]), vectors[r], infos[r]) for r in keep]
        try:
            for start in range(0, len(rows), _BATCH):
                self._call("upsert", rows[start:start + _BATCH])
        except Exception as exc:
            # Not in the catalog: the follower reads these adds from the change log again.
            raise _unavailable(f"upsert into {self.name}", exc) from None
        self.catalog.add(ids[keep], [infos[r] for r in keep])
        return len(keep)

    def remove(self, wanted: set[int]) -> int:
        """Remember ``wanted`` as deleted for good, and delete the live ones from Milvus.

        Returns:
            How many live ids were removed.
        """
        self._dead.remember(wanted)
        present = sorted(i for i in wanted if i in self.catalog)
        if not present:
            return 0
        # Out of the catalog first: whatever Milvus answers, no search returns them again.
        self.catalog.remove(present)
        self._delete(present)
        return len(present)

    def _delete(self, ids: Sequence[int]) -> None:
        try:
            for start in range(0, len(ids), _BATCH):
                self._call("delete", ids=list(ids[start:start + _BATCH]))
        except Exception as exc:
            # The hits check keeps them out of every answer; the next open deletes them.
            logger.warning("Milvus delete from %s failed (%s)", self.name, type(exc).__name__)

    def rebuild_reason(self, threshold: float) -> str | None:
        return None  # Milvus compacts deleted rows itself

    def swap(self, built: Any) -> None:
        raise GalleryError("the Milvus backend rebuilds from SQL with `imgret index build`")

    def snapshot(self) -> None:
        return None  # Milvus keeps its own data: nothing to write beside SQL

    # ------------------------------------------------------------------ search

    def search(self, queries: np.ndarray, k: int, flt: SearchFilter | None) -> list[list[Hit]]:
        """The top ``min(k, allowed)`` hits of each query among the live ids ``flt`` allows.

        Raises:
            GalleryError: more than Milvus's 16,384 hits asked for one query.
            MilvusUnavailable: Milvus failed the search.
        """
        mask, n_allowed = self.catalog.allowed(flt, has_tombstones=False)
        want = min(k, n_allowed)
        if want == 0:
            return [[] for _ in range(len(queries))]
        if want > MAX_TOPK:
            raise GalleryError(f"the Milvus backend ranks at most {MAX_TOPK} items per query, "
                               f"{want} were asked for")
        expression = self._expression(flt, mask)
        hits = self._search(queries, want, expression)
        short = [row for row, row_hits in enumerate(hits) if len(row_hits) < want]
        if short:
            # Hits the catalog refused (a vector another process put back): ask for more.
            fetch = min(2 * want + 16, MAX_TOPK)
            for row, row_hits in zip(short, self._search(queries[short], fetch, expression),
                                     strict=True):
                hits[row] = row_hits[:want]
        return hits

    def _search(self, queries: np.ndarray, limit: int, expression: str) -> list[list[Hit]]:
        try:
            answer = self._call(
                "search", data=[q.tolist() for q in queries], limit=limit,
                filter=expression, output_fields=[], search_params={"metric_type": "IP"})
        except Exception as exc:
            raise _unavailable(f"search of {self.name}", exc) from None
        out = []
        for row in answer:
            hits = []
            stale = []
            for hit in row:
                item_id = int(hit["id"])
                if item_id in self.catalog:
                    hits.append(Hit(item_id, float(hit["distance"])))
                elif item_id in self._dead:
                    stale.append(item_id)
            if stale:
                self._delete(stale)
            out.append(hits)
        return out

    def _expression(self, flt: SearchFilter | None, mask: np.ndarray | None) -> str:
        """The filter in Milvus's expression language; a condition it cannot state with the
        catalog's exact meaning (a metadata value that is not a string or a plain integer)
        goes as the allowed ids."""
        if flt is None:
            return ""
        terms = []
        if flt.label is not None:
            terms.append(f"label == {literal(flt.label)}")
        if flt.camera is not None:
            terms.append(f"camera == {int(flt.camera)}")
        for key, value in (flt.metadata or {}).items():
            if isinstance(value, str):
                terms.append(f"meta[{literal(str(key))}] == {literal(value)}")
            elif isinstance(value, int) and not isinstance(value, bool):
                terms.append(f"meta[{literal(str(key))}] == {int(value)}")
            else:
                return _id_list(mask)
        if flt.exclude_ids:
            terms.append(f"id not in {sorted(flt.exclude_ids)}")
        return " and ".join(terms)

    def neighbours(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Unfiltered top ``min(k, live)`` as arrays, ``-1`` / ``-inf`` padding short rows."""
        want = min(k, len(self.catalog))
        scores = np.full((len(queries), want), -np.inf, dtype=np.float32)
        ids = np.full((len(queries), want), -1, dtype=np.int64)
        if want == 0 or not len(queries):
            return scores, ids
        for row, hits in enumerate(self.search(queries, want, None)):
            ids[row, : len(hits)] = [hit.id for hit in hits]
            scores[row, : len(hits)] = [hit.score for hit in hits]
        return scores, ids

    def vectors(self, ids: np.ndarray) -> np.ndarray:
        """``(n, d)`` float32 stored vectors of live ``ids``, in their order."""
        ids = np.asarray(ids, dtype=np.int64)
        if not len(ids):
            return np.zeros((0, self.d), dtype=np.float32)
        found: dict[int, list[float]] = {}
        unique = sorted(set(ids.tolist()))
        try:
            for start in range(0, len(unique), _BATCH):
                for row in self._call("get", ids=unique[start:start + _BATCH],
                                      output_fields=["vec"]):
                    found[int(row["id"])] = row["vec"]
        except Exception as exc:
            raise _unavailable(f"get from {self.name}", exc) from None
        missing = [i for i in unique if i not in found]
        if missing:
            raise GalleryError(f"{len(missing)} ids have no vector in Milvus")
        return np.asarray([found[i] for i in ids.tolist()], dtype=np.float32)


def _id_list(mask: np.ndarray | None) -> str:
    allowed = np.flatnonzero(mask) if mask is not None else np.zeros(0, np.int64)
    if len(allowed) > _ID_LIST_LIMIT:
        raise GalleryError(f"this metadata filter selects {len(allowed)} items; the Milvus "
                           f"backend filters on string and integer metadata values, or on at "
                           f"most {_ID_LIST_LIMIT} items")
    return f"id in {allowed.tolist()}"


def _row(item_id: int, vector: np.ndarray, info: ItemInfo) -> dict[str, Any]:
    return {"id": item_id, "vec": np.asarray(vector, dtype=np.float32).tolist(),
            "label": info.label, "camera": NO_CAMERA if info.camera is None else info.camera,
            "meta": dict(info.metadata or {})}


# ---------------------------------------------------------------------- the collection


def ensure_collection(client: Any, name: str, dim: int) -> bool:
    """Create the collection (exact inner-product search, Strong consistency) unless it
    exists with this dimension; returns whether it was created.

    Raises:
        MilvusUnavailable: Milvus failed, or the collection exists with another dimension.
    """
    try:
        if client.has_collection(name):
            fields = {f["name"]: f for f in client.describe_collection(name)["fields"]}
            have = int(fields.get("vec", {}).get("params", {}).get("dim", -1))
            if have != dim:
                raise MilvusUnavailable(f"Milvus collection {name} holds {have}-d vectors, "
                                        f"not {dim}-d: rebuild it")
            client.load_collection(name)
            return False
        index = client.prepare_index_params()
        index.add_index("vec", index_type="FLAT", metric_type="IP")
        client.create_collection(name, schema=collection_schema(client, dim), index_params=index,
                                 consistency_level="Strong")
        return True
    except MilvusUnavailable:
        raise
    except Exception as exc:
        raise _unavailable(f"collection {name}", exc) from None


def collection_schema(client: Any, dim: int) -> Any:
    """The fields of an imgret Milvus collection: the id, the vector, and what filters read."""
    from pymilvus import DataType

    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("id", DataType.INT64, is_primary=True)
    schema.add_field("vec", DataType.FLOAT_VECTOR, dim=dim)
    schema.add_field("label", DataType.VARCHAR, max_length=65_535)
    schema.add_field("camera", DataType.INT64)
    schema.add_field("meta", DataType.JSON)
    return schema


def drop_collection(client: Any, name: str) -> None:
    if client.has_collection(name):
        client.drop_collection(name)


def stored_ids(client: Any, name: str) -> np.ndarray:
    """Every id the collection holds, sorted."""
    iterator = client.query_iterator(name, batch_size=10_000, filter="id >= 0",
                                     output_fields=["id"])
    ids: list[int] = []
    try:
        while batch := iterator.next():
            ids.extend(int(row["id"]) for row in batch)
    finally:
        iterator.close()
    return np.unique(np.asarray(ids, dtype=np.int64))


def upsert_pages(client: Any, name: str, pages: Iterable[Any]) -> int:
    """Upsert ``VectorPage``s (ids, vectors, infos); returns the rows written."""
    total = 0
    for page in pages:
        rows = [_row(int(i), v, info)
                for i, v, info in zip(page.ids.tolist(), page.vectors, page.infos, strict=True)]
        for start in range(0, len(rows), _BATCH):
            client.upsert(name, rows[start:start + _BATCH])
        total += len(rows)
    return total


def open_milvus(session_factory: Any, *, uri: str, token: str | None, collection: str,
                model_version: str | None, dim: int | None = None,
                config: dict[str, Any] | None = None, rebuild: bool = False
                ) -> tuple[MilvusIndex, str]:
    """The Milvus index of a model version, reconciled with SQL: registered first when
    ``dim`` is given and the version is unknown (as the FAISS backend's open), its collection
    created, ids SQL no longer holds deleted, ids Milvus lacks inserted from the stored
    embeddings (``rebuild``: dropped and refilled).

    Returns:
        ``(index, model version)``.
    """
    from imgret.gallery.search.lifecycle import version_to_open
    from imgret.gallery.storage import change_log, vector_store
    from imgret.gallery.versions import version_store

    version = version_to_open(session_factory, model_version, dim, config)
    version_name, version_dim = version.version, version.dim
    client = client_for(uri, token)
    name = collection_name(collection, version_name)
    if rebuild:
        drop_collection(client, name)
    ensure_collection(client, name, version_dim)
    with session_factory() as session:
        seq = change_log.max_change_seq(session=session)  # changes after it are replayed
        version = version_store.get_model_version(session=session, version=version_name)
        infos: dict[int, ItemInfo] = {}
        for page in vector_store.iter_vector_pages(session=session, model_version=version,
                                                   page_size=50_000, with_vectors=False):
            infos.update(zip(page.ids.tolist(), page.infos, strict=True))
    sql_ids = np.fromiter(infos, np.int64, len(infos))
    held = stored_ids(client, name)
    extra = np.setdiff1d(held, sql_ids)
    missing = np.setdiff1d(sql_ids, held)
    for start in range(0, len(extra), _BATCH):
        client.delete(name, ids=extra[start:start + _BATCH].tolist())
    written = 0
    if len(missing):
        with session_factory() as session:
            version = version_store.get_model_version(session=session, version=version_name)
            pages = (vector_store.fetch_vectors(missing[start:start + 20_000].tolist(),
                                                session=session, model_version=version)
                     for start in range(0, len(missing), 20_000))
            written = upsert_pages(client, name, pages)
    logger.info("Milvus collection %s for %s: %d vectors (%d inserted from SQL, %d deleted)",
                name, version_name, len(infos), written, len(extra))
    index = MilvusIndex(client, name, dim=version_dim, infos=infos, change_seq=seq, uri=uri)
    return index, version_name
