"""The small vision-language model the vision tests share."""
import torch

from k3 import K3Config
from k3.vision.config import VisionConfig
from k3.vision.multimodal import K3ForConditionalGeneration

PAD = 9  # <|media_pad|> in the bundled tokenizer


def tiny_text() -> K3Config:
    return K3Config.preset("tiny").replace(num_hidden_layers=2, attn_res_block_size=1,
                                           linear_attn_config={"full_attn_layers": [2], "kda_layers": [1]})


def make_tiny_vlm() -> K3ForConditionalGeneration:
    torch.manual_seed(0)
    m = K3ForConditionalGeneration(tiny_text(), VisionConfig.preset("tiny"), PAD)
    m.language_model.reset_parameters(seed=1)
    m.reset_vision_parameters(seed=2)
    with torch.no_grad():  # a visible image signal (the default init is small)
        m.mm_projector.post_norm.weight.mul_(0.05)
    return m.eval()
