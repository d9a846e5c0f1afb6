"""The synthetic scenes for `k3 train --task vision`: the held-out split really holds out its colour-shape
combinations, images show what the scene says, and training rows supervise exactly the answers."""
import random

import numpy as np

from k3.data import Tokenizer
from k3.vision import synthetic as syn
from k3.vision.config import VisionConfig
from k3.vision.train_vision import Examples


def test_held_out_combinations_never_appear_in_training_scenes():
    rng = random.Random(0)
    train = [syn.sample_scene(rng, "train") for _ in range(600)]
    held = [syn.sample_scene(rng, "heldout") for _ in range(200)]
    seen = {(o.colour, o.shape) for s in train for o in s.objects}
    assert not seen & syn.HELD_OUT
    assert all((o := s.objects[syn.held_out_object(s)]) and (o.colour, o.shape) in syn.HELD_OUT for s in held)
    # every colour and every shape is still seen in training (only the pairing is new)
    assert {c for c, _ in seen} == set(syn.COLOURS) and {s for _, s in seen} == set(syn.SHAPES)


def test_rendered_image_shows_the_scene():
    rng = random.Random(1)
    for _ in range(20):
        scene = syn.sample_scene(rng, "train")
        img = np.asarray(syn.render(scene, rng)).astype(int)
        assert img.shape == (syn.HEIGHT, syn.WIDTH, 3)
        for o in scene.objects:
            x0 = 0 if o.side == "left" else syn.CELL
            cell = img[:, x0:x0 + syn.CELL]
            counts = {c: int((np.abs(cell - np.array(rgb)).max(-1) <= 25).sum()) for c, rgb in syn.COLOURS.items()}
            assert max(counts, key=counts.get) == o.colour and counts[o.colour] >= 40
            assert (np.abs(cell[:, :, None] - np.array(list(syn.COLOURS.values()))).max(-1) <= 25).any(-1).sum() \
                == counts[o.colour]  # nothing else coloured in the object's cell
            # the grey outline encloses the fill: its bounding box holds every fill pixel
            fill = np.argwhere(np.abs(cell - np.array(syn.COLOURS[o.colour])).max(-1) <= 25)
            outline = np.argwhere((cell == syn.OUTLINE).all(-1))
            assert len(outline) >= 30
            assert (outline.min(0) < fill.min(0)).all() and (outline.max(0) > fill.max(0)).all()
        digit_cell = img[:, 2 * syn.CELL:]
        assert (digit_cell.min(-1) > 200).sum() >= 2 * 10 * 3  # the digit's white segments (at least two of them)
        assert (img[:, :2 * syn.CELL].min(-1) > 200).sum() == 0  # and nothing white in the object cells


def test_outline_is_the_same_whatever_the_fill_colour():
    # the shape cue that lets a never-seen colour-shape pair be recognised: identical outline pixels for every colour
    for shape in syn.SHAPES:
        masks = []
        for colour in syn.COLOURS:
            scene = syn.Scene((syn.SceneObject(colour, shape, "left"), syn.SceneObject("red", "square", "right")), 3)
            img = np.asarray(syn.render(scene, random.Random(5)))[:, :syn.CELL]
            masks.append((img == syn.OUTLINE).all(-1))
        assert masks[0].sum() >= 30 and all((m == masks[0]).all() for m in masks)
    # and the shapes' outlines differ from one another
    outlines = {}
    for shape in syn.SHAPES:
        scene = syn.Scene((syn.SceneObject("blue", shape, "left"), syn.SceneObject("red", "square", "right")), 3)
        outlines[shape] = (np.asarray(syn.render(scene, random.Random(5)))[:, :syn.CELL] == syn.OUTLINE).all(-1)
    assert all((outlines[a] != outlines[b]).any() for a in syn.SHAPES for b in syn.SHAPES if a < b)


def test_training_rows_supervise_only_the_answers():
    tok = Tokenizer.from_file()
    ex = Examples(tok, VisionConfig.preset("tiny"))
    rng = random.Random(2)
    scene = syn.sample_scene(rng, "train")
    from k3.vision.preprocess import preprocess_image
    im = preprocess_image(syn.render(scene, rng), VisionConfig.preset("tiny"))
    qas = [syn.question(scene, "colour_of_shape", 0), syn.question(scene, "digit")]
    b = ex.batch([(im, qas)])
    targets = b["labels"][0][b["labels"][0] != -100].tolist()
    want = [t for _, a in qas for t in tok.encode(" " + a) + [tok.eos_id]]
    assert targets == want
    assert int((b["input_ids"] == tok.special_tokens["<|media_pad|>"]).sum()) == im.num_tokens == 3  # one merged token per cell
