"""The glyph set: deterministic rendering from Debian's fonts, its cache, its refusals, the
ImageFolder it writes, and class-disjoint splits of it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from imgret.datasets import DatasetError, list_records
from imgret.training.config import (
    GlyphOptions,
    TrainConfig,
    TrainConfigError,
    default_image_size,
    parse_glyphs,
)
from imgret.training.data import make_split, model_spec_for, open_source
from imgret.training.data.glyphs import FACES, IMAGE_SIZE, load_glyphs, render
from tests.conftest import require

SMALL = GlyphOptions(classes=12, per_class=2 * len(FACES), seed=0)


@pytest.fixture(scope="module")
def fonts() -> None:
    """The real fonts; under ``CI=true`` their absence fails instead of skipping."""
    missing = sorted({face.package for face in FACES if not face.path.is_file()})
    require(not missing, f"the glyph fonts {' '.join(missing)} (make system-deps)")


@pytest.fixture(scope="module")
def cache(fonts: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder holding the small set (rendered once for the module)."""
    folder = tmp_path_factory.mktemp("cache")
    assert load_glyphs(SMALL, cache=folder).source == "rendered"
    return folder


@pytest.fixture(scope="module")
def small(cache: Path) -> tuple[np.ndarray, np.ndarray]:
    """The small set's ``(codepoints, pixels)``."""
    glyphs = load_glyphs(SMALL, cache=cache)
    return glyphs.codepoints, glyphs.pixels


def test_same_options_give_the_same_bytes_and_another_seed_differs(
    small: tuple[np.ndarray, np.ndarray],
) -> None:
    codepoints, pixels = small
    again_codepoints, again = render(SMALL, FACES)
    np.testing.assert_array_equal(codepoints, again_codepoints)
    assert pixels.tobytes() == again.tobytes()
    other_codepoints, other = render(dataclasses.replace(SMALL, seed=1), FACES)
    np.testing.assert_array_equal(codepoints, other_codepoints)  # the seed moves pixels only
    per_image = (other != pixels).reshape(len(pixels), -1).any(axis=1)
    assert per_image.all()


def test_an_image_depends_only_on_its_character_face_distortion_and_seed(
    small: tuple[np.ndarray, np.ndarray],
) -> None:
    codepoints, pixels = small
    fewer = dataclasses.replace(SMALL, per_class=len(FACES))
    _, first = render(fewer, FACES)
    by_class = pixels.reshape(len(codepoints), SMALL.per_class, IMAGE_SIZE, IMAGE_SIZE)
    np.testing.assert_array_equal(
        first.reshape(len(codepoints), len(FACES), IMAGE_SIZE, IMAGE_SIZE),
        by_class[:, :len(FACES)])


def test_counts_classes_and_item_names(cache: Path) -> None:
    glyphs = load_glyphs(SMALL, cache=cache)
    assert glyphs.pixels.shape == (SMALL.classes * SMALL.per_class, IMAGE_SIZE, IMAGE_SIZE)
    assert glyphs.pixels.dtype == np.uint8
    assert len(set(glyphs.codepoints.tolist())) == SMALL.classes
    assert np.all(np.diff(glyphs.codepoints) > 0)
    assert all(0x4E00 <= cp <= 0x9FFF for cp in glyphs.codepoints.tolist())
    names, counts = np.unique(glyphs.labels, return_counts=True)
    assert len(names) == SMALL.classes and set(counts.tolist()) == {SMALL.per_class}
    items = [glyphs.item_name(i) for i in range(len(glyphs.pixels))]
    assert len(set(items)) == len(items)
    faces = [item.split("/")[1] for item in items]
    assert {faces.count(face.key) for face in FACES} == {len(items) // len(FACES)}


def test_every_face_draws_every_class_with_ink(small: tuple[np.ndarray, np.ndarray]) -> None:
    codepoints, pixels = small
    by_face = pixels.reshape(len(codepoints), -1, len(FACES), IMAGE_SIZE * IMAGE_SIZE)
    ink = (by_face > 64).mean(axis=-1)  # (class, distortion, face)
    # Not blank, not a filled square: every face draws every character in every distortion.
    assert ink.min() > 0.02, f"faintest: {ink.min():.3f}"
    assert ink.max() < 0.6, f"fullest: {ink.max():.3f}"
    # The faces differ: the same character's images differ between two faces.
    assert (by_face[:, :, 0] != by_face[:, :, 1]).any(axis=-1).all()


def test_second_open_reads_the_cache_and_a_change_renders_again(
    cache: Path, small: tuple[np.ndarray, np.ndarray], tmp_path: Path,
) -> None:
    again = load_glyphs(SMALL, cache=cache)
    assert again.source == "cache"
    assert again.pixels.tobytes() == small[1].tobytes()
    fresh = load_glyphs(SMALL, use_cache=False)
    assert fresh.source == "rendered" and fresh.content_hash == again.content_hash
    other = load_glyphs(dataclasses.replace(SMALL, seed=3), cache=tmp_path)
    assert other.source == "rendered" and other.content_hash != again.content_hash
    assert load_glyphs(dataclasses.replace(SMALL, seed=3), cache=tmp_path).source == "cache"


def test_opens_in_one_process_share_one_read_only_copy(cache: Path) -> None:
    first, second = load_glyphs(SMALL, cache=cache), load_glyphs(SMALL, cache=cache)
    assert first is second
    with pytest.raises(ValueError, match="read-only"):
        first.pixels[0, 0, 0] = 1
    (cached,) = (cache / "glyphs").glob("*.npz")
    cached.touch()  # a rewritten file is read again
    assert load_glyphs(SMALL, cache=cache) is not first


def test_a_damaged_cache_is_rendered_again(cache: Path, tmp_path: Path) -> None:
    (cached,) = (cache / "glyphs").glob("*.npz")
    damaged = tmp_path / "glyphs" / cached.name
    damaged.parent.mkdir()
    damaged.write_bytes(cached.read_bytes()[:1000])
    again = load_glyphs(SMALL, cache=tmp_path)
    assert again.source == "rendered"
    assert again.content_hash == load_glyphs(SMALL, cache=cache).content_hash
    assert load_glyphs(SMALL, cache=tmp_path).source == "cache"


def test_description_names_fonts_classes_and_hash(cache: Path) -> None:
    glyphs = load_glyphs(SMALL, cache=cache)
    full = glyphs.description()
    assert [c["codepoint"] for c in full["classes"]] == glyphs.codepoints.tolist()
    assert [f["package"] for f in full["fonts"]] == [face.package for face in FACES]
    assert all(len(f["sha256"]) == 64 and f["licence"] for f in full["fonts"])
    assert full["content_hash"] == glyphs.content_hash
    compact = glyphs.description(full=False)
    assert "classes" not in compact and "fonts" not in compact
    assert compact["num_images"] == len(glyphs.pixels)
    assert json.loads(json.dumps(full)) == full


@pytest.mark.parametrize(("data", "problem"), [
    ("glyphs:classes=1", "classes must be an integer >= 2"),
    ("glyphs:classes=x", "classes must be an integer"),
    ("glyphs:per_class=0", "per_class must be an integer in"),
    ("glyphs:seed=-1", "seed must be an integer in"),
    ("glyphs:colour=red", "unknown"),
    ("glyphs:classes=10,classes=20", "repeated"),
    ("glyphs:classes", "expected KEY=VALUE"),
])
def test_bad_options_are_refused_in_one_line(data: str, problem: str) -> None:
    with pytest.raises(DatasetError, match=problem) as caught:
        parse_glyphs(data)
    assert "\n" not in str(caught.value)
    with pytest.raises(TrainConfigError, match=problem):
        TrainConfig(data=data)


def test_options_parse_and_other_sources_are_not_glyphs() -> None:
    assert parse_glyphs("glyphs") == GlyphOptions()
    options = parse_glyphs("glyphs:classes=2000, per_class=32")
    assert (options.classes, options.per_class) == (2000, 32)
    assert parse_glyphs(options.spec()) == options
    assert parse_glyphs("fashion-mnist") is None and parse_glyphs("glyphs-folder") is None
    assert default_image_size("glyphs") == default_image_size("glyphs:classes=50") == 32


def test_per_class_must_be_a_multiple_of_the_faces() -> None:
    with pytest.raises(DatasetError, match=f"multiple of the {len(FACES)} faces"):
        load_glyphs(dataclasses.replace(SMALL, per_class=len(FACES) + 1))


def test_more_classes_than_the_faces_share_is_refused(fonts: None, tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="faces share only"):
        load_glyphs(dataclasses.replace(SMALL, classes=100_000), cache=tmp_path)


def test_missing_fonts_are_named_with_their_package_and_the_fix(tmp_path: Path) -> None:
    gone = dataclasses.replace(FACES[0], package="fonts-nowhere", path=tmp_path / "gone.ttf")
    faces = (gone, *FACES[1:])
    with pytest.raises(DatasetError) as caught:
        load_glyphs(SMALL, faces=faces, cache=tmp_path)
    message = str(caught.value)
    assert "fonts-nowhere" in message and "make system-deps" in message
    assert str(gone.path) in message and "\n" not in message


def test_data_command_writes_an_image_folder(cache: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from imgret.cli.main import app

    monkeypatch.setenv("IMGRET_CACHE_DIR", str(cache))
    out = tmp_path / "glyphs"
    args = ["data", "glyphs", str(out), "--classes", str(SMALL.classes),
            "--per-class", str(SMALL.per_class), "--seed", str(SMALL.seed)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    glyphs = load_glyphs(SMALL, cache=cache)
    records = list_records(out)
    assert sorted({r.label for r in records}) == sorted(glyphs.class_names.tolist())
    assert len(records) == len(glyphs.pixels)
    description = json.loads((out / "glyphs.json").read_text(encoding="utf-8"))
    assert description["content_hash"] == glyphs.content_hash
    from PIL import Image

    first = records[0]
    index = glyphs.class_names.tolist().index(first.label) * glyphs.per_class + int(
        first.path.stem)
    np.testing.assert_array_equal(np.asarray(Image.open(first.path)), glyphs.pixels[index])
    again = CliRunner().invoke(app, args)  # a folder that holds something is not overwritten
    assert again.exit_code != 0 and "not an empty folder" in str(again.exception)


def test_class_disjoint_split_of_the_glyph_source(cache: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IMGRET_CACHE_DIR", str(cache))
    data = SMALL.spec()
    source = open_source(data)
    config = TrainConfig(data=data)
    split = make_split(source, config)
    classes = {name: set(split.classes(name, source)) for name in ("train", "val", "test")}
    assert not (classes["train"] & classes["val"]) and not (classes["train"] & classes["test"])
    assert not (classes["val"] & classes["test"])
    assert set().union(*classes.values()) == set(source.labels.tolist())
    assert all(len(c) >= 2 for c in classes.values())
    summary = split.summary(source)
    assert summary["dataset"]["content_hash"] == source.description(full=False)["content_hash"]
    assert "classes" not in summary["dataset"]
    assert len(split.to_json(source)["dataset"]["classes"]) == SMALL.classes
    # Other pixels (another seed) under the same names are another split.
    other = open_source(dataclasses.replace(SMALL, seed=1).spec())
    assert make_split(other, config).summary(other)["digest"] != summary["digest"]
    spec = model_spec_for(config, source)
    assert spec.grayscale and spec.mean[0] == pytest.approx(source.pixels.mean() / 255.0)
