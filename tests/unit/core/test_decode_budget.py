"""Decoding for the model: pixel budgets, the decode gate, JPEG draft, shrink-as-you-go, and
the same model input as the full-size path."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from imgret.checkpoint import EmbeddingNet, ModelSpec
from imgret.embedder import Embedder
from imgret.errors import ImageDecodeError, ImageTooLarge
from imgret.images import (
    REDUCING_GAP,
    DecodeGate,
    DecodeLimits,
    PixelBudget,
    check_request_pixels,
    decode_cost,
    decode_for_embedding,
    decode_gate,
    decode_image,
    embed_encoded,
    probe_image,
)
from tests.conftest import TEST_DEVICE
from tests.support.hostile_images import (
    CRAFTED_EXIF,
    crafted_exif_jpeg,
    png_header_only,
    ratio_bomb,
)
from tests.support.images import class_image, image_bytes

SIZE = 32  # the tiny model's input side

def photo(width: int, height: int, fmt: str = "PNG", *, exif: bytes | None = None) -> bytes:
    """A photo-like image (gradients + noise), so resizing differences would show."""
    rng = np.random.default_rng([width, height])
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x + y) % 97 * 2], -1)
    pixels = pixels + rng.normal(0, 8, (height, width, 3))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype("uint8"), "RGB")
    buffer = io.BytesIO()
    image.save(buffer, fmt, **({"exif": exif} if exif else {}))
    return buffer.getvalue()


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    torch.manual_seed(0)
    return Embedder.from_model(
        EmbeddingNet(ModelSpec(backbone="tiny_cnn", dim=16, image_size=SIZE)),
        device=TEST_DEVICE, batch_size=4,
    )


# --------------------------------------------------------------------------- PixelBudget


def test_budget_charges_until_spent_and_names_its_setting() -> None:
    budget = PixelBudget(100, setting="IMGRET_MAX_REQUEST_PIXELS")
    budget.charge(60)
    budget.charge(40)
    assert (budget.used, budget.remaining) == (100, 0)
    with pytest.raises(ImageTooLarge, match=r"would decode 101 .*IMGRET_MAX_REQUEST_PIXELS"):
        budget.charge(1)
    assert budget.used == 100  # a refused charge takes nothing


def test_budget_force_goes_past_the_allowance() -> None:
    budget = PixelBudget(10, setting="IMGRET_BATCH_MAX_PIXELS", scope="batch")
    budget.force(25)
    assert not budget.fits(1)
    with pytest.raises(ImageTooLarge, match="batch would decode"):
        budget.charge(1)


# --------------------------------------------------------------------------- probe + draft


def test_probe_reads_the_header_only() -> None:
    probe = probe_image(png_header_only(5000, 4000), size=SIZE, max_pixels=20_000_000)
    assert (probe.width, probe.height, probe.decode_pixels) == (5000, 4000, 20_000_000)


def test_probe_refuses_over_the_per_image_limit() -> None:
    with pytest.raises(ImageTooLarge, match="IMGRET_MAX_IMAGE_PIXELS"):
        probe_image(png_header_only(5000, 4000), size=SIZE, max_pixels=20_000_000 - 1)


def test_large_jpeg_is_decoded_at_reduced_scale() -> None:
    probe = probe_image(photo(1600, 1200, "JPEG"), size=SIZE)
    # Draft picks the largest of 1/2, 1/4, 1/8 keeping each side >= REDUCING_GAP x SIZE.
    assert (probe.decode_width, probe.decode_height) == (200, 150)
    image = decode_for_embedding(photo(1600, 1200, "JPEG"), size=SIZE)
    assert min(image.size) >= REDUCING_GAP * SIZE
    assert max(image.size) < 2 * REDUCING_GAP * SIZE


# --------------------------------------------------------------------------- same model input


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "TIFF"])
@pytest.mark.parametrize("side", [20, 32, 150])
def test_small_images_give_exactly_the_full_size_model_input(
    embedder: Embedder, fmt: str, side: int
) -> None:
    data = image_bytes(class_image(3, 1, size=side), fmt)
    full = embedder.preprocess([decode_image(data)])
    assert torch.equal(embedder.preprocess([decode_for_embedding(data, size=SIZE)]), full)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "L", "1", "I;16"])
def test_small_images_of_any_mode_match_too(embedder: Embedder, mode: str) -> None:
    source = class_image(2, 0, size=40)
    if mode == "I;16":
        source = Image.fromarray(np.full((40, 40), 40000, dtype=np.uint16))
    else:
        source = source.convert(mode)
    data = image_bytes(source, "TIFF" if mode == "I;16" else "PNG")
    full = embedder.preprocess([decode_image(data)])
    assert torch.equal(embedder.preprocess([decode_for_embedding(data, size=SIZE)]), full)


@pytest.mark.parametrize(("fmt", "width", "height"), [
    ("PNG", 1600, 1200), ("PNG", 3000, 500), ("JPEG", 1600, 1200), ("JPEG", 2400, 700),
])
def test_large_images_are_shrunk_to_an_equivalent_model_input(
    embedder: Embedder, fmt: str, width: int, height: int
) -> None:
    data = photo(width, height, fmt)
    image = decode_for_embedding(data, size=SIZE)
    assert max(image.size) < 2 * REDUCING_GAP * SIZE <= 2 * min(width, height)
    full = embedder.embed([decode_image(data)])[0]
    shrunk = embedder.embed([image])[0]
    assert float(full @ shrunk) > 0.9999  # unit vectors: cosine similarity


@pytest.mark.parametrize("mode", ["P", "1", "RGBA", "LA"])
def test_large_images_of_other_modes_are_shrunk_too(embedder: Embedder, mode: str) -> None:
    source = Image.open(io.BytesIO(photo(1200, 900))).convert(mode)
    data = image_bytes(source, "PNG")
    image = decode_for_embedding(data, size=SIZE)
    assert image.mode == "RGB" and max(image.size) < 2 * REDUCING_GAP * SIZE
    full = embedder.embed([decode_image(data)])[0]
    assert float(full @ embedder.embed([image])[0]) > 0.999


def test_exif_orientation_is_applied_after_shrinking() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise for display
    data = photo(1600, 400, "JPEG", exif=exif.tobytes())
    assert decode_image(data).size == (400, 1600)
    width, height = decode_for_embedding(data, size=SIZE).size
    full = decode_image(data).resize((SIZE, SIZE))
    small = decode_for_embedding(data, size=SIZE).resize((SIZE, SIZE))
    # Same picture, same way up (a missed rotation would differ by far more).
    diff = np.abs(np.asarray(full, float) - np.asarray(small, float)).mean()
    assert diff < 4, (width, height, diff)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kind", sorted(CRAFTED_EXIF))
def test_crafted_exif_is_a_decode_error_not_a_crash(kind: str) -> None:
    data = crafted_exif_jpeg(kind)
    with pytest.raises(ImageDecodeError, match="cannot decode the image"):
        decode_image(data)
    with pytest.raises(ImageDecodeError, match="cannot decode the image"):
        decode_for_embedding(data, size=SIZE)


def test_budget_is_charged_from_the_header_before_decoding() -> None:
    budget = PixelBudget(10_000_000, setting="IMGRET_MAX_REQUEST_PIXELS")
    budget.charge(9_000_000)
    # No pixel data at all: only the header can have been read to refuse it by the budget.
    with pytest.raises(ImageTooLarge, match="IMGRET_MAX_REQUEST_PIXELS"):
        decode_for_embedding(png_header_only(2000, 1000), size=SIZE, budget=budget)
    assert budget.used == 9_000_000


# --------------------------------------------------------------------------- whole requests


def test_a_request_of_ratio_bombs_is_refused_before_decoding(embedder: Embedder) -> None:
    limits = DecodeLimits(image_pixels=4_000_000, request_pixels=10_000_000)
    # Each bomb is under the per-image limit; three of them are over the request's budget.
    blobs = [png_header_only(2000, 1999)] * 3
    with pytest.raises(ImageTooLarge, match=r"images\[2\]: .*IMGRET_MAX_REQUEST_PIXELS"):
        embed_encoded(blobs, embedder=embedder, limits=limits)
    with pytest.raises(ImageTooLarge, match=r"q2: "):
        check_request_pixels(blobs, size=SIZE, limits=limits, names=["q0", "q1", "q2"])


def test_embed_encoded_matches_the_embedder_in_order(embedder: Embedder) -> None:
    # 7 images with batch_size 4: two forward passes, same vectors and order as embed().
    blobs = [image_bytes(class_image(c, i, size=32 + 8 * i)) for c in range(2) for i in range(3)]
    blobs.append(ratio_bomb(1500, 1500))  # decodes to 2.25 M pixels, shrunk right away
    vectors = embed_encoded(blobs, embedder=embedder, limits=DecodeLimits())
    reference = embedder.embed([decode_image(data) for data in blobs])
    assert vectors.shape == (7, 16)
    np.testing.assert_allclose(vectors[:6], reference[:6], atol=1e-6)
    assert float(vectors[6] @ reference[6]) > 0.9999


def test_embed_encoded_names_the_bad_file(embedder: Embedder) -> None:
    blobs = [image_bytes(class_image(0, 0)), crafted_exif_jpeg("TypeError")]
    with pytest.raises(ImageDecodeError, match=r"^images\[1\]: cannot decode"):
        embed_encoded(blobs, embedder=embedder, limits=DecodeLimits())


# --------------------------------------------------------------------------- strips + cost


def test_strip_wise_shrinking_equals_shrinking_the_whole_image() -> None:
    rng = np.random.default_rng(0)
    palette = Image.fromarray(rng.integers(0, 256, (1200, 3000), dtype=np.uint8), "P")
    palette.putpalette([int(v) for v in rng.integers(0, 256, 768)])
    sixteen = Image.fromarray(rng.integers(0, 65535, (1300, 2900), dtype=np.uint16))
    for source, whole in (
        # Several strips each; the reference converts the whole image first (the memory cost
        # the strips avoid) and reduces it in one go.
        (palette, lambda im: im.convert("RGBA")),
        (sixteen, lambda im: Image.fromarray(
            (np.asarray(im, dtype=np.float64) / 65535 * 255).astype("uint8"), "L")),
    ):
        data = image_bytes(source, "PNG") if source.mode != "P" else _png(source, transparency=7)
        decoded = Image.open(io.BytesIO(data))
        factors = (decoded.size[0] // (REDUCING_GAP * SIZE),
                   decoded.size[1] // (REDUCING_GAP * SIZE))
        expected = whole(decoded).reduce(factors)
        if expected.mode == "RGBA":
            background = Image.new("RGB", expected.size, (255, 255, 255))
            background.paste(expected, mask=expected.getchannel("A"))
            expected = background
        got = decode_for_embedding(data, size=SIZE)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected.convert("RGB")))


def _png(image: Image.Image, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG", **kwargs)
    return buffer.getvalue()


def test_decode_cost_follows_mode_and_format() -> None:
    def cost(data: bytes) -> int:
        return decode_cost(Image.open(io.BytesIO(data)))

    strip = cost(ratio_bomb(1000, 1000, "L")) - 1000 * 1000
    assert strip > 0
    assert cost(ratio_bomb(1000, 1000, "P")) == 1_000_000 + strip
    assert cost(ratio_bomb(1000, 1000, "RGB")) == 4_000_000 + strip
    webp = io.BytesIO()
    Image.new("RGB", (1000, 1000)).save(webp, "WEBP", lossless=True)
    assert cost(webp.getvalue()) == 16_000_000 + strip


_PEAK = """
import io, json, sys
from imgret.images import decode_cost, decode_for_embedding
from PIL import Image
data = sys.stdin.buffer.read()
def kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the high-water mark to the current RSS
base = kib("VmRSS")
decode_for_embedding(data, size=224)
print(json.dumps({"peak": (kib("VmHWM") - base) * 1024,
                  "cost": decode_cost(Image.open(io.BytesIO(data)))}))
"""


@pytest.mark.parametrize("kind", ["png-rgb", "png-palette", "png-rgba", "png-16bit", "webp"])
def test_decode_cost_bounds_the_measured_peak(kind: str) -> None:
    """The memory bound of the service rests on this: a fresh process decodes one 12 M-pixel
    ratio bomb and its peak RSS growth stays under ``decode_cost`` (before the shrinking, a
    palette bomb cost 13.5 bytes per pixel and a 16-bit one 16)."""
    side = 3464
    image = {
        "png-rgb": lambda: Image.new("RGB", (side, side), (40, 90, 200)),
        "png-palette": lambda: Image.new("P", (side, side), 0),
        "png-rgba": lambda: Image.new("RGBA", (side, side), (1, 2, 3, 4)),
        "png-16bit": lambda: Image.new("I;16", (side, side), 40000),
        "webp": lambda: Image.new("RGB", (side, side), (9, 9, 9)),
    }[kind]()
    buffer = io.BytesIO()
    if kind == "webp":
        image.save(buffer, "WEBP", lossless=True)
    else:
        image.save(buffer, "PNG", **({"transparency": 0} if kind == "png-palette" else {}))
    result = subprocess.run([sys.executable, "-c", _PEAK], input=buffer.getvalue(),
                            capture_output=True, check=True, timeout=120)
    measured = json.loads(result.stdout)
    assert 0 < measured["peak"] <= measured["cost"], measured


# --------------------------------------------------------------------------- the gate


def test_gate_holds_back_a_decode_that_would_go_over_capacity() -> None:
    gate = DecodeGate(100)
    entered = threading.Event()

    def second() -> None:
        with gate.hold(50):
            entered.set()

    with gate.hold(60):
        thread = threading.Thread(target=second)
        thread.start()
        # 60 + 50 > 100: the second decode must not start while the first holds the gate.
        assert not entered.wait(0.2)
        assert gate.in_flight == 60
    thread.join(timeout=10)
    assert entered.is_set() and gate.in_flight == 0


def test_gate_lets_one_oversized_image_through_alone() -> None:
    gate = DecodeGate(10)
    with gate.hold(1000):
        assert gate.in_flight == 1000
    assert gate.in_flight == 0


def test_gate_is_one_per_process_and_capacity() -> None:
    assert decode_gate(123) is decode_gate(123) is DecodeLimits(decode_memory=123).gate
    assert decode_gate(123) is not decode_gate(124)


def test_settings_reach_the_limits_and_queue_must_hold_a_request() -> None:
    from pydantic import ValidationError

    from imgret.settings import Settings

    settings = Settings(max_request_pixels=7, decode_memory_mb=9, max_image_pixels=5)
    assert DecodeLimits.from_settings(settings) == DecodeLimits(5, 7, 9 * 1024 * 1024)
    with pytest.raises(ValidationError, match="IMGRET_BATCH_QUEUE_MAX"):
        Settings(batch_queue_max=8, search_batch_max_files=9)


def test_the_trimmer_counts_what_a_decode_allocated() -> None:
    """A small image that is not shrunk adds its pixels to the malloc_trim counter, not the
    gate's strip allowance (which made every third small query pay a trim of every arena);
    a shrunk one adds the strips too."""
    from imgret import images

    trimmer = images._TRIMMER
    if trimmer._trim is None:
        pytest.skip("malloc_trim is glibc's; this C library has none")
    small, large = photo(28, 28), photo(3000, 500)
    with trimmer._lock:
        trimmer._pending = 0
    decode_for_embedding(small, size=28)
    with trimmer._lock:
        assert trimmer._pending == 28 * 28 * 4  # RGB is held as 32-bit pixels
        trimmer._pending = 0
    decode_for_embedding(large, size=28)
    with trimmer._lock:
        assert trimmer._pending == 3000 * 500 * 4 + images._STRIP_BYTES
