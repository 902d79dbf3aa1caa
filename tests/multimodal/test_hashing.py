"""Content hashes are SHA-256 over bytes: equal in every process (no salted `hash()`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from mmkit.engine.block_hashes import block_hash
from mmkit.multimodal.hashing import image_content_hash

_SCRIPT = r"""
import json, sys
sys.path.insert(0, {tests!r})
from conftest import make_image
from mmkit.engine.block_hashes import block_hash
from mmkit.multimodal.hashing import image_content_hash
from mmkit.multimodal.items import ImageItem
img = image_content_hash(ImageItem(make_image(3), 40, 30))
first = block_hash(None, [1, 2, 3, 4], ())
second = block_hash(first, [5, 6, 7, 8], ((img, 2),))
print(json.dumps([img, first.hex(), second.hex()]))
"""


def _keys_in_fresh_process(seed: str) -> list[str]:
    tests = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run([sys.executable, "-c", _SCRIPT.format(tests=tests)], env=env, check=True,
                         capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_block_and_image_hashes_equal_in_two_processes():
    from conftest import make_image
    from mmkit.multimodal.items import ImageItem

    img = image_content_hash(ImageItem(make_image(3), 40, 30))
    first = block_hash(None, [1, 2, 3, 4], ())
    here = [img, first.hex(), block_hash(first, [5, 6, 7, 8], ((img, 2),)).hex()]
    assert _keys_in_fresh_process("1") == here
    assert _keys_in_fresh_process("2") == here
    assert len(first) == 32 and len(img) == 64  # SHA-256


def test_block_keys_separate_tokens_images_and_offsets():
    img_a, img_b = "a" * 64, "b" * 64
    base = block_hash(None, [1, 2, 3, 4], ())
    keys = {
        base,
        block_hash(None, [1, 2, 3, 5], ()),
        block_hash(base, [1, 2, 3, 4], ()),  # same tokens, another parent
        block_hash(None, [1, 2, 3, 4], ((img_a, 0),)),
        block_hash(None, [1, 2, 3, 4], ((img_b, 0),)),
        block_hash(None, [1, 2, 3, 4], ((img_a, 4),)),
    }
    assert len(keys) == 6
