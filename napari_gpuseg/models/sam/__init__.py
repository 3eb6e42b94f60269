"""Pure-torch SAM family: ViT-B/L/H, MobileSAM (vit_t) and LiteMedSAM, official weights."""
from .attention import ATTN_IMPLS, get_default_attn_impl, set_attn_impl, set_default_attn_impl
from .build import ARCHS, DEFAULT_IMAGE_SIZE, build_sam, infer_arch, infer_image_size, load_sam
from .common import LayerNorm2d, MLPBlock
from .image_encoder import ImageEncoderViT
from .mask_decoder import MaskDecoder
from .prompt_encoder import PromptEncoder
from .sam import SAM_PIXEL_MEAN, SAM_PIXEL_STD, Sam
from .tiny_vit import TinyViT
from .transformer import TwoWayTransformer

__all__ = [
    "ARCHS",
    "ATTN_IMPLS",
    "DEFAULT_IMAGE_SIZE",
    "ImageEncoderViT",
    "LayerNorm2d",
    "MLPBlock",
    "MaskDecoder",
    "PromptEncoder",
    "SAM_PIXEL_MEAN",
    "SAM_PIXEL_STD",
    "Sam",
    "TinyViT",
    "TwoWayTransformer",
    "build_sam",
    "get_default_attn_impl",
    "infer_arch",
    "infer_image_size",
    "load_sam",
    "set_attn_impl",
    "set_default_attn_impl",
]
