"""The glyph set's distortions: what varies inside a class besides the face.

A seeded draw per image (:func:`draw_distortions`: the parameters of :data:`DISTORTIONS`, a
coarse elastic field, pixel noise) and :func:`distort`, which applies a batch of them to drawn
glyphs (stroke weight, affine map, elastic warp, blur, ink level, noise) with elementwise numpy
only, so that every pixel is the same on every CPU (``imgret.training.data.glyphs``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

IMAGE_SIZE = 32
# Drawn and distorted at twice the size, then box-averaged: anti-aliased strokes.
SUPERSAMPLE = 2


# The ranges the distortions are drawn from (uniform), in output pixels where a length.
DISTORTIONS: dict[str, tuple[float, float]] = {
    "rotation_deg": (-12.0, 12.0),
    "shear": (-0.2, 0.2),
    "scale": (0.85, 1.08),
    "log_aspect": (-0.1, 0.1),
    "shift_x_px": (-2.0, 2.0),
    "shift_y_px": (-2.0, 2.0),
    # 0 = eroded (grey min filter 3 x 3), 1 = as drawn, 2 = dilated (max filter 3 x 3);
    # above 0.5, so that the thin faces (ming, kiloji) keep every stroke.
    "stroke_weight": (0.6, 1.9),
    "elastic_px": (0.0, 1.2),
    "blur_sigma_px": (0.0, 0.7),
    "ink": (0.75, 1.0),
    "noise_std": (0.0, 0.06),
}
_DISTORTION_BOUNDS = (np.array([low for low, _ in DISTORTIONS.values()]),
                      np.array([high for _, high in DISTORTIONS.values()]))
# Control points per side of the elastic displacement field (smoothly interpolated).
ELASTIC_GRID = 4


def draw_distortions(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The next distortion's draws, in a fixed order: the uniform parameters of
    :data:`DISTORTIONS`, the 2 x 4 x 4 coarse displacements, the 32 x 32 noise."""
    return (rng.uniform(*_DISTORTION_BOUNDS),
            rng.standard_normal((2, ELASTIC_GRID, ELASTIC_GRID)),
            rng.standard_normal((IMAGE_SIZE, IMAGE_SIZE)))


def distort(levels: np.ndarray, which: np.ndarray,
            draws: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> np.ndarray:
    """Distorted 32 px images of drawn glyphs, all at once (numpy, elementwise only).

    Stroke weight blends the glyph's morphology levels; the affine map (rotation, shear,
    anisotropic scale about the centre, shift) plus a smooth displacement field (the coarse
    one spread by a Gaussian kernel: elastic warp) say where each output pixel samples the
    2 x 2 box-filtered working image (bilinear, ink 0 outside): supersampled by 2, so strokes
    stay anti-aliased. Then a Gaussian blur (5 taps), the brightest pixel scaled to the ink
    level, and Gaussian noise.

    Only elementwise numpy operations and ``math`` on scalars: no BLAS, whose summation order
    varies with the CPU.

    Args:
        levels: ``(m, 3, 64, 64)`` float32 morphology levels (:func:`stroke_levels`).
        which: ``(n,)`` the level stack each image distorts.
        draws: ``n`` draws (:func:`draw_distortions`), one per image.

    Returns:
        ``(n, 32, 32)`` uint8.
    """
    side, out = levels.shape[-1], IMAGE_SIZE
    uniform, coarse, noise = (np.stack(part) for part in zip(*draws, strict=True))
    p = {name: uniform[:, k] for k, name in enumerate(DISTORTIONS)}
    # Stroke weight: between morphology levels floor(w) and floor(w) + 1.
    weight = p["stroke_weight"]
    low = np.minimum(np.floor(weight).astype(np.int64), levels.shape[1] - 2)
    t = (weight - low).astype(np.float32)[:, None, None]
    image = (1 - t) * levels[which, low] + t * levels[which, low + 1]
    # Output pixel centres in working-pixel units about the centre; sampling the 2 x 2 box
    # filter at (q - 0.5) averages the 4 working pixels under an output pixel.
    grid = np.arange(out) * SUPERSAMPLE + 0.5 - (side - 1) / 2.0
    qx = grid[None, None, :] - (p["shift_x_px"] * SUPERSAMPLE)[:, None, None]
    qy = grid[None, :, None] - (p["shift_y_px"] * SUPERSAMPLE)[:, None, None]
    inverse = np.array([_inverse_affine(*row) for row in zip(
        p["rotation_deg"], p["shear"], p["scale"], p["log_aspect"], strict=True)])
    x = inverse[:, 0, 0, None, None] * qx + inverse[:, 0, 1, None, None] * qy
    y = inverse[:, 1, 0, None, None] * qx + inverse[:, 1, 1, None, None] * qy
    smooth = _field_smoothing()  # (32, 4): field = smooth @ coarse @ smooth.T, summed in order
    spread = sum(smooth[None, None, :, k, None] * coarse[:, :, None, k, :]
                 for k in range(ELASTIC_GRID))  # (n, 2, 32, 4)
    field = sum(spread[:, :, :, k, None] * smooth[None, None, None, :, k]
                for k in range(ELASTIC_GRID))  # (n, 2, 32, 32)
    amplitude = (p["elastic_px"] * SUPERSAMPLE)[:, None, None]
    x = x + (side - 1) / 2.0 - 0.5 + field[:, 0] * amplitude
    y = y + (side - 1) / 2.0 - 0.5 + field[:, 1] * amplitude
    image = _bilinear(_box2(image), x, y)
    image = _blur(image, p["blur_sigma_px"])
    # The brightest pixel becomes the ink level: a thin face, eroded and blurred, stays
    # visible (it would otherwise fade to a few grey levels).
    peak = np.maximum(image.max(axis=(1, 2)), 1.0)
    image = image * (p["ink"] * 255.0 / peak)[:, None, None] + noise * (
        p["noise_std"] * 255.0)[:, None, None]
    return np.clip(np.rint(image), 0, 255).astype(np.uint8)


def _inverse_affine(rotation_deg: float, shear: float, scale: float, log_aspect: float
                    ) -> list[list[float]]:
    """The inverse of rotation . shear . diag(scale * aspect, scale / aspect), on (x, y)."""
    theta = math.radians(rotation_deg)
    cos, sin = math.cos(theta), math.sin(theta)
    sx, sy = scale * math.exp(log_aspect), scale / math.exp(log_aspect)
    # forward = [[cos, -sin], [sin, cos]] @ [[1, shear], [0, 1]] @ diag(sx, sy)
    a, b = cos * sx, (cos * shear - sin) * sy
    c, d = sin * sx, (sin * shear + cos) * sy
    det = a * d - b * c
    return [[d / det, -b / det], [-c / det, a / det]]


def stroke_levels(drawn: np.ndarray) -> np.ndarray:
    """``(m, 3, 64, 64)`` float32 in 0..255 of ``(m, 64, 64)`` drawn glyphs: eroded (grey
    min filter 3 x 3), as drawn, dilated (max filter 3 x 3): the stroke weights 0, 1, 2."""
    padded = np.pad(drawn, ((0, 0), (1, 1), (1, 1)))
    h, w = drawn.shape[1:]

    def rank(pick: Any) -> np.ndarray:  # separable 3 x 3 min / max
        rows = pick(pick(padded[:, :, :-2], padded[:, :, 1:-1]), padded[:, :, 2:])
        return pick(pick(rows[:, :-2], rows[:, 1:-1]), rows[:, 2:])[:, :h, :w]

    return np.stack([rank(np.minimum), drawn, rank(np.maximum)], axis=1).astype(np.float32)


def _box2(image: np.ndarray) -> np.ndarray:
    """The 2 x 2 box filter, ``(n, h, w)`` -> ``(n, h, w)`` (the last row / column use 0
    beyond the edge): pixel ``k`` is the mean of pixels ``k`` and ``k + 1`` on each axis."""
    padded = np.pad(image, ((0, 0), (0, 1), (0, 1)))
    return 0.25 * (padded[:, :-1, :-1] + padded[:, 1:, :-1] + padded[:, :-1, 1:]
                   + padded[:, 1:, 1:])


def _bilinear(image: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``image`` ``(n, h, w)`` sampled at ``(x, y)`` ``(n, H, W)`` (pixel-index units),
    bilinear, 0 outside."""
    n, h, w = image.shape
    padded = np.pad(image, ((0, 0), (1, 1), (1, 1))).reshape(n, -1)
    x0, y0 = np.floor(x), np.floor(y)
    fx, fy = (x - x0).astype(np.float32), (y - y0).astype(np.float32)
    # Index + 1 into the zero-padded image; anything beyond the border lands on the border.
    cols = [np.clip(x0 + 1 + k, 0, w + 1).astype(np.int64) for k in (0, 1)]
    rows = [np.clip(y0 + 1 + k, 0, h + 1).astype(np.int64) * (w + 2) for k in (0, 1)]
    flat = padded.reshape(n, -1)
    taps = [np.take_along_axis(flat, (r + c).reshape(n, -1), axis=1).reshape(x.shape)
            for r in rows for c in cols]
    return ((1 - fy) * ((1 - fx) * taps[0] + fx * taps[1])
            + fy * ((1 - fx) * taps[2] + fx * taps[3]))


def _blur(image: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    """Separable Gaussian blur, 5 taps, one sigma per image (0 outside the image)."""
    weights = np.array([[math.exp(-0.5 * (k / max(s, 1e-3)) ** 2) for k in range(-2, 3)]
                        for s in sigma], dtype=np.float32)
    weights /= weights.sum(axis=1, keepdims=True)
    for axis in (1, 2):
        padding = [(0, 0), (0, 0), (0, 0)]
        padding[axis] = (2, 2)
        padded = np.pad(image, padding)
        size = image.shape[axis]
        image = sum(weights[:, k, None, None] * np.take(padded, range(k, k + size), axis=axis)
                    for k in range(5))
    return image


@functools.cache
def _field_smoothing() -> np.ndarray:
    """``(32, ELASTIC_GRID)`` weights that spread the coarse random displacements over the
    output pixels smoothly (Gaussian kernel, rows summing to 1)."""
    pixels = (np.arange(IMAGE_SIZE)[:, None] + 0.5) / IMAGE_SIZE
    controls = (np.arange(ELASTIC_GRID)[None, :] + 0.5) / ELASTIC_GRID
    weights = np.exp(-0.5 * ((pixels - controls) * ELASTIC_GRID) ** 2)
    return weights / weights.sum(axis=1, keepdims=True)
