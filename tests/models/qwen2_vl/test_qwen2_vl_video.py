"""Qwen2-VL / Qwen2.5-VL video paths: one-frame and tensor videos, LLM.chat's video_url parts
(PyAV), Qwen2.5-VL's fps-spaced temporal positions."""

from __future__ import annotations

import pytest
import torch

from conftest import pil_to_tensor
from qwen_ref import P_VID, hf_qwen_greedy
from test_qwen2_vl import FRAMES, greedy, qwen_ckpt  # noqa: F401 - qwen_ckpt is the shared fixture
from mmkit import LLM


def test_fps_sets_qwen25_temporal_positions(qwen_ckpt):
    """`fps` (the frame rate of the given frames) spaces Qwen2.5-VL's temporal rows by
    tokens_per_second * temporal_patch / fps, as vLLM does; Qwen2-VL has no time scale."""
    from mmkit.multimodal.parse import parse_prompt

    llm = LLM(str(qwen_ckpt), dtype="float32", num_kv_blocks=8)
    proc = llm.llm_engine.input_processor
    video = {"prompt": P_VID, "multi_modal_data": {"video": FRAMES}}
    rows = proc.process(parse_prompt(0, {**video, "mm_processor_kwargs": {"fps": 2}}))
    (offset, length), = rows.placeholder_ranges
    temporal = rows.mrope_positions[0, offset:offset + length].unique() - offset
    tps = proc.tokens_per_second
    assert temporal.tolist() == ([0, int(tps * 2 / 2)] if tps else [0, 1])
    assert rows.images[0].content_hash() != proc.process(parse_prompt(0, video)).images[0].content_hash()
    if tps:  # frames 1000 s apart: temporal positions past the rotary table -> a clear error
        with pytest.raises(ValueError, match=r"inputs\[0\]: M-RoPE positions reach .*larger fps"):
            proc.process(parse_prompt(0, {**video, "mm_processor_kwargs": {"fps": 0.001}}))


def test_one_frame_video_and_tensor_frames(qwen_ckpt):
    """A one-frame video is padded to the temporal patch (as transformers does); a (T, C, H, W)
    uint8 or float tensor gives the output of the same PIL frames."""
    llm = LLM(str(qwen_ckpt), dtype="float32")
    one = [FRAMES[0]]
    tensor = torch.stack([pil_to_tensor(f) for f in FRAMES])
    outs = llm.generate([{"prompt": P_VID, "multi_modal_data": {"video": one}},
                         {"prompt": P_VID, "multi_modal_data": {"video": tensor}},
                         {"prompt": P_VID, "multi_modal_data": {"video": tensor.float() / 255}}],
                        greedy(8), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == hf_qwen_greedy(qwen_ckpt, P_VID, videos=one, max_new_tokens=8)
    ref = hf_qwen_greedy(qwen_ckpt, P_VID, videos=FRAMES, max_new_tokens=8)
    assert outs[1].outputs[0].token_ids == ref and outs[2].outputs[0].token_ids == ref


def _write_lossless_video(path, frames):
    import av
    import numpy as np

    with av.open(str(path), "w") as container:
        stream = container.add_stream("ffv1", rate=4)
        stream.width, stream.height, stream.pix_fmt = frames[0].width, frames[0].height, "bgr0"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.array(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def test_chat_video_url_and_frames(qwen_ckpt, tmp_path, monkeypatch):
    """video_url with a file (PyAV) or a list of frames, rendered by the checkpoint's template."""
    pytest.importorskip("av")
    llm = LLM(str(qwen_ckpt), dtype="float32")
    video_file = tmp_path / "clip.mkv"
    _write_lossless_video(video_file, FRAMES)
    ref = llm.generate({"prompt": P_VID, "multi_modal_data": {"video": FRAMES}}, greedy(8), use_tqdm=False)
    for url in (str(video_file), f"file://{video_file}", FRAMES):
        msg = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                            {"type": "text", "text": "Describe this video."}]}]
        out = llm.chat(msg, greedy(8), use_tqdm=False)
        assert out[0].prompt == P_VID
        assert out[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    monkeypatch.setitem(__import__("sys").modules, "av", None)  # as if PyAV were not installed
    msg = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": str(video_file)}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\[0\]\.content\[0\]\.video_url: .*needs PyAV.*pip install av"):
        llm.chat(msg, greedy(4), use_tqdm=False)
