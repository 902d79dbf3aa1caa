"""The multimodal input stage: what a prompt's items are and which modalities a processor takes."""

from mmkit.multimodal.modalities import check_supported_modalities, prompt_modalities, supported_modalities

__all__ = ["check_supported_modalities", "prompt_modalities", "supported_modalities"]
