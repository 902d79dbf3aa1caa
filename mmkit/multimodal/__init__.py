"""The multimodal input stage, in one package.

- `items.py`: the `MultiModalItem` protocol every modality implements (modality, processor
  options, layout, `content_hash()`) and `ImageItem`;
- `parse.py`: the user's prompt forms (`MultiModalData`, `TextPrompt`, ...) parsed and validated
  into `ParsedPrompt`s; `video.py`: a prompt's videos as frames;
- `image_io.py` / `video_io.py`: reading images and videos from paths, URLs and bytes;
  `media_fetch.py`: where they may come from and the download limits (`MediaConnector`);
- `modalities.py`: the one refusal of a modality a processor does not declare;
- `hashing.py`: items' content hashes;
- `legacy.py`: the old `prompts=` / `prompt_token_ids=` / `multi_modal_data=` keyword arguments;
- `prefetcher.py` and `stage.py`: the per-item processor work on worker threads, ahead of the
  scheduler; the engine builds the stage and gives it to the scheduler and the runner.
"""

from mmkit.multimodal.items import ImageItem, MultiModalItem
from mmkit.multimodal.modalities import check_supported_modalities, prompt_modalities, supported_modalities
from mmkit.multimodal.parse import ParsedPrompt, parse_inputs, parse_prompt

__all__ = ["ImageItem", "MultiModalItem", "ParsedPrompt", "parse_inputs", "parse_prompt",
           "check_supported_modalities", "prompt_modalities", "supported_modalities"]
