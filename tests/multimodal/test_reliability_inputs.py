"""Bad inputs cost that input alone: a clear error before any request is added, engine left clean.

And the odd-but-valid images (1x1, grayscale, RGBA, palette, CMYK, 1-bit, thin) just work.
Also covers `mmkit.multimodal.image_io.load_image` (files, bytes, data URIs, file:// URLs).
"""

import base64
import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import get_llm, hf_greedy, make_image, pil_to_tensor
from mmkit import LLM, MultiModalData, SamplingParams
from mmkit.multimodal.image_io import load_image
from mmkit.multimodal.items import MAX_IMAGE_PIXELS

PROMPT = "USER: <image>\nWhat is in the image? ASSISTANT:"
GREEDY = SamplingParams(temperature=0, max_tokens=6)
IMAGE = MultiModalData.Type.IMAGE
EMBEDS = MultiModalData.Type.IMAGE_EMBEDS


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return get_llm(tiny_ckpt)


def image_prompt(data, prompt=PROMPT):
    return {"prompt": prompt, "multi_modal_data": {"image": data}}


def assert_rejected(llm, bad, exc_type, *fragments, monkeypatch=None, index=1):
    """`bad` at inputs[index] of a batch: rejected before anything is added; engine clean after."""
    engine = llm.llm_engine
    added = []
    original = engine.add_processed
    if monkeypatch is not None:
        monkeypatch.setattr(engine, "add_processed", lambda rid, *a: (added.append(rid), original(rid, *a)))
    batch = ["a fine prompt", bad, "another fine prompt"]
    with pytest.raises(exc_type) as info:
        llm.generate(batch, GREEDY, use_tqdm=False)
    msg = str(info.value)
    assert f"inputs[{index}]" in msg, msg
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    assert added == [], "a request was added before the error"
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if monkeypatch is not None:
        monkeypatch.setattr(engine, "add_processed", original)
    assert llm.generate("the next call works", GREEDY, use_tqdm=False)[0].finished
    return msg


# ---------------------------------------------------------------------- prompts
def test_prompt_longer_than_max_model_len_counts_image_tokens(tiny_ckpt, monkeypatch):
    probe = get_llm(tiny_ckpt)
    seq_len = probe.llm_engine.config.model.capabilities.image_seq_length
    text = "USER: <image>\n" + "the sea " * 20 + "ASSISTANT:"
    num_text = len(probe.get_tokenizer()(text.replace("<image>", "")).input_ids)
    max_len = num_text + seq_len // 2  # the text alone fits; with its image tokens it does not
    llm = LLM(str(tiny_ckpt), dtype="float32", max_model_len=max_len)
    assert_rejected(llm, image_prompt(make_image(1), text), ValueError, f"max_model_len = {max_len}",
                    f"{num_text + seq_len} tokens (text plus image tokens)", monkeypatch=monkeypatch)
    assert_rejected(llm, {"prompt_token_ids": [5] * (max_len + 1)}, ValueError, f"{max_len + 1} tokens",
                    f"max_model_len = {max_len}")
    assert llm.generate(image_prompt(make_image(1)), GREEDY, use_tqdm=False)[0].finished


@pytest.mark.parametrize("bad,exc,fragments", [
    ("", ValueError, ["empty prompt", "non-empty"]),
    ({"prompt": ""}, ValueError, ["prompt", "empty"]),
    ({"prompt_token_ids": []}, ValueError, ["prompt_token_ids", "empty list"]),
    ({"prompt_token_ids": [1, 384]}, ValueError, ["prompt_token_ids", "384", "[0, 384)"]),
    ({"prompt_token_ids": [1, 10**30]}, ValueError, ["prompt_token_ids", "[0, 384)"]),
    ({"prompt_token_ids": [1, -1]}, ValueError, ["prompt_token_ids[1]", "-1", "non-negative"]),
    ({"prompt_token_ids": [1, 2.5]}, TypeError, ["prompt_token_ids[1]", "2.5", "int"]),
    ({"prompt_token_ids": [1, True]}, TypeError, ["prompt_token_ids[1]", "True", "int"]),
    ({"prompt_token_ids": "1 2 3"}, TypeError, ["prompt_token_ids", "str", "list of ints"]),
    ({"prompt_token_ids": torch.tensor([[1, 2]])}, TypeError, ["prompt_token_ids", "(1, 2)", "flat list"]),
    ({"prompt": "x", "images": [1]}, ValueError, ["unknown key", "images", "multi_modal_data"]),
    ({"prompt": "x", "multi_modal_data": {"video": 1}}, ValueError, ["multi_modal_data", "video", "image"]),
    ({"prompt": "x", "multi_modal_data": "cat.png"}, TypeError, ["multi_modal_data", "str", "MultiModalData"]),
    (42, TypeError, ["int", "prompt string"]),
    (None, TypeError, ["NoneType", "prompt string"]),
])
def test_bad_prompt_forms(llm, monkeypatch, bad, exc, fragments):
    assert_rejected(llm, bad, exc, *fragments, monkeypatch=monkeypatch)


def test_more_images_than_limit(tiny_ckpt, monkeypatch):
    llm = LLM(str(tiny_ckpt), dtype="float32", limit_mm_per_prompt={"image": 1})
    two = image_prompt([make_image(1), make_image(2)], "USER: <image><image>\nCompare. ASSISTANT:")
    assert_rejected(llm, two, ValueError, "2 images", "limit_mm_per_prompt['image'] = 1", monkeypatch=monkeypatch)
    assert llm.generate(image_prompt(make_image(1)), GREEDY, use_tqdm=False)[0].finished


@pytest.mark.parametrize("prompt,num_images,fragments", [
    ("USER: <image> <image>\nHi ASSISTANT:", 1, ["2 image placeholder", "1 image(s)", "<image>"]),
    ("USER: no placeholder ASSISTANT:", 1, ["0 image placeholder", "1 image(s)"]),
    ("USER: <image>\nHi ASSISTANT:", 3, ["1 image placeholder", "3 image(s)"]),
])
def test_placeholder_image_count_mismatch(llm, monkeypatch, prompt, num_images, fragments):
    images = [make_image(i) for i in range(num_images)]
    assert_rejected(llm, image_prompt(images, prompt), ValueError, *fragments, monkeypatch=monkeypatch)


def test_placeholder_without_image(llm, monkeypatch):
    assert_rejected(llm, {"prompt": PROMPT}, ValueError, "1 image placeholder", "0 image(s)", monkeypatch=monkeypatch)


# ---------------------------------------------------------------------- image tensors and embeddings
@pytest.mark.parametrize("tensor,exc,fragments", [
    (torch.zeros(30, 40, dtype=torch.uint8), ValueError, ["shape (30, 40)", "NCHW or CHW"]),
    (torch.zeros(1, 1, 3, 30, 40, dtype=torch.uint8), ValueError, ["shape (1, 1, 3, 30, 40)", "NCHW"]),
    (torch.zeros(30, 40, 3, dtype=torch.uint8), ValueError, ["30 channels", "expected 1 or 3"]),  # HWC
    (torch.zeros(1, 4, 30, 40, dtype=torch.uint8), ValueError, ["4 channels", "expected 1 or 3"]),
    (torch.zeros(2, 30, 40, dtype=torch.uint8), ValueError, ["2 channels"]),
    (torch.zeros(0, 3, 30, 40), ValueError, ["no image", "N >= 1"]),
    (torch.zeros(3, 0, 40, dtype=torch.uint8), ValueError, ["0x", "at least 1x1"]),
    (torch.zeros(3, 30, 40, dtype=torch.int32), TypeError, ["torch.int32", "uint8"]),
    (torch.zeros(3, 30, 40, dtype=torch.int64), TypeError, ["torch.int64", "uint8"]),
    (torch.zeros(3, 30, 40, dtype=torch.bool), TypeError, ["torch.bool", "uint8"]),
    (torch.zeros(3, 30, 40, dtype=torch.complex64), TypeError, ["complex64", "uint8"]),
    (torch.full((3, 30, 40), float("nan")), ValueError, ["NaN or Inf", "finite"]),
    (torch.full((3, 30, 40), float("inf"), dtype=torch.float16), ValueError, ["NaN or Inf"]),
    (torch.full((3, 30, 40), 1.5), ValueError, ["[1.5, 1.5]", "[0, 1]"]),
    (torch.full((3, 30, 40), -0.25, dtype=torch.float64), ValueError, ["[-0.25, -0.25]", "[0, 1]"]),
    (torch.full((3, 30, 40), 255.0), ValueError, ["255", "not normalized pixel_values"]),
])
def test_bad_image_tensors(llm, monkeypatch, tensor, exc, fragments):
    msg = assert_rejected(llm, image_prompt(tensor), exc, "multi_modal_data", *fragments, monkeypatch=monkeypatch)
    assert "got" in msg and "expected" in msg


def test_bad_image_list_items(llm, monkeypatch):
    assert_rejected(llm, image_prompt([make_image(1), "cat.png"]), TypeError,
                    "multi_modal_data[1]", "str", "PIL image", monkeypatch=monkeypatch)
    assert_rejected(llm, image_prompt(None), TypeError, "NoneType", "PIL image", monkeypatch=monkeypatch)


@pytest.mark.parametrize("make,exc,fragments", [
    (lambda L, H: torch.zeros(1, L, H + 1), ValueError, ["image_seq_length", "hidden_size"]),
    (lambda L, H: torch.zeros(1, L - 1, H), ValueError, ["image_seq_length"]),
    (lambda L, H: torch.zeros(1, 1, L, H), ValueError, ["[N, image_seq_length, hidden_size]"]),
    (lambda L, H: torch.zeros(L * H), ValueError, ["[N, image_seq_length, hidden_size]"]),
    (lambda L, H: torch.zeros(1, L, H, dtype=torch.int64), TypeError, ["int64", "float"]),
    (lambda L, H: torch.full((1, L, H), float("nan")), ValueError, ["NaN or Inf"]),
    (lambda L, H: [[0.0] * H] * L, TypeError, ["list", "tensor"]),
])
def test_bad_image_embeds(llm, monkeypatch, make, exc, fragments):
    cfg = llm.llm_engine.config.model
    data = make(cfg.capabilities.image_seq_length, cfg.hidden_size)
    bad = {"prompt": PROMPT, "multi_modal_data": MultiModalData(type=EMBEDS, data=data)}
    assert_rejected(llm, bad, exc, "multi_modal_data", *fragments, monkeypatch=monkeypatch)


def test_decompression_bomb_sized_pil_image(llm, monkeypatch):
    bomb = Image.new("1", (20000, 20000))  # 400M pixels, 50 MB as bits: cheap to make, huge to resize
    assert_rejected(llm, image_prompt(bomb), ValueError, "20000x20000", str(MAX_IMAGE_PIXELS),
                    "decompression-bomb", monkeypatch=monkeypatch)
    huge_tensor = torch.zeros(1, 1, 10000, 9000, dtype=torch.uint8).expand(1, 1, 10000, 9000)
    assert_rejected(llm, image_prompt(huge_tensor), ValueError, "9000x10000", str(MAX_IMAGE_PIXELS),
                    monkeypatch=monkeypatch)


# ---------------------------------------------------------------------- invalid sampling parameters
@pytest.mark.parametrize("kwargs,fragment", [
    ({"temperature": -1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"stop": [""]}, "stop[0]"),
    ({"stop": 5}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids[0]"), ({"logprobs": -1}, "logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"seed": "x"}, "seed"), ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_invalid_sampling_params(kwargs, fragment):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    msg = str(info.value)
    assert msg.startswith(fragment) and "got" in msg and "expected" in msg


def test_sampling_params_of_wrong_type_in_generate(llm):
    with pytest.raises(TypeError, match=r"sampling_params\[1\]: got dict"):
        llm.generate(["a", "b"], [GREEDY, {"temperature": 0}], use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params: got str"):
        llm.generate(["a", "b"], "greedy", use_tqdm=False)
    with pytest.raises(TypeError):
        SamplingParams(temprature=0)  # misspelt keyword
    assert not llm.llm_engine.has_unfinished_requests()


# ---------------------------------------------------------------------- files and bytes (image_io)
def png_bytes(img):
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def png_claiming_size(width, height):
    """A 99-byte PNG whose header claims width x height (what a decompression bomb looks like)."""
    data = bytearray(png_bytes(Image.new("1", (1, 1))))
    ihdr = data[12:29]
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)) & 0xFFFFFFFF)
    return bytes(data)


@pytest.fixture(scope="module")
def image_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("images")
    good = make_image(5, 64, 48)
    raw = png_bytes(good)
    files = {
        "good.png": raw,
        "truncated.png": raw[: len(raw) // 2],
        "corrupt.png": raw[:40] + bytes(range(256)) * 4,
        "notes.jpg": b"these are my notes, not a picture\n" * 5,
        "empty.png": b"",
        "bomb.png": png_claiming_size(20000, 20000),
        "bomb_warning_zone.png": png_claiming_size(10000, 10000),  # PIL only warns here
    }
    for name, data in files.items():
        (d / name).write_bytes(data)
    buf = io.BytesIO()
    good.save(buf, "JPEG", quality=90)
    (d / "good.jpg").write_bytes(buf.getvalue())
    (d / "truncated.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 3])
    return d, good


@pytest.mark.parametrize("name,fragments", [
    ("missing.png", ["does not exist", "existing image file"]),
    ("truncated.png", ["corrupt or truncated"]),
    ("truncated.jpg", ["corrupt or truncated"]),
    ("corrupt.png", ["starts like a PNG file but is corrupt"]),
    ("notes.jpg", ["not an image"]),
    ("empty.png", ["empty (0 bytes)"]),
    ("bomb.png", ["decompression-bomb", str(MAX_IMAGE_PIXELS)]),
    ("bomb_warning_zone.png", ["decompression-bomb", str(MAX_IMAGE_PIXELS)]),
])
def test_load_image_bad_files(image_files, name, fragments):
    d, _ = image_files
    path = d / name
    for source in (path, str(path), path.as_uri()):
        with pytest.raises(ValueError) as info:
            load_image(source, where="inputs[4].multi_modal_data")
        msg = str(info.value)
        assert msg.startswith("inputs[4].multi_modal_data: ") and name in msg and "expected" in msg, msg
        for fragment in fragments:
            assert fragment in msg, msg
        assert not isinstance(info.value, OSError)
    if path.exists():  # the same content as bytes and as a data URI
        data = path.read_bytes()
        with pytest.raises(ValueError, match=r"inputs\[0\]: bytes"):
            load_image(data, where="inputs[0]")
        with pytest.raises(ValueError, match=r"inputs\[0\]: (data URI|the data URI)"):
            load_image("data:image/png;base64," + base64.b64encode(data).decode(), where="inputs[0]")


def test_load_image_bad_sources(image_files):
    d, _ = image_files
    cases = [
        (str(d), ["is a directory"]),
        ("", ["empty string"]),
        ("data:text/plain;base64,aGVsbG8=", ["data:image/<format>;base64"]),
        ("data:image/png;base64,@@not base64@@", ["base64"]),
        ("file://otherhost/x.png", ["otherhost", "file:///path"]),
    ]
    for source, fragments in cases:
        with pytest.raises(ValueError) as info:
            load_image(source, where="images[2]")
        assert str(info.value).startswith("images[2]: ")
        for fragment in fragments:
            assert fragment in str(info.value)
    with pytest.raises(TypeError, match="images\\[2\\]: got int"):
        load_image(123, where="images[2]")


def test_load_image_good_sources_decode_fully(image_files):
    d, good = image_files
    raw = (d / "good.png").read_bytes()
    sources = [d / "good.png", str(d / "good.png"), (d / "good.png").as_uri(), raw, bytearray(raw),
               "data:image/png;base64," + base64.b64encode(raw).decode(), Image.open(d / "good.png")]
    for source in sources:
        img = load_image(source, where="x")
        assert img.size == (64, 48) and img.mode == "RGB"
        assert np.array_equal(np.asarray(img), np.asarray(good))
        assert getattr(img, "fp", None) is None  # decoded: no open file handle
    assert load_image(d / "good.jpg", where="x").size == (64, 48)


@pytest.mark.parametrize("mode,expected", [
    ("L", "L"), ("RGB", "RGB"), ("RGBA", "RGBA"), ("P", "P"), ("1", "L"), ("LA", "RGBA"),
    ("CMYK", "RGB"), ("I;16", "L"), ("I", "L"), ("F", "L"), ("YCbCr", "RGB"),
])
def test_load_image_modes(tmp_path, mode, expected):
    base = make_image(7)
    img = Image.new("I;16", (40, 30), 40000) if mode == "I;16" else base.convert(mode)
    fmt = "JPEG" if mode in ("CMYK", "YCbCr") else ("TIFF" if mode in ("F", "I") else "PNG")
    path = tmp_path / f"img.{fmt.lower()}"
    img.save(path, fmt)
    out = load_image(path, where="x")
    assert out.mode == expected and out.size == (40, 30)
    if mode == "I;16":  # 16-bit is scaled, not clipped: 40000/65535 of full scale
        assert np.asarray(out).max() == round(40000 * 255 / 65535)


def test_truncated_file_opened_lazily_is_rejected_up_front(llm, image_files, monkeypatch):
    d, _ = image_files
    lazy = Image.open(d / "truncated.png")  # PIL reads only the header here
    msg = assert_rejected(llm, image_prompt(lazy), ValueError, "truncated.png", "could not be decoded",
                          monkeypatch=monkeypatch)
    assert "multi_modal_data" in msg


def test_lazy_files_decode_side_by_side_and_the_first_bad_input_is_reported(llm, image_files):
    """A call's lazily opened files are decoded on the prefetch workers before anything is
    added; the error is the first bad input in input order, whatever kind the later one is."""
    d, _ = image_files
    prefetcher = llm.llm_engine.prefetcher
    assert prefetcher is not None
    good = [image_prompt(Image.open(d / "good.png")) for _ in range(4)]
    bad_file = image_prompt(Image.open(d / "truncated.png"))
    with pytest.raises(ValueError, match=r"inputs\[2\].*truncated.png"):
        llm.generate(good[:2] + [bad_file, {"prompt": 3}] + good[2:], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match=r"inputs\[1\]\.prompt"):
        llm.generate(good[:1] + [{"prompt": 3}, image_prompt(Image.open(d / "truncated.png"))], GREEDY,
                     use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    import threading

    from mmkit.multimodal.items import ImageItem

    lazy = [image_prompt(Image.open(d / "good.png")) for _ in range(3)]
    threads, original = [], ImageItem.to_pil

    def recording(item):
        threads.append(threading.current_thread().name)
        return original(item)

    ImageItem.to_pil = recording
    try:
        outs = llm.generate(lazy, GREEDY, use_tqdm=False)
    finally:
        ImageItem.to_pil = original
    assert all(item["multi_modal_data"]["image"].tile in ([], None) for item in lazy)  # decoded in place
    assert threads[:3] and all(t.startswith("mmkit-preprocess") for t in threads[:3]), threads
    ref = llm.generate(image_prompt(load_image(d / "good.png", where="x")), GREEDY, use_tqdm=False)
    assert all(o.outputs[0].token_ids == ref[0].outputs[0].token_ids for o in outs)


def test_loaded_file_gives_same_output_as_the_image(llm, image_files):
    d, good = image_files
    from_file = llm.generate(image_prompt(load_image(d / "good.png", where="inputs[0]")), GREEDY, use_tqdm=False)
    direct = llm.generate(image_prompt(good), GREEDY, use_tqdm=False)
    assert from_file[0].outputs[0].token_ids == direct[0].outputs[0].token_ids


# ---------------------------------------------------------------------- valid odd images
def odd_images():
    base = make_image(11)
    return {
        "1x1": Image.new("RGB", (1, 1), (200, 10, 10)),
        "1x3": make_image(12, 1, 3),
        "L": base.convert("L"),
        "RGBA": base.convert("RGBA"),
        "P": base.convert("P"),
        "CMYK": base.convert("CMYK"),
        "1bit": base.convert("1"),
        "LA": base.convert("LA"),
        "I;16": Image.new("I;16", (40, 30), 1234),
        "thin_4000x30": make_image(13, 4000, 30),
        "tall_30x4000": make_image(14, 30, 4000),
        "tensor_1ch_uint8": torch.randint(0, 256, (1, 30, 40), dtype=torch.uint8),
        "tensor_1ch_float16": torch.rand(1, 1, 30, 40).half(),
        "tensor_bfloat16": torch.rand(3, 30, 40).bfloat16(),
        "tensor_1x1": torch.tensor([[[0.5]], [[0.25]], [[1.0]]]),
        "noncontiguous": pil_to_tensor(make_image(15)).transpose(1, 2)[:, ::2, :],
    }


def test_odd_valid_images_all_produce_output(llm):
    images = odd_images()
    batch = [image_prompt(img) for img in images.values()]
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    for name, out in zip(images, outs):
        assert out.finished and len(out.outputs[0].token_ids) == 4, name
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("name", ["1x1", "L", "P", "RGBA", "thin_4000x30", "1bit"])
def test_odd_images_match_hf(llm, tiny_ckpt, name):
    img = odd_images()[name]
    out = llm.generate(image_prompt(img), SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(tiny_ckpt, prompt=PROMPT, images=img, max_new_tokens=8)


def test_one_channel_tensor_equals_grayscale_pil(llm):
    gray = make_image(16).convert("L")
    tensor = torch.from_numpy(np.array(gray))[None]  # [1, H, W] uint8
    a = llm.generate(image_prompt(tensor), GREEDY, use_tqdm=False)
    b = llm.generate(image_prompt(gray), GREEDY, use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
