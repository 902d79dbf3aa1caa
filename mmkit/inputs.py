"""Old import path of the prompt forms and their parser: `mmkit.multimodal.parse` (and
`mmkit.multimodal.items` for `ImageItem`) since the input stage became one package."""

from mmkit.multimodal.items import MAX_IMAGE_PIXELS, ImageItem, check_image_size
from mmkit.multimodal.parse import (MultiModalData, ParsedPrompt, PromptInputs, TextPrompt, TokensPrompt,
                                    decode_images, multi_modal_from_dict, parse_images, parse_inputs,
                                    parse_prompt)

__all__ = ["MAX_IMAGE_PIXELS", "ImageItem", "check_image_size", "MultiModalData", "ParsedPrompt", "PromptInputs",
           "TextPrompt", "TokensPrompt", "decode_images", "multi_modal_from_dict", "parse_images", "parse_inputs",
           "parse_prompt"]
