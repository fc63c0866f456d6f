"""The manifest: checksums, atomic round trip, mismatch reasons."""

from __future__ import annotations

import json

import numpy as np
import pytest

from imgret.errors import IndexStale
from imgret.gallery.search.manifest import MANIFEST_FILE, Manifest, ids_checksum, index_dir


def _manifest(**overrides) -> Manifest:
    fields = dict(model_version="m1", factory="Flat", dim=16, count=3, change_seq=7,
                  ids_sha256=ids_checksum(np.array([3, 1, 2])))
    fields.update(overrides)
    return Manifest(**fields)


def test_ids_checksum_ignores_order_and_duplicates_but_not_content():
    assert ids_checksum(np.array([3, 1, 2])) == ids_checksum(np.array([1, 2, 3, 3]))
    assert ids_checksum(np.array([1, 2, 3])) != ids_checksum(np.array([1, 2, 4]))
    assert ids_checksum(np.array([], dtype=np.int64)) == ids_checksum(np.zeros(0, np.int32))


def test_round_trip_and_no_temporary_files_left(tmp_path):
    manifest = _manifest(tombstones=[5])
    manifest.write(tmp_path)
    assert Manifest.read(tmp_path) == manifest
    assert [p.name for p in tmp_path.iterdir()] == [MANIFEST_FILE]


@pytest.mark.parametrize("content", [None, "{not json", '{"format": "other"}',
                                     '{"format": "imgret-index-v1"}'])
def test_missing_or_bad_manifest_is_stale(tmp_path, content):
    if content is not None:
        (tmp_path / MANIFEST_FILE).write_text(content)
    with pytest.raises(IndexStale):
        Manifest.read(tmp_path)


def test_the_file_is_sorted_indented_json_of_every_field(tmp_path):
    """The on-disk format: saved indexes written before must keep loading, and vice versa."""
    manifest = _manifest(index_sha256="ab", tombstones=[5], faiss_version="1.9", created_at="t")
    manifest.write(tmp_path)
    assert (tmp_path / MANIFEST_FILE).read_text() == (
        '{\n  "change_seq": 7,\n  "count": 3,\n  "created_at": "t",\n  "dim": 16,\n'
        '  "factory": "Flat",\n  "faiss_version": "1.9",\n  "format": "imgret-index-v1",\n'
        f'  "ids_sha256": "{ids_checksum(np.array([1, 2, 3]))}",\n  "index_sha256": "ab",\n'
        '  "model_version": "m1",\n  "tombstones": [\n    5\n  ]\n}'
    )


def test_unknown_keys_are_ignored_and_wrong_types_are_stale(tmp_path):
    data = json.loads(_manifest().model_dump_json())
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({**data, "written_by": "a newer imgret"}))
    assert Manifest.read(tmp_path) == _manifest()
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({**data, "dim": "sixteen"}))
    with pytest.raises(IndexStale, match="dim"):
        Manifest.read(tmp_path)


def test_mismatches_name_each_difference():
    manifest = _manifest()
    assert manifest.mismatches(model_version="m1", factory=" Flat", dim=16) == []
    reasons = manifest.mismatches(model_version="m2", factory="HNSW32", dim=32)
    assert len(reasons) == 3 and "m2" in reasons[0] and "HNSW32" in reasons[1]


def test_index_dir_is_safe_for_any_version_string(tmp_path):
    assert index_dir(tmp_path, "../x y").parent == tmp_path / "indexes"
