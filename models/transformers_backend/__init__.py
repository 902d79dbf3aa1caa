"""The transformers backend (`model_impl="transformers"`): transformers' own modules on mmkit's
engine, with mmkit's paged attention plugged in through transformers' AttentionInterface.

- qualify.py: which checkpoints qualify, decided from the config before weights load;
- attention.py: the "mmkit_paged" attention function;
- model.py: `TransformersBackendModel`, the runner's interface over the model's own methods.
The input side is `mmkit.processors.transformers_backend.TransformersInputProcessor`.
"""

from mmkit.models.transformers_backend.model import TransformersBackendModel
from mmkit.models.transformers_backend.qualify import BackendUnsupportedError, check_backend_supports

__all__ = ["TransformersBackendModel", "BackendUnsupportedError", "check_backend_supports"]
