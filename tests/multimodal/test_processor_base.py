"""processors/base.py's BaseInputProcessor: what every family's processor shares (options checked
against the family's declared rules, per-prompt item limits), tested without a checkpoint."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mmkit.multimodal.parse import parse_prompt
from mmkit.processors.base import BaseInputProcessor
from mmkit.processors.mm_kwargs import BOOL, POSITIVE_INT

CONFIG = SimpleNamespace(architecture="TinyForConditionalGeneration", vocab_size=100)


class WithOptions(BaseInputProcessor):
    supported_modalities = ("image", "video")
    mm_processor_rules = {"max_tiles": POSITIVE_INT, "crop": BOOL}
    mm_processor_example = "{'max_tiles': 4}"


def test_a_family_without_options_refuses_any_naming_itself():
    with pytest.raises(ValueError, match=r"mm_processor_kwargs: got \{'crop': True\}; "
                                         r"TinyForConditionalGeneration takes no processor options"):
        BaseInputProcessor(CONFIG, "", {}, {"crop": True})
    proc = BaseInputProcessor(CONFIG, "", {})
    parsed = parse_prompt(3, {"prompt": "hi", "mm_processor_kwargs": {"crop": True}})
    with pytest.raises(ValueError, match=r"inputs\[3\]\.mm_processor_kwargs: got \{'crop': True\}"):
        proc.request_options("inputs[3]", parsed)
    assert proc.request_options("inputs[0]", parse_prompt(0, "hi")) == {}


def test_declared_options_merge_engine_wide_and_per_request():
    proc = WithOptions(CONFIG, "", {}, {"max_tiles": 4, "crop": False})
    parsed = parse_prompt(0, {"prompt": "hi", "mm_processor_kwargs": {"crop": True}})
    assert proc.request_options("inputs[0]", parsed) == {"max_tiles": 4, "crop": True}
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['tiles'\]; expected only \['max_tiles', 'crop'\]"):
        WithOptions(CONFIG, "", {}, {"tiles": 2})
    with pytest.raises(ValueError, match=r"\['max_tiles'\]: got 0; expected a positive integer"):
        WithOptions(CONFIG, "", {}, {"max_tiles": 0})
    with pytest.raises(TypeError, match=r"got list; expected a dict like \{'max_tiles': 4\}"):
        WithOptions(CONFIG, "", {}, [("max_tiles", 2)])


def test_item_limits_default_and_from_limit_mm_per_prompt():
    proc = WithOptions(CONFIG, "", {"video": 2})
    assert proc.max_items == {"image": 8, "video": 2} and proc.max_images == 8
    proc.check_item_counts("inputs[1]", {"image": 8, "video": 2})
    with pytest.raises(ValueError, match=r"inputs\[1\]\.multi_modal_data: got 3 videos; expected at most "
                                         r"limit_mm_per_prompt\['video'\] = 2"):
        proc.check_item_counts("inputs[1]", {"image": 1, "video": 3})
