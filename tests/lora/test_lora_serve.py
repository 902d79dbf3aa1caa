"""`mmkit serve --enable-lora --lora-modules ...` with the openai client: `model: name` selects
the adapter (ids as PEFT's), /v1/models lists adapters, unknown names are 404, and adapters
load and unload at run time."""

from __future__ import annotations

import httpx
import openai
import pytest

from lora_ref import peft_greedy
from mmkit.testing.lora import build_peft_adapter
from serve_utils import ServerProcess

PROMPT = "USER: Write a haiku about the sea. ASSISTANT:"
N = 8


@pytest.fixture(scope="module")
def adapters(tiny_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_loras")
    return {name: build_peft_adapter(tiny_ckpt, root / name, seed=seed) for name, seed in (("sea", 21), ("sky", 22))}


@pytest.fixture(scope="module")
def server(tiny_ckpt, adapters):
    proc = ServerProcess("--model", str(tiny_ckpt), "--dtype", "float32", "--served-model-name", "base",
                         "--enable-lora", "--lora-modules", f"sea={adapters['sea']}", "--max-loras", "2",
                         "--max-lora-rank", "8", "--no-ui")
    yield proc
    assert proc.stop() == 0, proc.output()[-3000:]


def completion_ids(client, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def test_adapters_by_model_name(server, tiny_ckpt, adapters):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt))
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"base", "sea"}
    assert models["sea"].parent == "base" if hasattr(models["sea"], "parent") else True
    want = {name: tok.decode(peft_greedy(tiny_ckpt, path, PROMPT, max_new_tokens=N), skip_special_tokens=True) for name, path in
            (("sea", adapters["sea"]), ("base", None))}
    assert completion_ids(client, "sea") == want["sea"]
    assert completion_ids(client, "base") == want["base"]
    chat = client.chat.completions.create(model="sea", max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "Hello"}])
    assert chat.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        completion_ids(client, "nope")

    # runtime loading: a second adapter, then unloading it
    url = server.url
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "sky", "lora_path": str(adapters["sky"])})
    assert r.status_code == 200, r.text
    assert {m.id for m in client.models.list().data} == {"base", "sea", "sky"}
    assert completion_ids(client, "sky") == tok.decode(peft_greedy(tiny_ckpt, adapters["sky"], PROMPT, max_new_tokens=N), skip_special_tokens=True)
    bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": "/nonexistent/x"})
    assert bad.status_code == 400 and "does not exist" in bad.text
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sky"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        completion_ids(client, "sky")
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sky"}).status_code == 404
