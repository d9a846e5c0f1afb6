"""The tiny vision-language training loop: the answer-only loss with shared image encodings equals the model's
own loss on ordinary rows, the blind baselines are what their definition says, and a very easy variant
(name the colour of a plain image) is learned within a few dozen CPU steps."""
import random

import torch
import torch.nn.functional as F
from PIL import Image

from k3.data import Tokenizer
from k3.vision import synthetic as syn
from k3.vision.preprocess import preprocess_image
from k3.vision.train_vision import Examples, VisionTrainConfig, accuracy, answer_logits, answer_loss, blind_baselines, \
    build_tiny_vlm, centre_projector, shared_row_fraction, train_batch


def test_shared_image_answer_loss_equals_full_model_loss():
    torch.manual_seed(0)
    tok = Tokenizer.from_file()
    model = build_tiny_vlm(tok, 2).double()
    ex = Examples(tok, model.vision_config)
    shared = train_batch(random.Random(3), ex, n_images=3, per_image=3)
    # reference: every row carries its own copy of its image, full logits, the model's own masked loss
    per_row_pixels = torch.cat([shared["pixel_values"].view(3, -1, 3, 14, 14)[i // 3] for i in range(9)])
    ref = model(shared["input_ids"], per_row_pixels.double(), shared["grid_thws"].repeat_interleave(3, 0),
                labels=shared["labels"], mask=shared["mask"]).loss
    b = {**shared, "pixel_values": shared["pixel_values"].double()}
    assert torch.allclose(answer_loss(model, b), ref, rtol=1e-10, atol=1e-10)
    # the rows asking about one image really share it: 3 questions per image, 3 merged tokens per image
    assert shared["image_index"].tolist() == [t for i in range(3) for _ in range(3) for t in range(3 * i, 3 * i + 3)]


def test_blind_baselines_match_their_definition():
    blind = blind_baselines(seed=0, n=4000)
    # never seen pairings: a model answering from the question alone can never be right on the held-out split
    assert blind["heldout"] == {"colour_of_shape": 0.0, "shape_of_colour": 0.0}
    # in distribution: best of the 4-5 colours trained with a shape, of the 3 shapes trained with a colour, 2 sides
    assert 0.18 < blind["in_distribution"]["colour_of_shape"] < 0.3
    assert 0.3 < blind["in_distribution"]["shape_of_colour"] < 0.42
    assert 0.45 < blind["in_distribution"]["side_of_shape"] < 0.55


def test_tiny_vlm_learns_to_name_the_colour_of_a_plain_image():
    torch.manual_seed(0)
    tok = Tokenizer.from_file()
    model = build_tiny_vlm(tok, 1, full_attention=True)
    model.language_model.reset_parameters(seed=0)
    model.reset_vision_parameters(seed=0)
    ex = Examples(tok, model.vision_config)
    rng = random.Random(0)
    colours = sorted(syn.COLOURS)

    def item():
        c = rng.choice(colours)
        return preprocess_image(Image.new("RGB", (28, 28), syn.COLOURS[c]), model.vision_config), \
            [("what colour is it?", c)]

    held = [item() for _ in range(60)]
    before = accuracy(model, ex, held)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(40):
        logits, targets = answer_logits(model, ex.batch([item() for _ in range(24)]))
        loss = F.cross_entropy(logits, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = accuracy(model, ex, held)
    # six colours: chance is 1/6 and a text-only model cannot beat it; reading the image gets most of them within 40 steps
    assert before < 0.4 and after >= 0.6


def test_shared_row_fraction_is_the_mean_rows_share_of_the_energy():
    v = torch.randn(1, 16, dtype=torch.float64)
    assert torch.allclose(shared_row_fraction(v.repeat(5, 1)), torch.tensor(1.0, dtype=torch.float64))
    assert shared_row_fraction(torch.cat([v, -v])).item() < 1e-12
    rows = torch.randn(7, 16, dtype=torch.float64)
    ref = (rows.sum(0) / 7).norm() ** 2 / (rows.norm(dim=1) ** 2).mean()
    assert torch.allclose(shared_row_fraction(rows), ref)


def test_centre_projector_removes_the_shared_row_and_keeps_the_projector_formula():
    torch.manual_seed(0)
    tok = Tokenizer.from_file()
    model = build_tiny_vlm(tok, 1)
    model.reset_vision_parameters(seed=0)
    b = train_batch(random.Random(1), Examples(tok, model.vision_config), n_images=24, per_image=1)
    before = model.encode_images(b["pixel_values"], b["grid_thws"]).detach()
    centre_projector(model, b["pixel_values"], b["grid_thws"])
    after = model.encode_images(b["pixel_values"], b["grid_thws"]).detach()
    # at init most of every row is one vector shared by all images; afterwards almost none of it is
    assert shared_row_fraction(before) > 0.5 and shared_row_fraction(after) < 0.05
    # still the SPEC projector: RMSNorm'd rows (norm sqrt(D) with unit weight, less the eps = 1e-5 against a
    # mean square ~1e-3 before the norm), and the rows still differ by image
    D = after.shape[1]
    assert torch.allclose(after.norm(dim=1), torch.full((after.shape[0],), D ** 0.5), rtol=2e-2)
    assert (after - after.mean(0)).norm(dim=1).mean() > 0.9 * D ** 0.5


def test_config_rejects_bad_centring_weight():
    for bad in (-1.0, float("nan"), "x"):
        try:
            VisionTrainConfig(centring_weight=bad).validate()
        except ValueError as e:
            assert "--centring-weight" in str(e)
        else:
            raise AssertionError(f"centring_weight={bad!r} was accepted")
