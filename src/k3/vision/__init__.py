"""Native vision for k3 (SPEC §7): image preprocessing, the MoonViT-V2 tower, the patch-merger projector and
K3ForConditionalGeneration, which splices projected image rows into the text model's embeddings."""
from k3.vision.config import VisionConfig
from k3.vision.preprocess import ImageError, ImageInput, load_image, num_image_tokens, preprocess_image

__all__ = ["VisionConfig", "ImageError", "ImageInput", "load_image", "num_image_tokens", "preprocess_image"]
