"""Procedural shape scenes: the data the embedded default model is trained and evaluated on.

Pure Python + PIL (no torch): ``make_scene(seed)`` is deterministic in the seed. A scene holds
1-3 shapes (circle, square, triangle) in six colours (with shade jitter) and two sizes, each in
its own column (left / centre / right) at a jittered height, on a white or light plain background,
square images of 64-256 pixels. Every scene carries its caption (shapes listed left to right) and
question-answer pairs in fixed English templates, e.g.

    s = make_scene(2)   # s.image (PIL), s.shapes, s.caption, s.qa
    s.caption           # 'a small red triangle and a large yellow square'
    s.qa[0]             # ('What color is the square?', 'yellow', 'color')
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional, Sequence, Tuple

from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle")
COLORS = ("red", "green", "blue", "yellow", "purple", "orange")
SIZES = ("small", "large")
NUMBER_WORDS = ("zero", "one", "two", "three")
QTYPES = ("color", "count", "exists", "left_shape", "size_color", "caption", "shape")

# Per-channel (lo, hi) ranges: the shade jitter of each colour. Ranges of different colours are
# disjoint in at least one channel by a wide margin, and hold the "pure" colours a user draws
# (255,0,0 red, 0,128,0 / 0,255,0 green, 0,0,255 blue, 255,255,0 yellow, 128,0,128 purple, ...).
COLOR_RANGES = {
    "red": ((190, 255), (0, 60), (0, 60)),
    "green": ((0, 80), (110, 255), (0, 90)),
    "blue": ((0, 60), (0, 110), (180, 255)),
    "yellow": ((220, 255), (200, 255), (0, 80)),
    "purple": ((110, 180), (0, 70), (120, 230)),
    "orange": ((230, 255), (110, 170), (0, 60)),
}
COLOR_RGB = {  # a canonical shade of each colour (for user-style drawings)
    "red": (230, 30, 30), "green": (40, 170, 50), "blue": (30, 60, 230),
    "yellow": (240, 220, 30), "purple": (145, 40, 175), "orange": (250, 140, 25),
}
# Radius (half the extent) as a fraction of the image side.
SIZE_RANGES = {"small": (0.065, 0.09), "large": (0.125, 0.155)}

TRAIN_SEED_START = 0
TEST_SEED_START = 10_000_000
train_seeds = range(TRAIN_SEED_START, TEST_SEED_START)
test_seeds = range(TEST_SEED_START, TEST_SEED_START + 1_000_000)

_SUPERSAMPLE = 2


class PlacedShape(NamedTuple):
    shape: str   # circle / square / triangle
    color: str   # one of COLORS
    size: str    # small / large
    x: float     # centre, pixels from the left
    y: float     # centre, pixels from the top


@dataclass
class Scene:
    image: Image.Image
    shapes: List[PlacedShape]                 # sorted left to right
    caption: str
    qa: List[Tuple[str, str, str]]            # (question, answer, qtype)
    seed: Optional[int] = None
    radii: List[float] = field(default_factory=list)        # pixels, parallel to shapes
    rgbs: List[Tuple[int, int, int]] = field(default_factory=list)
    background: Tuple[int, int, int] = (255, 255, 255)


# ----------------------------------------------------------------------------- drawing

def _polygon(shape: str, x: float, y: float, r: float):
    if shape == "square":
        h = 0.88 * r
        return [(x - h, y - h), (x + h, y - h), (x + h, y + h), (x - h, y + h)]
    if shape == "triangle":  # upright equilateral, its bounding box centred on (x, y)
        R = 1.12 * r
        cy = y + R / 4.0
        dx = R * 0.8660254
        return [(x, cy - R), (x + dx, cy + R / 2.0), (x - dx, cy + R / 2.0)]
    raise ValueError(shape)


def _draw(draw: ImageDraw.ImageDraw, shape: str, x: float, y: float, r: float, fill, k: float = 1.0):
    x, y, r = x * k, y * k, r * k
    if shape == "circle":
        draw.ellipse([x - r, y - r, x + r, y + r], fill=fill)
    elif shape in ("square", "triangle"):
        draw.polygon(_polygon(shape, x, y, r), fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")


def render(width: int, height: int, items: Sequence[Tuple[str, float, float, float, tuple]],
           background=(255, 255, 255)) -> Image.Image:
    """Draw ``items`` = (shape, x, y, r, rgb) on a plain background, antialiased by supersampling."""
    k = _SUPERSAMPLE
    img = Image.new("RGB", (width * k, height * k), tuple(background))
    d = ImageDraw.Draw(img)
    for shape, x, y, r, rgb in items:
        _draw(d, shape, x, y, r, tuple(rgb), k)
    return img.resize((width, height), Image.LANCZOS)


def label_mask(scene: Scene, size: int) -> Image.Image:
    """An ``L`` image of ``size`` x ``size``: 0 background, i+1 where shape i (left to right) is."""
    w, h = scene.image.size
    img = Image.new("L", (size, size), 0)
    d = ImageDraw.Draw(img)
    sx, sy = size / w, size / h
    for i, (p, r) in enumerate(zip(scene.shapes, scene.radii)):
        s = min(sx, sy)
        if p.shape == "circle":
            d.ellipse([p.x * sx - r * s, p.y * sy - r * s, p.x * sx + r * s, p.y * sy + r * s], fill=i + 1)
        else:
            d.polygon(_polygon(p.shape, p.x * sx, p.y * sy, r * s), fill=i + 1)
    return img


# ----------------------------------------------------------------------------- text

def _phrase(p: PlacedShape) -> str:
    return f"a {p.size} {p.color} {p.shape}"


def caption_for(shapes: Sequence[PlacedShape]) -> str:
    parts = [_phrase(p) for p in sorted(shapes, key=lambda p: p.x)]
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def questions_for(shapes: Sequence[PlacedShape], rng: Optional[random.Random] = None
                  ) -> List[Tuple[str, str, str]]:
    """All template questions that have an unambiguous answer for these shapes."""
    rng = rng or random.Random(0)
    shapes = sorted(shapes, key=lambda p: p.x)
    qa: List[Tuple[str, str, str]] = []
    kinds = [p.shape for p in shapes]
    for t in SHAPES:
        if kinds.count(t) == 1:
            qa.append((f"What color is the {t}?", shapes[kinds.index(t)].color, "color"))
    qa.append(("How many shapes are there?", NUMBER_WORDS[len(shapes)], "count"))
    present = [t for t in SHAPES if t in kinds]
    absent = [t for t in SHAPES if t not in kinds]
    qa.append((f"Is there a {rng.choice(present)}?", "yes", "exists"))
    if absent:
        qa.append((f"Is there a {rng.choice(absent)}?", "no", "exists"))
    qa.append(("What shape is on the left?", shapes[0].shape, "left_shape"))
    sizes = [p.size for p in shapes]
    for s in SIZES:
        if sizes.count(s) == 1:
            qa.append((f"What color is the {s} shape?", shapes[sizes.index(s)].color, "size_color"))
    qa.append(("Describe the image.", caption_for(shapes), "caption"))
    if len(shapes) == 1:
        qa.append(("What shape is this?", shapes[0].shape, "shape"))
    return qa


# ----------------------------------------------------------------------------- scenes

def _jitter_rgb(rng: random.Random, color: str) -> Tuple[int, int, int]:
    return tuple(rng.randint(lo, hi) for lo, hi in COLOR_RANGES[color])  # type: ignore[return-value]


def _background(rng: random.Random) -> Tuple[int, int, int]:
    if rng.random() < 0.5:
        return (255, 255, 255)
    return tuple(rng.randint(228, 255) for _ in range(3))  # type: ignore[return-value]


def make_scene(seed: int) -> Scene:
    """The scene of ``seed`` (deterministic). Train on ``train_seeds``, evaluate on ``test_seeds``."""
    rng = random.Random(seed * 7919 + 17)
    W = rng.randint(64, 256)
    n = rng.choices((1, 2, 3), weights=(0.3, 0.35, 0.35))[0]
    cols = sorted(rng.sample(range(3), n))
    free = n == 1 and rng.random() < 0.5     # a lone shape may sit anywhere
    placed, radii, rgbs = [], [], []
    for c in cols:
        shape = rng.choice(SHAPES)
        color = rng.choice(COLORS)
        size = rng.choice(SIZES)
        lo, hi = SIZE_RANGES[size]
        if free and size == "large":
            hi = 0.3                          # a lone shape may also be much bigger
        r = W * rng.uniform(lo, hi)
        margin = 0.03 * W
        if free:
            x = rng.uniform(r + margin, W - r - margin)
        else:
            cx = (c + 0.5) * W / 3.0
            jit = max(0.0, W / 6.0 - r - 0.012 * W)
            x = cx + rng.uniform(-jit, jit)
        y = rng.uniform(r + margin + 0.1 * r, W - r - margin)
        placed.append(PlacedShape(shape, color, size, x, y))
        radii.append(r)
        rgbs.append(_jitter_rgb(rng, color))
    bg = _background(rng)
    image = render(W, W, [(p.shape, p.x, p.y, r, rgb) for p, r, rgb in zip(placed, radii, rgbs)], bg)
    return Scene(image=image, shapes=placed, caption=caption_for(placed),
                 qa=questions_for(placed, rng), seed=seed, radii=radii, rgbs=rgbs, background=bg)


def draw_shape(shape: str = "circle", color="red", image_size=(200, 200), center=None,
               radius: Optional[float] = None, background=(255, 255, 255)) -> Image.Image:
    """A user-style drawing: one shape on a plain background, any size and position.

    ``color`` is a colour name or an RGB tuple; ``center`` defaults to the image centre and
    ``radius`` to a fifth of the shorter side.
    """
    w, h = image_size
    rgb = COLOR_RGB[color] if isinstance(color, str) else tuple(color)
    cx, cy = center if center is not None else (w / 2.0, h / 2.0)
    r = radius if radius is not None else min(w, h) / 5.0
    return render(w, h, [(shape, cx, cy, r, rgb)], background)


def held_out_scenes(n: int, start: int = 0) -> List[Scene]:
    """The first ``n`` held-out scenes (after skipping ``start``)."""
    return [make_scene(s) for s in test_seeds[start:start + n]]


__all__ = ["Scene", "PlacedShape", "make_scene", "draw_shape", "caption_for", "questions_for",
           "label_mask", "render", "train_seeds", "test_seeds", "held_out_scenes",
           "SHAPES", "COLORS", "SIZES", "QTYPES"]
