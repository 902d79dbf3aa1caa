"""mmkit as an lmms-eval model (`--model mmkit`); needs the `lmms-eval` extra.

lmms-eval finds it through the `lmms_eval.models` entry point in mmkit's pyproject.toml,
which names `manifest`: a simple class only, so `multiple_choice` (log-likelihood) tasks
reach it without `--force_simple`.
"""

from __future__ import annotations


def manifest():
    """The `ModelManifest` lmms-eval registers for `--model mmkit`."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id="mmkit", simple_class_path="mmkit.entrypoints.lmms.model.MMKit")
