"""Network entry points (the OpenAI-compatible server). Needs the `serve` extra."""
