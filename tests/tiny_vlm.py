"""The small vision-language model the vision tests share."""
import torch

from k3.vision.config import VisionConfig
from k3.vision.multimodal import K3ForConditionalGeneration
from two_layer_model import two_layer_config

PAD = 9  # <|media_pad|> in the bundled tokenizer


def make_tiny_vlm() -> K3ForConditionalGeneration:
    torch.manual_seed(0)
    m = K3ForConditionalGeneration(two_layer_config(), VisionConfig.preset("tiny"), PAD)
    m.language_model.reset_parameters(seed=1)
    m.reset_vision_parameters(seed=2)
    with torch.no_grad():  # a visible image signal (the default init is small)
        m.mm_projector.post_norm.weight.mul_(0.05)
    return m.eval()
