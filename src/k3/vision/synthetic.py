"""A bundled generator of synthetic scenes for training a tiny vision-language model on CPU: two coloured
shapes (left and right) and a seven-segment digit, all drawn by code, with captions and questions generated
from the scene description. A held-out split keeps some colour-shape combinations out of training entirely,
so held-out accuracy measures whether the model binds colour to shape rather than memorising pairs."""
from __future__ import annotations

import random
from dataclasses import dataclass

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (50, 90, 230), "yellow": (230, 210, 40),
           "purple": (150, 60, 190), "orange": (240, 140, 30)}
SHAPES = ("circle", "square", "triangle", "cross")
# One combination held out per colour; every shape is held out for some colour and seen with the others.
HELD_OUT = frozenset({("red", "circle"), ("green", "square"), ("blue", "triangle"), ("yellow", "cross"),
                      ("purple", "circle"), ("orange", "square")})
SIDES = ("left", "right")
# Three 28×28 cells side by side: left object, right object, digit. 28 px is one merged image token
# (2×2 patches of 14 px), so each object is exactly one token of the text model's input: the question
# only has to pick the right token, which a tiny text model learns in minutes on CPU.
WIDTH, HEIGHT, CELL = 84, 28, 28
BACKGROUND = (24, 24, 24)
# Every object gets the same grey outline: a shape cue that does not depend on the fill colour. Without it the
# tiny tower reads shape only through coloured pixels (a patch embedding of a filled shape is mask × colour),
# learns one shape detector per colour seen in training, and cannot find a red circle it never saw.
OUTLINE, OUTLINE_WIDTH = (150, 150, 150), 2
# seven-segment layout: a top, b top-right, c bottom-right, d bottom, e bottom-left, f top-left, g middle
_SEGMENTS = {0: "abcdef", 1: "bc", 2: "abged", 3: "abgcd", 4: "fgbc", 5: "afgcd", 6: "afgedc", 7: "abc",
             8: "abcdefg", 9: "abcdfg"}


@dataclass(frozen=True)
class SceneObject:
    colour: str
    shape: str
    side: str


@dataclass(frozen=True)
class Scene:
    objects: tuple[SceneObject, SceneObject]
    digit: int

    def caption(self) -> str:
        a, b = self.objects
        return f"a {a.colour} {a.shape} on the {a.side}, a {b.colour} {b.shape} on the {b.side}, digit {self.digit}"

    def has_held_out(self) -> bool:
        return any((o.colour, o.shape) in HELD_OUT for o in self.objects)


def sample_scene(rng: random.Random, split: str) -> Scene:
    """split "train": no held-out combination appears; "heldout": at least one object is a held-out combination."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    while True:
        colours = rng.sample(sorted(COLOURS), 2)
        shapes = rng.sample(SHAPES, 2)
        sides = rng.sample(SIDES, 2)
        scene = Scene(tuple(SceneObject(c, s, d) for c, s, d in zip(colours, shapes, sides)), rng.randrange(10))
        if scene.has_held_out() == (split == "heldout"):
            return scene


def render(scene: Scene, rng: random.Random):
    """The scene as an 84×28 RGB PIL image (size, position and colour jittered; objects outlined in grey)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (WIDTH, HEIGHT), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for o in scene.objects:
        x0 = 0 if o.side == "left" else CELL
        r = rng.randint(8, 11)
        cx, cy = x0 + CELL // 2 + rng.randint(-2, 2), CELL // 2 + rng.randint(-2, 2)
        colour = tuple(max(0, min(255, v + rng.randint(-20, 20))) for v in COLOURS[o.colour])
        style = {"fill": colour, "outline": OUTLINE, "width": OUTLINE_WIDTH}
        if o.shape == "circle":
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], **style)
        elif o.shape == "square":
            draw.rectangle([cx - r, cy - r, cx + r, cy + r], **style)
        elif o.shape == "triangle":
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], **style)
        else:  # one polygon, so the outline is the cross's boundary only
            t = max(3, r // 3)
            draw.polygon([(cx - t, cy - r), (cx + t, cy - r), (cx + t, cy - t), (cx + r, cy - t), (cx + r, cy + t),
                          (cx + t, cy + t), (cx + t, cy + r), (cx - t, cy + r), (cx - t, cy + t), (cx - r, cy + t),
                          (cx - r, cy - t), (cx - t, cy - t)], **style)
    _draw_digit(draw, scene.digit, 2 * CELL + CELL // 2 + rng.randint(-4, 4), CELL // 2 + rng.randint(-2, 2))
    return img


def _draw_digit(draw, digit: int, cx: int, cy: int, w: int = 10, h: int = 20, t: int = 3) -> None:
    x0, y0 = cx - w // 2, cy - h // 2
    segs = {"a": (x0, y0, x0 + w, y0 + t), "d": (x0, y0 + h - t, x0 + w, y0 + h),
            "g": (x0, y0 + h // 2 - t // 2, x0 + w, y0 + h // 2 + t // 2 + 1),
            "f": (x0, y0, x0 + t, y0 + h // 2), "b": (x0 + w - t, y0, x0 + w, y0 + h // 2),
            "e": (x0, y0 + h // 2, x0 + t, y0 + h), "c": (x0 + w - t, y0 + h // 2, x0 + w, y0 + h)}
    for s in _SEGMENTS[digit]:
        draw.rectangle(segs[s], fill=(245, 245, 245))


QUESTION_KINDS = ("colour_of_shape", "shape_of_colour", "side_of_shape", "digit", "caption")


def question(scene: Scene, kind: str, obj: int = 0) -> tuple[str, str]:
    """(question, answer) about scene.objects[obj] (or the digit / the whole scene)."""
    o = scene.objects[obj]
    if kind == "colour_of_shape":
        return f"what colour is the {o.shape}?", o.colour
    if kind == "shape_of_colour":
        return f"what shape is {o.colour}?", o.shape
    if kind == "side_of_shape":
        return f"where is the {o.shape}?", o.side
    if kind == "digit":
        return "what digit is shown?", str(scene.digit)
    if kind == "caption":
        return "describe the image.", scene.caption()
    raise ValueError(f"kind must be one of {', '.join(QUESTION_KINDS)}, got {kind!r}")


def held_out_object(scene: Scene) -> int:
    """Index of the (first) object of a held-out scene whose colour-shape combination was never trained on."""
    for i, o in enumerate(scene.objects):
        if (o.colour, o.shape) in HELD_OUT:
            return i
    raise ValueError("scene has no held-out object")
