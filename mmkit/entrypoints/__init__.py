"""Entry points, as vLLM lays them out: `llm.py` (`LLM`, the offline API), `chat_utils.py`
(chat messages -> prompts), `cli/` (the `mmkit` command), `openai/` (the OpenAI-compatible
server; needs the `serve` extra), `ui/` (the playground page) and `lmms/` (the lmms-eval model).
Nothing here is imported by `import mmkit` until used."""
